"""Build the run report as one self-contained HTML page and its Markdown twin.

Guarantees:
- The HTML has no external resource and no script: styles inline, plots as base64 PNG data URIs
  (report/plots.py), so the one file opens anywhere (a browser, a CI artifact viewer, offline).
- The Markdown carries the same tables and verdicts (the plots are only in the HTML).
- Every figure comes from the run directories (manifest, metrics.parquet, audit/*.parquet,
  checkpoints, demo.json): nothing is computed from defaults or hard-coded.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from titan_audit.audit.report import compare_report
from titan_audit.audit.run_manifest import read_manifest
from titan_audit.report import plots
from titan_audit.report.divergence import divergence_map
from titan_audit.report.runs import coverage, read_demo, read_metrics, replays, run_kind, starts

GAP_COLUMNS = (
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
MD_ROWS = 40  # long per-step tables are cut in the Markdown (the HTML has them all)

CSS = """body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em auto;max-width:1150px;
color:#222;padding:0 1em}h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:2px;
margin-top:1.6em}table{border-collapse:collapse;font-size:12.5px;margin:.5em 0}td,th{border:1px solid #ccc;
padding:2px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}.pass{color:#060;font-weight:bold}
.fail{color:#a00;font-weight:bold}.skip{color:#875a00;font-weight:bold}code{background:#f5f5f5;padding:0 3px}
img{max-width:100%;display:block;margin:.4em 0}.small{font-size:12px;color:#555}"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return "-" if value is None else str(value)


class Doc:
    """HTML and Markdown built side by side."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.html: list[str] = [f"<h1>{html.escape(title)}</h1>"]
        self.md: list[str] = [f"# {title}", ""]
        self.images = 0

    def h2(self, text: str) -> None:
        self.html.append(f"<h2>{html.escape(text)}</h2>")
        self.md += [f"## {text}", ""]

    def p(self, text: str, cls: str | None = None) -> None:
        attr = f" class='{cls}'" if cls else ""
        self.html.append(f"<p{attr}>{html.escape(text)}</p>")
        self.md += [f"**{text}**" if cls in ("pass", "fail", "skip") else text, ""]

    def code(self, lines: list[str]) -> None:
        self.html.append("<pre>" + html.escape("\n".join(lines)) + "</pre>")
        self.md += ["```", *lines, "```", ""]

    def table(
        self, headers: list[str], rows: list[list[Any]], result_col: int | None = None, md_limit: int | None = None
    ) -> None:
        out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"]
        for row in rows:
            cells = []
            for j, value in enumerate(row):
                text = html.escape(_fmt(value))
                if j == result_col:
                    cls = {"PASS": "pass", "FAIL": "fail", "SKIP": "skip"}.get(
                        str(value).split()[0] if value else "", ""
                    )
                    if "the control: it must fail" in str(value):
                        cls = "pass"
                    cells.append(f"<td class='{cls}'>{text}</td>")
                else:
                    cells.append(f"<td>{text}</td>")
            out.append("<tr>" + "".join(cells) + "</tr>")
        self.html.append("".join(out) + "</table>")
        shown = rows if md_limit is None or len(rows) <= md_limit else rows[: md_limit // 2] + rows[-md_limit // 2 :]
        self.md += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        self.md += ["| " + " | ".join(_fmt(v).replace("|", "\\|") for v in row) + " |" for row in shown]
        if len(shown) < len(rows):
            self.md.append(f"\n({len(rows) - len(shown)} middle rows left out here; report.html has them all)")
        self.md.append("")

    def image(self, b64: str | None, alt: str) -> None:
        if b64 is None:
            return
        self.images += 1
        self.html.append(f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{b64}'>")
        self.md += [f"(plot in report.html: {alt})", ""]

    def render_html(self) -> str:
        return (
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(self.html)
            + "\n</body></html>\n"
        )

    def render_md(self) -> str:
        return "\n".join(self.md).rstrip() + "\n"


# ------------------------------------------------------------------------------------ sections
def _config_line(manifest: dict[str, Any]) -> str:
    c = manifest.get("config") or {}
    det = c.get("determinism") or {}
    parts = [f"model {c.get('model', {}).get('preset')}", f"{c.get('steps')} steps", f"seed {c.get('seed')}"]
    if "data" in c:
        d = c["data"]
        parts.append(
            f"V = {d.get('global_batch_size', 0) // max(d.get('microbatch_size', 1), 1)} virtual microbatches "
            f"of {d.get('microbatch_size')} x {d.get('seq_len')} tokens"
        )
    if "task" in c:
        t = c["task"]
        parts.append(
            f"task {t.get('name')}, {t.get('prompts_per_step')} prompts x {t.get('samples_per_prompt')} samples"
        )
        parts.append(f"lag {c.get('rollout', {}).get('lag')}")
    parts.append(f"determinism {'on' if det.get('enabled', True) else 'OFF'}")
    parts.append(f"batch-invariant ops {'on' if det.get('batch_invariant') else 'off'}")
    parts.append(f"audit level {c.get('audit', {}).get('level')}")
    return "config: " + ", ".join(parts)


def _fingerprint_line(manifest: dict[str, Any]) -> str | None:
    fp = manifest.get("fingerprint")
    if not isinstance(fp, dict):
        return None
    return (
        f"numerics: torch {fp.get('torch_version')} on {fp.get('device_kind')} ({fp.get('device_name')}), "
        f"ISA {fp.get('cpu_capability')}, BLAS {fp.get('blas')}, {fp.get('num_threads')} intra-op thread(s)"
    )


def _census(doc: Doc, manifest: dict[str, Any]) -> None:
    """BI runs: the op census (batch_invariant/census.py), "native ops seen" with counts and sites."""
    census = manifest.get("bi_census")
    if not isinstance(census, dict):
        return
    seen = census.get("native_ops_seen")
    if census.get("mode") == "off" or seen is None:
        doc.p("batch-invariant op census: off for this run (native ops were not checked)")
    elif not seen:
        doc.p(
            f"batch-invariant op census ({census.get('mode')}): native ops seen: none; only our kernels and "
            "exact IEEE ops computed in BI mode",
            "pass",
        )
    else:
        doc.p(
            f"batch-invariant op census ({census.get('mode')}): native ops seen: {len(seen)} (their bits may "
            "depend on the CPU)",
            "fail",
        )
        doc.table(
            ["native op", "count", "why", "first call site"],
            [[op, row.get("count"), row.get("reason"), row.get("first_site")] for op, row in seen.items()],
        )


def section_overview(doc: Doc, run: Path, manifest: dict[str, Any]) -> None:
    doc.p(_config_line(manifest))
    line = _fingerprint_line(manifest)
    if line:
        doc.p(line)
    _census(doc, manifest)
    history = starts(run)
    if history:
        doc.p("starts and resumes (manifest world-size history):")
        doc.table(
            ["#", "world size", "start step", "parallel mode", "time"],
            [
                [i, h.get("world_size"), h.get("start_step"), h.get("parallel_mode"), h.get("time")]
                for i, h in enumerate(history)
            ],
        )
    if isinstance(manifest.get("replay_of"), dict):
        of = manifest["replay_of"]
        doc.p(f"elastic replay of {of.get('run')} from its checkpoint of step {of.get('from_step')}")


def section_curves(doc: Doc, series: list[tuple[str, list[dict[str, Any]]]], rl: bool) -> None:
    if not any(rows for _, rows in series):
        doc.p("no metrics.parquet rows yet")
        return
    if rl:
        doc.image(plots.curves(series, ("reward_mean", "loss", "grad_norm")), "reward and loss per RL step")
    else:
        doc.image(
            plots.curves(series, ("loss", "grad_norm", "lr"), log=()), "loss, grad norm and learning rate per step"
        )
    for label, rows in series:
        if rows:
            last = rows[-1]
            keys = [
                k for k in ("loss", "grad_norm", "lr", "reward_mean", "tokens", "seconds", "world_size") if k in last
            ]
            doc.p(
                f"{label}: {len(rows)} steps; last step {last['step']}: "
                + ", ".join(f"{k} {_fmt(last[k])}" for k in keys)
            )


def section_zero_gap(doc: Doc, runs: list[tuple[str, Path]]) -> list[dict[str, Any]]:
    """The zero-gap verdict, per-step table and plot of each RL run (rl.report's summary)."""
    from titan_audit.rl.report import control_shows_gap, control_verdict, gap_verdict, onpolicy_summary

    summaries = []
    for label, run in runs:
        summary = onpolicy_summary(run)
        summaries.append((label, summary))
        if summary["control"]:  # a constructed control: it must show a gap
            doc.p(f"{label} ({run}): {control_verdict(summary)}", "pass" if control_shows_gap(summary) else "fail")
            continue
        ok = summary["zero_gap"]
        cls = "pass" if ok else ("skip" if not summary["verified"] else "fail")
        doc.p(f"{label} ({run}): {gap_verdict(summary)}", cls if label == runs[0][0] or ok else None)
    doc.image(plots.gap([(label, s["per_step"]) for label, s in summaries]), "zero-gap figures per RL step")
    for label, summary in summaries:
        if summary["verified"]:
            doc.p(f"per step, {label}:")
            doc.table(
                list(GAP_COLUMNS), [[r.get(c) for c in GAP_COLUMNS] for r in summary["per_step"]], md_limit=MD_ROWS
            )
    return [s for _, s in summaries]


def section_coverage(doc: Doc, run: Path) -> None:
    cov = coverage(run)
    if cov is None:
        doc.p(f"{run}: no audit log (audit/ not found)")
        return
    repeats = cov.records - cov.unique_keys
    doc.p(
        f"{cov.records} records in {cov.parts} Parquet parts over {len(cov.steps)} steps "
        f"({cov.steps[0] if cov.steps else '-'}..{cov.steps[-1] if cov.steps else '-'}); {cov.unique_keys} unique keys "
        f"(step, phase, microbatch, name)"
        + (
            f"; {repeats} repeats of a key (steps replayed by a resume), "
            f"{cov.repeated_with_other_hash} of them with another hash"
            if repeats
            else ""
        )
    )
    doc.table(
        ["phase", "what is hashed", "records", "steps", "names", "microbatches", "ranks", "dtypes", "e.g."],
        [
            [p.phase, p.meaning, p.records, p.steps, p.names, p.microbatches, p.ranks, p.dtypes, ", ".join(p.examples)]
            for p in cov.phases
        ],
    )
    doc.image(plots.coverage(cov.per_step), "audit records per step by phase")
    if cov.checkpoints:
        doc.p("checkpoints (each verified against its hashes.json when loaded):")
        doc.table(["step", "tensor hashes", "path"], [[c["step"], c["hashes"], c["path"]] for c in cov.checkpoints])


def section_replays(doc: Doc, run: Path) -> None:
    found = replays(run)
    if not found:
        doc.p("no elastic replay of this run next to it (titan-audit replay RUN --from-step K --nproc W --out RUN2)")
        return
    rows = []
    for r in found:
        fd = r.first_divergence
        where = "-" if fd is None else f"step {fd['step']} {fd['phase']} {fd['name']} ({fd['kind']})"
        verdict = "PASS identical" if r.identical else ("FAIL " + (r.error or "different"))
        rows.append(
            [
                r.replay,
                r.from_step,
                f"{r.from_step + 1}..{r.to_step}",
                r.world_size,
                r.compared,
                r.differing,
                r.one_side_only,
                where,
                verdict,
            ]
        )
    doc.table(
        [
            "replay",
            "from checkpoint",
            "steps compared",
            "W",
            "records compared",
            "differ",
            "one run only",
            "first divergence",
            "verdict",
        ],
        rows,
        result_col=8,
    )


def section_against(doc: Doc, run_a: Path, run_b: Path, title: str | None = None) -> None:
    from titan_audit.audit.compare import compare_runs

    doc.h2(title or f"Compared with {run_b}")
    result = compare_runs(run_a, run_b)
    doc.p(
        "PASS identical: every audit hash equal"
        if result.identical
        else "DIFFERENT: the runs part (first divergence below)",
        "pass" if result.identical else "fail",
    )
    data = result.to_dict()
    doc.code([f"config differs: {line}" for line in data["config_differences"]] + compare_report(data))
    grid = divergence_map(run_a, run_b)
    totals = grid.totals()
    doc.p(
        f"divergence map: {len(grid.rows)} phase/module rows x {len(grid.steps)} steps; {totals.differing} of "
        f"{totals.compared} keys in both runs differ, {totals.only_a} in A only, {totals.only_b} in B only"
    )
    doc.image(plots.divergence(grid), "divergence map (steps x phase/module)")
    differing = [r for r in grid.row_summary() if r["differing"] or r["one_side_only"]]
    if differing:
        doc.p("rows that differ (first step with a difference):")
        doc.table(
            ["phase", "module", "keys compared", "differ", "one run only", "first step"],
            [
                [r["phase"], r["module"], r["compared"], r["differing"], r["one_side_only"], r["first_step"]]
                for r in differing
            ],
            md_limit=MD_ROWS,
        )


# ------------------------------------------------------------------------------------ reports
def run_report(run: Path, against: Path | None = None) -> Doc:
    kind = run_kind(run)
    manifest = read_manifest(run)
    doc = Doc(f"titan-audit report: {run}")
    doc.p(f"{kind} run; written by titan-audit report from the files of the run directory.", "small")
    doc.h2("Run")
    section_overview(doc, run, manifest)
    doc.h2("Reward and loss" if kind == "rl" else "Loss curves")
    # verify-onpolicy's companions: the constructed control, and native ops (reported only)
    companions = [
        (label, run / name)
        for label, name in (
            ("constructed control", "control"),
            ("native ops, reported (compare-default)", "compare-default"),
        )
        if kind == "rl" and (run / name / "manifest.json").is_file()
    ]
    series = [(run.name, read_metrics(run)), *[(label, read_metrics(path)) for label, path in companions]]
    section_curves(doc, series, rl=kind == "rl")
    if kind == "rl":
        doc.h2("Zero gap (G4): generator vs trainer log-probs")
        section_zero_gap(doc, [(run.name, run), *companions])
    doc.h2("Audit coverage")
    section_coverage(doc, run)
    doc.h2("Elastic replays")
    section_replays(doc, run)
    if against is not None:
        section_against(doc, run, against)
    return doc


def demo_report(out: Path, against: Path | None = None) -> Doc:
    demo = read_demo(out)
    doc = Doc(f"titan-audit demo: {out}")
    ok = demo.get("passed")
    doc.p(
        f"{'every guarantee held' if ok else 'a guarantee FAILED'}; mode {'--quick' if demo.get('quick') else 'full'}, "
        f"{demo.get('created')}, {demo.get('seconds', 0):.0f} s",
        "pass" if ok else "fail",
    )
    if demo.get("numerics"):
        doc.p(demo["numerics"])
    doc.h2("Verdicts")
    doc.table(
        ["guarantee", "what was checked", "result", "evidence"],
        [
            [r["guarantee"], r["checked"], f"{r['result']} {r.get('detail', '')}".strip(), r.get("evidence", "")]
            for r in demo["rows"]
        ],
        result_col=2,
    )
    runs = {
        role: out / rel for role, rel in (demo.get("runs") or {}).items() if (out / rel / "manifest.json").is_file()
    }
    train_roles = [r for r in ("train_w2", "train_w1", "replay_w1", "kill_resume", "control_w2") if r in runs]
    if train_roles:
        doc.h2("Training runs (G3 elastic, G5 kill and resume)")
        section_curves(doc, [(runs[r].name, read_metrics(runs[r])) for r in train_roles], rl=False)
    if "kill_resume" in runs:
        doc.h2("Kill -9 and resume (G5)")
        kill = demo.get("kill") or {}
        if kill:
            doc.p(
                f"SIGKILL sent to pid {kill.get('pid')} {kill.get('after_s', 0):.2f} s after its start, as soon as its "
                f"checkpoint of step {kill.get('checkpoint_step')} was on disk (exit status {kill.get('returncode')}); "
                f"then resumed with --resume from that checkpoint"
            )
        section_overview(doc, runs["kill_resume"], read_manifest(runs["kill_resume"]))
    rl_roles = [r for r in ("rl_builtin", "rl_vllm", "rl_control", "rl_native") if r in runs]
    if rl_roles:
        doc.h2("Zero gap (G4)")
        section_zero_gap(doc, [(runs[r].name, runs[r]) for r in rl_roles])
    if demo.get("spot_checks"):
        doc.h2("Batch invariance spot-checks (G2)")
        headers = ["check", "shape", "batch-invariant ops", "native ops (reported)"]
        doc.table(headers, [[s["check"], s["shape"], s["bi"], s["native"]] for s in demo["spot_checks"]])
    if demo.get("goldens"):
        doc.h2("Committed goldens (G1)")
        doc.table(
            ["golden", "run", "mode", "result", "records compared", "metric points", "notes"],
            [
                [
                    g["golden"],
                    g["run"],
                    g["mode"],
                    g["result"],
                    g.get("records"),
                    g.get("metric_points"),
                    "; ".join(g.get("notes") or []) or "-",
                ]
                for g in demo["goldens"]
            ],
            result_col=3,
        )
    if "train_w2" in runs:
        doc.h2(f"Audit coverage of {runs['train_w2'].name}")
        section_coverage(doc, runs["train_w2"])
        doc.h2(f"Elastic replays of {runs['train_w2'].name}")
        section_replays(doc, runs["train_w2"])
    for pair in demo.get("divergence") or []:
        a, b = out / pair["a"], out / pair["b"]
        if (a / "audit").is_dir() and (b / "audit").is_dir():
            what = "reported" if pair.get("reported") else "negative control"  # reported: counted in no verdict
            section_against(doc, a, b, f"Divergence map, {what}: {pair['label']}")
    if against is not None:
        base = runs.get("train_w1") or runs.get("train_w2")
        if base is not None:
            section_against(doc, base, against)
    if demo.get("stages"):
        doc.h2("Stages")
        doc.table(
            ["stage", "seconds", "log"],
            [[s["name"], round(s["seconds"], 1), s.get("log") or "-"] for s in demo["stages"]],
        )
    return doc


def build(run: str | os.PathLike, against: str | os.PathLike | None = None) -> tuple[str, str, str]:
    """(kind, html, markdown) of the report of `run` (optionally compared with `against`)."""
    run = Path(run)
    kind = run_kind(run)
    against_path = None
    if against is not None:
        against_path = Path(against)
        if run_kind(against_path) == "demo":
            raise ValueError(f"--against {against_path}: a demo directory; name one of its runs instead")
        if not (against_path / "audit").is_dir():
            raise ValueError(f"--against {against_path}: not a run with an audit log (audit/ not found)")
    doc = demo_report(run, against_path) if kind == "demo" else run_report(run, against_path)
    return kind, doc.render_html(), doc.render_md()
