"""The constructed G4 control: an RL run whose generator is sent weights that differ from the trainer's.

    config = load_rl_config("rl-tiny", ["verify=true", "control=generator-weight-ulp"])
    sent = generator_weights(snapshot, config.control)   # what the generator loads (the trainer keeps `snapshot`)

The zero-gap check compares every sampled token's generator log-prob with the trainer's
recomputation under the trainer's weights. A control run makes the two sides differ by a
difference this module constructs, so the check must report a gap on any CPU, whatever the native
libraries do there:

- `generator-weight-ulp` (config key `control`): every weight sync sends the generator the
  trainer's weights with one element moved one ulp toward +inf (`torch.nextafter`): element 0 of
  `layers.0.input_layernorm.weight`, the norm weight that scales every token's first attention
  input, so the difference reaches every token's logits. The failure it stands for: the weights a
  generator serves are not the weights being trained (a sync or export that lost a bit).

Guarantees:
- The difference is the project's: the perturbed element is fixed by name and the step is one
  ulp, so the control run's generator and trainer compute in the same kernels from inputs that
  differ by that one element; in batch-invariant mode the sampled tokens' log-probs then differ
  on every CPU (tests/rl/test_loop.py asserts it).
- The trainer's weights are never touched: `generator_weights` returns a new dict sharing every
  other tensor and a perturbed copy of the one it changes. The weight-sync check (rl/rollouts.py)
  compares the generator's weights with the fingerprints of what was sent, so it still proves the
  generator holds exactly those weights; the audit records their digest (`generator_weights`).
- `None` (the default, no control) returns the trainer's own dict: normal runs are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

Control = Literal["generator-weight-ulp"]
CONTROLS: tuple[str, ...] = ("generator-weight-ulp",)
CONFIG_KEY = "control"
PERTURBED_TENSOR = "layers.0.input_layernorm.weight"  # scales every token's first attention input

DESCRIPTIONS = {
    "generator-weight-ulp": f"generator sent the trainer's weights with {PERTURBED_TENSOR}[0] one ulp up",
}


def check_control(control: object, key: str = CONFIG_KEY) -> str | None:
    """`control` if it names a control (or None: no control), else ValueError naming `key`."""
    if control is not None and control not in CONTROLS:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, CONTROLS))} (or unset), got {control!r}")
    return control  # type: ignore[return-value]


def describe(control: str | None) -> str:
    """One line: what the control run's generator gets ("" for None)."""
    return "" if control is None else DESCRIPTIONS[check_control(control)]


def generator_weights(weights: Mapping[str, torch.Tensor], control: str | None) -> dict[str, torch.Tensor]:
    """The weights a weight sync sends the generator: `weights` itself without a control; under
    `generator-weight-ulp` a new dict with `PERTURBED_TENSOR`'s element 0 moved one ulp toward +inf
    (that tensor copied; `weights` untouched)."""
    check_control(control)
    if control is None:
        return weights  # type: ignore[return-value]
    if PERTURBED_TENSOR not in weights:
        raise ValueError(f"{CONFIG_KEY} = {control!r}: the weights have no tensor {PERTURBED_TENSOR!r}")
    source = weights[PERTURBED_TENSOR]
    if not source.is_floating_point() or source.numel() == 0:
        raise ValueError(f"{CONFIG_KEY} = {control!r}: {PERTURBED_TENSOR!r} is not a non-empty float tensor")
    moved = source.detach().clone()
    flat = moved.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype, device=flat.device))
    return {**weights, PERTURBED_TENSOR: moved}
