"""The demo's shared state and how a stage runs: `Demo` holds the rows, timings and run names, and
runs a stage, a logged subprocess or a training run for the stages in demo/stages/.

Guarantees:
- a stage that raises is a FAIL row with its reason (and its log), never a crash: the demo goes on,
  and the stages that need a failed one say so in their rows (`needs`);
- a subprocess stage's output goes to OUT/logs/<name>.log whole (and to the listener, line by
  line, with `verbose`);
- every run directory a stage makes is named through `path(role, name)`, so demo.json lists them all.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_audit.demo.listener import Listener
from titan_audit.demo.plan import RECIPE, Plan
from titan_audit.demo.verdicts import Row, ordered


@dataclass
class Demo:
    out: Path
    plan: Plan
    verbose: bool
    listener: Listener = field(default_factory=Listener)
    rows: list[Row] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # stage -> why
    extra: dict[str, Any] = field(default_factory=dict)

    def path(self, role: str, name: str) -> Path:
        self.runs[role] = name
        return self.out / name

    def say(self, text: str) -> None:
        self.listener.on_message(text)

    def row(self, guarantee: str, checked: str, ok: bool | None, detail: str = "", evidence: str | Path = "") -> None:
        result = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        row = Row(guarantee, checked, result, detail, str(evidence))
        self.rows.append(row)
        self.listener.on_row(row)

    def needs(self, *stages: str) -> str | None:
        missing = [s for s in stages if s in self.failed]
        return f"needs {', '.join(missing)}, which failed" if missing else None

    def run_logged(
        self,
        name: str,
        command: list[str],
        env: dict[str, str] | None = None,
        on_start: Callable[[subprocess.Popen], None] | None = None,
    ) -> int:
        """Run `command`, its output to OUT/logs/NAME.log (and, with `verbose`, to `on_output`); its exit code."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as sink:
            sink.write("$ " + " ".join(command) + "\n")
            sink.flush()
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
            )
            # same process group: Ctrl-C in the terminal reaches the child (torchrun passes it on)

            def pump() -> None:
                for line in proc.stdout:  # type: ignore[union-attr]
                    sink.write(line)
                    if self.verbose:
                        self.listener.on_output(name, line.rstrip())

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            if on_start is not None:
                on_start(proc)
            rc = proc.wait()
            reader.join(timeout=10)
        return rc

    def train_subprocess(
        self,
        name: str,
        out: Path,
        overrides: list[str],
        nproc: int | None,
        on_start: Callable[[subprocess.Popen], None] | None = None,
    ) -> int:
        """`titan-audit train --config RECIPE --out OUT [--nproc N] --set ...` as a child process
        (the user's own command: its checks, run lock and launcher), output to OUT/logs/NAME.log."""
        command = [
            sys.executable,
            "-m",
            "titan_audit.cli",
            "train",
            "--config",
            RECIPE,
            "--out",
            str(out),
            *(["--nproc", str(nproc)] if nproc else []),
            *[a for o in overrides for a in ("--set", o)],
        ]
        return self.run_logged(name, command, on_start=on_start)

    def train_here(self, out: Path, overrides: list[str], resume: bool = False) -> None:
        from titan_audit.trainer.config import load_config
        from titan_audit.trainer.launch import LaunchOptions, launch
        from titan_audit.trainer.train import TRAIN_JOB

        config = load_config(RECIPE, overrides)
        options = LaunchOptions(resume=resume, quiet=not self.verbose)
        TRAIN_JOB.check_run(config, out, 1, options)
        rc = launch(TRAIN_JOB, config, out, nproc=None, options=options)
        if rc:
            raise RuntimeError(f"training into {out} exited {rc}")

    def stage(
        self,
        name: str,
        title: str,
        fn: Callable[[Demo], None],
        log: str | None = None,
        background: bool = False,
    ) -> None:
        """Run stage `fn(self)`, reporting its start and end; an exception is a FAIL row (see the module docstring)."""
        self.listener.on_stage(name, title, background)
        start = time.perf_counter()
        try:
            fn(self)
        except Exception as error:  # a failed stage is a FAIL row, the demo goes on
            reason = f"{type(error).__name__}: {error}"
            self.failed[name] = reason
            self.row(
                title.split(":")[0],
                f"stage {name}",
                False,
                reason[:300],
                self.out / "logs" / f"{log}.log" if log else "",
            )
            if self.verbose:
                import traceback

                self.say(traceback.format_exc())
        seconds = time.perf_counter() - start
        self.stages.append({"name": name, "seconds": seconds, "log": log})
        self.listener.on_done(name, seconds)

    def summary(self, seconds: float, numerics: str) -> dict[str, Any]:
        """demo.json: the verdicts in table order, the stages' timings, the runs and what the stages added."""
        return {
            "kind": "demo",
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "quick": self.plan.quick,
            "steps": self.plan.steps,
            "seconds": seconds,
            "numerics": numerics,
            "passed": self.passed,
            "rows": [r.__dict__ for r in ordered(self.rows)],
            "stages": self.stages,
            "runs": self.runs,
            **self.extra,
        }

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.result != "FAIL" for r in self.rows)
