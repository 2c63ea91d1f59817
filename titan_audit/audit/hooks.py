"""The forward and output-gradient hooks of the Recorder's level `full` (audit/recorder.py states
what they record): which modules they go on, and the names their records take.

`ModuleHooks` is a part of `Recorder` (a mixin): it reads the Recorder's step, microbatch,
patterns and pause state, and records through its `_record`.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

ROOT_NAME = "<root>"


class ModuleHooks:
    """Selecting modules by glob pattern and hooking their outputs (module doc)."""

    def selected_modules(self, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """(name, module) of every module whose name (`ROOT_NAME` for the root) matches a pattern
        and no exclusion, in `named_modules()` order."""
        out = []
        for qname, sub in module.named_modules():
            name = qname or ROOT_NAME
            if any(fnmatch.fnmatchcase(name, p) for p in self.patterns) and not any(
                fnmatch.fnmatchcase(name, p) for p in self.exclude
            ):
                out.append((name, sub))
        return out

    def _attach_hooks(self, module: torch.nn.Module) -> None:
        for name, sub in self.selected_modules(module):
            self._handles.append(sub.register_forward_hook(self._make_forward_hook(name)))

    def _make_forward_hook(self, module_name: str):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if self._paused or self.step is None:
                return
            if torch._C._current_graph_task_id() != -1:
                return  # a forward run by the autograd engine: activation-checkpoint recomputation
            step, mb = self.step, self.microbatch
            count = self._calls.get((mb, module_name), 0)
            self._calls[(mb, module_name)] = count + 1
            base = module_name if count == 0 else f"{module_name}@{count}"
            if isinstance(output, torch.Tensor):
                leaves = [("", output)]
            else:
                flat, _ = tree_flatten_with_path(output)
                leaves = [(keystr(path), leaf) for path, leaf in flat if isinstance(leaf, torch.Tensor)]
            for suffix, tensor in leaves:
                name = base + suffix
                self._record("forward", name, tensor, mb, step)
                if tensor.requires_grad:
                    tensor.register_hook(self._make_grad_hook(name, mb, step))

        return hook

    def _make_grad_hook(self, name: str, microbatch: int, step: int):
        fired = [0]

        def hook(grad: torch.Tensor) -> None:
            if not self._paused:
                # a second backward through the same graph (retain_graph) records as name#1, ...
                self._record("backward", name if not fired[0] else f"{name}#{fired[0]}", grad, microbatch, step)
                fired[0] += 1

        return hook
