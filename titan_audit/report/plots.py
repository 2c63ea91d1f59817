"""The report's plots: matplotlib figures rendered with the Agg canvas to base64 PNG.

Figures are built on `matplotlib.figure.Figure` with `FigureCanvasAgg` directly (never pyplot),
so the global backend and any open pyplot state of the caller are left alone. Each function
returns the base64 text of one PNG (for a `data:image/png;base64,` URI), or None when there is
nothing to plot.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

from titan_audit.audit.schema import PHASES
from titan_audit.report.divergence import DivergenceMap

_STYLES = ("o-", "s--", "^:", "d-.", "v-", "x--")


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=80)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def curves(
    series: Sequence[tuple[str, list[dict[str, Any]]]],
    columns: Sequence[str],
    titles: dict[str, str] | None = None,
    log: Sequence[str] = (),
) -> str | None:
    """One panel per column present in any series; one line per (label, metrics rows)."""
    present = [c for c in columns if any(any(r.get(c) is not None for r in rows) for _, rows in series)]
    if not present:
        return None
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(3.8 * len(present), 3.0, len(present))
    for ax, column in zip(axes, present):
        for n, (label, rows) in enumerate(series):
            points = [(r["step"], r[column]) for r in rows if r.get(column) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, _STYLES[n % len(_STYLES)], ms=3, lw=1.2, label=label, alpha=0.85)
        ax.set_title((titles or {}).get(column, column))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if column in log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    return _png(fig)


def gap(series: Sequence[tuple[str, list[dict[str, Any]]]]) -> str | None:
    """Zero-gap figures per RL step: tokens with any bit difference, and max |diff| (log)."""
    series = [(label, rows) for label, rows in series if any(r.get("gap_tokens") is not None for r in rows)]
    if not series:
        return None
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2) = _figure(10, 3.2, 2)
    for n, (label, rows) in enumerate(series):
        steps = [r["step"] for r in rows]
        ax1.plot(steps, [r.get("gap_tokens_differing") or 0 for r in rows], _STYLES[n % 6], ms=3, label=label)
        ax2.plot(steps, [max(r.get("gap_max_abs") or 0.0, 1e-12) for r in rows], _STYLES[n % 6], ms=3, label=label)
    ax1.set_title("sampled tokens whose log-prob differs (any bit)")
    ax2.set_title("max |generator lp - trainer lp| (floor 1e-12)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def coverage(per_step: dict[str, dict[int, int]]) -> str | None:
    """Audit records per step, stacked by phase."""
    if not per_step:
        return None
    steps = sorted({s for counts in per_step.values() for s in counts})
    fig, (ax,) = _figure(10, 3.0)
    bottom = [0] * len(steps)
    for phase in [p for p in PHASES if p in per_step]:
        values = [per_step[phase].get(s, 0) for s in steps]
        ax.bar(steps, values, bottom=bottom, label=phase, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("audit records per step, by phase")
    ax.set_xlabel("step")
    ax.set_ylabel("records")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def divergence(grid: DivergenceMap) -> str | None:
    """Rows (phase / module) x steps: the share of each cell's records that differ or are in one
    run only (0 = identical, white-green; 1 = every record, dark red); grey = no record."""
    if not grid.rows or not grid.steps:
        return None
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    values = np.full((len(grid.rows), len(grid.steps)), np.nan)
    col = {s: j for j, s in enumerate(grid.steps)}
    for (i, step), cell in grid.cells.items():
        if cell.total:
            values[i, col[step]] = cell.events / cell.total
    cmap = LinearSegmentedColormap.from_list("div", ["#d9f2d9", "#f4a582", "#b2182b"]).with_extremes(bad="#dddddd")
    height = min(2.0 + 0.16 * len(grid.rows), 14)
    fig, (ax,) = _figure(10, height)
    image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_yticks(range(len(grid.rows)), [f"{p} / {m}" for p, m in grid.rows], fontsize=6)
    stride = max(1, len(grid.steps) // 20)
    ax.set_xticks(range(0, len(grid.steps), stride), [str(s) for s in grid.steps[::stride]], fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("divergence map: share of records that differ (grey: not recorded)")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01)
    return _png(fig)
