"""G4 zero gap: GRPO (`rl-tiny`, small) from the trained run, verified by `rl.verify.verify_onpolicy`
(the library function behind `titan-audit verify-onpolicy`): every sampled token's generator
log-prob equals the trainer's recomputation bitwise, with the built-in generator and, when
`titan_audit.rl.vllm` says it is available, vLLM (not with --quick: its engine start-up dominates
the stage; the row says so).

Guarantees: the constructed control (rl/control.py: the generator is sent the trainer's weights
with one element one ulp off) must show a gap, else the G4 control row FAILs; without --quick the
same run with native ops is reported in that row and counted in no verdict (whether native ops
leave a gap depends on the CPU's libraries). The runs sit side by side in OUT: rl-builtin,
rl-control, rl-native, rl-vllm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_audit.demo.plan import RL_RECIPE
from titan_audit.demo.runner import Demo


def vllm_status() -> tuple[bool, str]:
    """(usable, why not): usable iff `titan_audit.rl.vllm.available()` (a bool: the `vllm` extra is
    installed); otherwise the reason is a SKIP row's text with `INSTALL_HINT`. An extra that is
    installed but broken is not hidden here: the vLLM stage then fails with vLLM's own error."""
    from titan_audit.rl import vllm as rl_vllm

    if rl_vllm.available():
        return True, ""
    return False, f"skipped: vLLM is not installed here ({rl_vllm.INSTALL_HINT})"


def _verify(
    demo: Demo, out: Path, extra: list[str], control: Path | None = None, native: Path | None = None
) -> dict[str, Any]:
    """verify_onpolicy of RL_RECIPE into `out` from the trained 1-rank run (the deterministic init
    if it failed), with the control into `control` and the native-ops run into `native` when given;
    write_onpolicy_report's dict (the summaries of the run and its companions)."""
    from titan_audit.rl.verify import verify_onpolicy

    init = demo.out / "train-w1" if "train_w1" not in demo.failed else None
    result = verify_onpolicy(
        RL_RECIPE,
        out,
        steps=demo.plan.rl_steps,
        init=None if init is None else str(init),
        overrides=[*demo.plan.rl_overrides, *extra],
        quiet=not demo.verbose,
        control=control is not None,
        control_out=control,
        compare_default=native is not None,
        default_out=native,
    )
    if result.rc:
        raise RuntimeError(f"RL into {result.failed} exited {result.rc}")
    assert result.report is not None
    return result.report


def zero_gap(demo: Demo) -> None:
    from titan_audit.rl.report import control_shows_gap

    out = demo.path("rl_builtin", "rl-builtin")
    control_out = demo.path("rl_control", "rl-control")
    native_out = demo.path("rl_native", "rl-native") if demo.plan.controls else None  # not with --quick
    report = _verify(demo, out, [], control=control_out, native=native_out)
    s, control, native = report["summary"], report["control"], report["default"]
    demo.row(
        "G4 zero gap",
        f"built-in generator, {RL_RECIPE} {s['steps']} steps from the trained run",
        s["zero_gap"],
        f"{s['tokens_compared']} sampled tokens, {s['tokens_differing']} with any bit difference",
        demo.out / "rl-builtin" / "reports",
    )
    shows = control_shows_gap(control)
    detail = (
        f"{control['tokens_differing']} of {control['tokens_compared']} tokens differ, on "
        f"{control['steps_with_gap']} of {control['steps']} steps (max |diff| {control['max_abs_diff']:.3g})"
        if shows
        else f"none of {control['tokens_compared']} tokens differs: the zero-gap check proves nothing here"
    )
    divergence = [("rl-control", "RL with the generator's weights exact vs one ulp off", False)]
    if native is not None:
        detail += (
            f"; native ops (reported, not counted): {native['tokens_differing']} of "
            f"{native['tokens_compared']} tokens differ"
        )
        divergence.append(("rl-native", "RL with batch-invariant ops vs native ops", True))
    demo.row(
        "G4 control",
        "generator sent the trainer's weights with one element one ulp off must show a gap",
        shows,
        detail,
        demo.out / "rl-control",
    )
    for name, label, reported in divergence:
        pair = {"a": "rl-builtin", "b": name, "label": label, **({"reported": True} if reported else {})}
        demo.extra.setdefault("divergence", []).append(pair)


def zero_gap_vllm(demo: Demo) -> None:
    if demo.plan.quick:
        ok, reason = vllm_status()
        demo.row(
            "G4 zero gap",
            "vLLM generator",
            None,
            "skipped in --quick (the vLLM stage took 28-29 s on 2 cores, mostly engine start-up); "
            + ("the full demo runs it" if ok else reason.removeprefix("skipped: ")),
        )
        return
    if demo.verbose:  # titan_audit.rl.vllm keeps vLLM's log at ERROR unless this is set first
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    ok, reason = vllm_status()
    if not ok:
        demo.row("G4 zero gap", "vLLM generator", None, reason)
        return
    out = demo.path("rl_vllm", "rl-vllm")
    s = _verify(demo, out, ["generator=vllm"])["summary"]
    demo.row(
        "G4 zero gap",
        f"vLLM generator, {RL_RECIPE} {s['steps']} steps",
        s["zero_gap"],
        f"{s['tokens_compared']} sampled tokens, {s['tokens_differing']} with any bit difference",
        demo.out / "rl-vllm" / "reports",
    )
