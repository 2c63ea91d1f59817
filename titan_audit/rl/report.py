"""The zero-gap on-policy report: RUN/reports/onpolicy.md and a self-contained onpolicy.html.

    summary = onpolicy_summary(run_dir)                          # verdict + per-step figures
    paths = write_onpolicy_report(run_dir, default_run=None, control_run=None)   # md + html (plots embedded)

Guarantees:
- The verdict is computed from the run's metrics.parquet alone: `zero_gap` is True iff the run
  recorded the zero-gap figures (`verify`), ran in batch-invariant mode, compared at least one
  token, and every step has `gap_tokens_differing == 0` (no token whose generator log-prob
  differs by any bit from the trainer's recomputation with the same weights).
- A constructed control run (config key `control`, rl/control.py: the generator is sent weights
  one ulp off) is judged by `control_shows_gap`: True iff it recorded the figures and at least one
  token differs, i.e. the check was shown able to fail. A run with native ops (`default_run`,
  verify-onpolicy --compare-default) is reported only: whether native ops leave a gap depends on
  what the CPU's libraries do, so it is part of no verdict.
- The HTML is one file with no external resources: the plots (matplotlib, Agg backend) are
  embedded as base64 PNG data URIs; the tables are plain HTML. Plots: tokens with a bit
  difference and max |diff| per step of the run, of its constructed control and of its native-ops
  run (each when given); the mean reward per step with its trailing rolling mean over
  ROLLING_WINDOW steps drawn over it (`reward_curves` gives the series the plot draws).
- Both files are written atomically.
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path
from typing import Any

from titan_audit.atomic import write_bytes_atomic
from titan_audit.audit.run_metrics import read_metrics
from titan_audit.trainer.run_dir import read_manifest

COLUMNS = (
    "step",
    "reward_mean",
    "gap_tokens",
    "gap_tokens_differing",
    "gap_max_abs",
    "gap_mean_abs",
    "gap_k3_kl",
    "ratio_min",
    "ratio_mean",
    "ratio_max",
    "policy_age",
)
ROLLING_WINDOW = 10  # steps in the rolling mean drawn over the per-step reward


def rolling_mean(values: list[float], window: int = ROLLING_WINDOW) -> list[float]:
    """Trailing mean: entry i is the mean of values[max(0, i - window + 1) : i + 1]."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]


CONTROL_LABEL = "constructed control"
NATIVE_NOTE = "(whether native ops leave a gap depends on this CPU's libraries; it is part of no verdict)"
NATIVE_LABEL = "native ops (default)"


def _series(
    bi: dict[str, Any], default: dict[str, Any] | None, control: dict[str, Any] | None
) -> list[tuple[dict[str, Any] | None, str, str, str]]:
    """(summary, label, line style, colour) of each run a report draws, in drawing order."""
    return [
        (bi, "batch-invariant", "o-", "C0"),
        (default, NATIVE_LABEL, "s--", "C1"),
        (control, CONTROL_LABEL, "^:", "C3"),
    ]


def reward_curves(
    bi: dict[str, Any],
    default: dict[str, Any] | None = None,
    window: int = ROLLING_WINDOW,
    control: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The series of the reward plot, in drawing order: per run (batch-invariant, then native ops
    and the constructed control when given) the per-step mean reward and its rolling mean over
    `window` steps. Each is {"label", "kind" ("per_step" | "rolling_mean"), "steps", "values",
    "style", "colour"}."""
    curves = []
    for summary, label, style, colour in _series(bi, default, control):
        if summary is None:
            continue
        steps = [r["step"] for r in summary["per_step"]]
        rewards = [r["reward_mean"] for r in summary["per_step"]]
        curves.append(
            {"label": label, "kind": "per_step", "steps": steps, "values": rewards, "style": style, "colour": colour}
        )
        curves.append(
            {
                "label": f"{label}, rolling mean ({window} steps)",
                "kind": "rolling_mean",
                "steps": steps,
                "values": rolling_mean(rewards, window),
                "style": "-",
                "colour": colour,
            }
        )
    return curves


def onpolicy_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The verdict and per-step figures of one RL run (see the module docstring)."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    if manifest.get("kind") != "rl":
        raise ValueError(f"{run_dir}: not an RL run")
    config = manifest["config"]
    table = read_metrics(run_dir)
    if table is None:
        raise ValueError(f"{run_dir}: no metrics.parquet")
    rows = table.to_pylist()
    verified = bool(config.get("verify")) and all("gap_tokens_differing" in r for r in rows)
    bi = bool(config["determinism"]["batch_invariant"])
    steps = [{k: r.get(k) for k in COLUMNS} for r in rows]
    differing = [r["gap_tokens_differing"] for r in steps] if verified else []
    compared = sum(r["gap_tokens"] for r in steps) if verified else 0
    first = next((r["step"] for r in steps if verified and r["gap_tokens_differing"]), None)
    rewards = [r["reward_mean"] for r in steps]
    head, tail = rewards[:10], rewards[-10:]
    return {
        "run": str(run_dir),
        "batch_invariant": bi,
        "control": config.get("control"),  # the constructed control (rl/control.py); None: a normal run
        "verified": verified,
        "steps": len(steps),
        "lag": config["rollout"]["lag"],
        "task": config["task"]["name"],
        "tokens_compared": compared,
        "tokens_differing": sum(differing),
        "steps_with_gap": sum(1 for d in differing if d),
        "first_step_with_gap": first,
        "max_abs_diff": max((r["gap_max_abs"] for r in steps), default=0.0) if verified else None,
        "zero_gap": verified and bi and compared > 0 and not any(differing),
        "reward_first10": sum(head) / len(head) if head else None,
        "reward_last10": sum(tail) / len(tail) if tail else None,
        "per_step": steps,
    }


def control_shows_gap(summary: dict[str, Any]) -> bool:
    """A control run's verdict: it recorded the zero-gap figures and at least one token differs."""
    return bool(summary["verified"]) and summary["tokens_differing"] > 0


def control_verdict(summary: dict[str, Any]) -> str:
    """One line on a constructed control run (it must show a gap)."""
    from titan_audit.rl.control import describe

    what = describe(summary.get("control")) or "no constructed control configured"
    if not summary["verified"]:
        return f"CONTROL NOT VERIFIED ({what}): the run did not record the zero-gap figures"
    if control_shows_gap(summary):
        return (
            f"CONTROL SHOWS A GAP ({what}): {summary['tokens_differing']} of {summary['tokens_compared']} tokens "
            f"differ, on {summary['steps_with_gap']} of {summary['steps']} steps; the check can fail"
        )
    return (
        f"CONTROL SHOWS NO GAP ({what}): none of {summary['tokens_compared']} tokens differs; "
        f"the zero-gap check proved nothing here"
    )


def _plots(bi: dict[str, Any], default: dict[str, Any] | None, control: dict[str, Any] | None = None) -> dict[str, str]:
    """name -> base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for summary, label, style, colour in _series(bi, default, control):
        if summary is None or not summary["verified"]:
            continue
        steps = [r["step"] for r in summary["per_step"]]
        differing = [r["gap_tokens_differing"] for r in summary["per_step"]]
        ax1.plot(steps, differing, style, color=colour, ms=3, label=label)
        ax2.plot(
            steps, [max(r["gap_max_abs"], 1e-12) for r in summary["per_step"]], style, color=colour, ms=3, label=label
        )
    ax1.set_title("tokens whose log-prob differs (any bit)")
    ax2.set_title("max |generator lp - trainer lp| (floor 1e-12)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xlabel("RL step")
        ax.legend()
        ax.grid(alpha=0.3)
    out["gap"] = _png(fig, plt)
    out["reward"] = _png(reward_figure(bi, default, control), plt)
    return out


def reward_figure(bi: dict[str, Any], default: dict[str, Any] | None = None, control: dict[str, Any] | None = None):
    """The reward plot (a matplotlib Figure; Agg): per step, faint, and its rolling mean, thick,
    for every curve of `reward_curves`; the legend names each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.2))
    for curve in reward_curves(bi, default, control=control):
        faint = curve["kind"] == "per_step"
        ax.plot(
            curve["steps"],
            curve["values"],
            curve["style"],
            color=curve["colour"],
            ms=2 if faint else 0,
            lw=0.6 if faint else 2.2,
            alpha=0.35 if faint else 1.0,
            label=curve["label"],
        )
    ax.set_title(f"mean reward per step (thick: rolling mean over {ROLLING_WINDOW} steps)")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _png(fig, plt) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def gap_verdict(summary: dict[str, Any]) -> str:
    from titan_audit.rl.control import describe

    if summary["zero_gap"]:
        return (
            f"ZERO GAP: {summary['tokens_compared']} sampled tokens over {summary['steps']} steps, every "
            f"generator log-prob bitwise equal to the trainer's recomputation"
        )
    if not summary["verified"]:
        return "NOT VERIFIED: the run did not record the zero-gap figures (run it with verify-onpolicy)"
    return (
        f"GAP: {summary['tokens_differing']} of {summary['tokens_compared']} tokens differ, on "
        f"{summary['steps_with_gap']} of {summary['steps']} steps (first: step {summary['first_step_with_gap']}; "
        f"max |diff| {summary['max_abs_diff']:.3g})"
        + ("" if summary["batch_invariant"] else "; native ops")
        + (f"; constructed control: {describe(summary['control'])}" if summary.get("control") else "")
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def _companion_lines(default: dict[str, Any] | None, control: dict[str, Any] | None) -> list[str]:
    """The constructed control's verdict and the native-ops run's figures (reported only), as text."""
    lines = []
    if control is not None:
        lines.append(f"Constructed control (`{control['run']}`): {control_verdict(control)}")
    if default is not None:
        lines.append(f"Native ops, reported only (`{default['run']}`): {gap_verdict(default)} {NATIVE_NOTE}")
    return lines


def markdown(bi: dict[str, Any], default: dict[str, Any] | None, control: dict[str, Any] | None = None) -> str:
    lines = [
        "# On-policy verification (zero gap)",
        "",
        f"Run `{bi['run']}`: task {bi['task']}, {bi['steps']} steps, lag {bi['lag']}, batch-invariant mode "
        f"{'on' if bi['batch_invariant'] else 'off'}.",
        "",
        f"**{gap_verdict(bi)}**",
        "",
    ]
    if bi["reward_first10"] is not None:
        lines += [
            f"Mean reward: first 10 steps {bi['reward_first10']:.4f}, last 10 steps {bi['reward_last10']:.4f} "
            f"(change {bi['reward_last10'] - bi['reward_first10']:+.4f}).",
            "",
        ]
    for line in _companion_lines(default, control):
        lines += [line, ""]
    for summary, title in (
        (bi, "Per step"),
        (control, "Per step, constructed control"),
        (default, "Per step, native ops"),
    ):
        if summary is None:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in summary["per_step"]]
        lines.append("")
    lines += [
        "Columns: gap_* compare each sampled token's generator log-prob with the trainer's recomputation",
        "under the same weights (tokens compared, tokens with any bit difference, max and mean |diff|, k3 KL);",
        "ratio_* = exp(trainer lp - generator lp) of the loss; policy_age = steps between the weights that",
        "generated and the weights being updated.",
        "",
    ]
    return "\n".join(lines)


def html_page(bi: dict[str, Any], default: dict[str, Any] | None, control: dict[str, Any] | None = None) -> str:
    plots = _plots(bi, default, control)
    esc = html.escape
    ok = bi["zero_gap"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>titan-audit on-policy verification</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}.ok{color:#060}.bad{color:#a00}"
        "</style></head><body>",
        "<h1>On-policy verification (zero gap)</h1>",
        f"<p>Run <code>{esc(bi['run'])}</code>: task {esc(bi['task'])}, {bi['steps']} steps, lag {bi['lag']}, "
        f"batch-invariant mode {'on' if bi['batch_invariant'] else 'off'}.</p>",
        f"<p class='{'ok' if ok else 'bad'}'><b>{esc(gap_verdict(bi))}</b></p>",
    ]
    if control is not None:
        shown = "ok" if control_shows_gap(control) else "bad"
        parts.append(
            f"<p class='{shown}'>Constructed control (<code>{esc(control['run'])}</code>): "
            f"{esc(control_verdict(control))}</p>"
        )
    if default is not None:
        parts.append(
            f"<p>Native ops, reported only (<code>{esc(default['run'])}</code>): {esc(gap_verdict(default))} "
            f"{esc(NATIVE_NOTE)}</p>"
        )
    if bi["reward_first10"] is not None:
        parts.append(
            f"<p>Mean reward: first 10 steps {bi['reward_first10']:.4f}, last 10 steps {bi['reward_last10']:.4f}.</p>"
        )
    parts.append("<h2>Gap per step</h2>")
    parts.append(f"<img alt='gap per step' src='data:image/png;base64,{plots['gap']}'>")
    parts.append("<h2>Reward</h2>")
    parts.append(
        f"<img alt='reward per step, rolling mean over {ROLLING_WINDOW} steps' "
        f"src='data:image/png;base64,{plots['reward']}'>"
    )
    for summary, title in (
        (bi, "Per step"),
        (control, "Per step, constructed control"),
        (default, "Per step, native ops"),
    ):
        if summary is None:
            continue
        parts.append(f"<h2>{title}</h2><table><tr>" + "".join(f"<th>{c}</th>" for c in COLUMNS) + "</tr>")
        parts += [
            "<tr>" + "".join(f"<td>{esc(_fmt(r[c]))}</td>" for c in COLUMNS) + "</tr>" for r in summary["per_step"]
        ]
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_onpolicy_report(
    run_dir: str | os.PathLike,
    default_run: str | os.PathLike | None = None,
    control_run: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Write RUN/reports/onpolicy.{md,html}; returns {"md", "html", "summary", "default", "control"}
    (the summaries of the run, of its native-ops run and of its constructed control, each or None)."""
    run_dir = Path(run_dir)
    bi = onpolicy_summary(run_dir)
    default = onpolicy_summary(default_run) if default_run is not None else None
    control = onpolicy_summary(control_run) if control_run is not None else None
    reports = run_dir / "reports"
    md_path, html_path = reports / "onpolicy.md", reports / "onpolicy.html"
    write_bytes_atomic(md_path, markdown(bi, default, control).encode(), overwrite=True)
    write_bytes_atomic(html_path, html_page(bi, default, control).encode(), overwrite=True)
    return {"md": str(md_path), "html": str(html_path), "summary": bi, "default": default, "control": control}
