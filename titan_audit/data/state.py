"""Loader state: where the data stream stands, the same on every rank, O(1) to resume from.

State = (epoch, step) of the next step to deliver, the batch spec that fixes the batches, and the
source manifest (its digest plus the entries, so a change can be named file by file). It holds
nothing per rank or per worker, so a checkpoint stores it once and any W dividing V resumes it.
`save`/`load` use JSON, written atomically; a file that is not UTF-8 JSON is a ValueError naming
its line (data/textio.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_audit.atomic import write_bytes_atomic
from titan_audit.data.manifest import SourceManifest
from titan_audit.data.textio import load_json

STATE_FORMAT = "titan-audit.loader-state.v1"


@dataclass(frozen=True)
class LoaderState:
    epoch: int
    step: int  # step within the epoch: the next one to deliver
    spec: dict[str, Any]  # BatchSpec.to_dict()
    manifest_digest: str
    manifest: SourceManifest | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "step": self.step,
            "spec": self.spec,
            "manifest_digest": self.manifest_digest,
            "manifest": self.manifest.to_dict() if self.manifest is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "loader state") -> LoaderState:
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{source}: not a loader state (format {data.get('format') if isinstance(data, dict) else None!r})"
            )
        for key in ("epoch", "step", "spec", "manifest_digest"):
            if key not in data:
                raise ValueError(f"{source}: missing key {key!r}")
        manifest = data.get("manifest")
        return cls(
            int(data["epoch"]),
            int(data["step"]),
            dict(data["spec"]),
            str(data["manifest_digest"]),
            SourceManifest.from_dict(manifest, source=source) if manifest else None,
        )

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        write_bytes_atomic(path, json.dumps(self.to_dict(), sort_keys=True).encode(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike) -> LoaderState:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{path}: no such loader state file") from None
        data = load_json(raw, path)  # a bad byte or line: ValueError naming the line
        return cls.from_dict(data, source=str(path))
