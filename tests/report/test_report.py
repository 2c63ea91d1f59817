"""`titan-audit report`: one self-contained HTML file + Markdown for train and RL runs; coverage
figures equal the audit log's; replays and their verdicts; the divergence map agrees with compare;
bad input exits 2 with one line; the run directory is only read."""

from __future__ import annotations

import base64
import re
import shutil

import pyarrow.compute as pc
import pytest
from click.testing import CliRunner

from titan_audit.audit import compare_runs, read_audit_log
from titan_audit.cli.main import cli
from titan_audit.report import divergence_map, write_report
from titan_audit.report.divergence import module_group

PNG = b"\x89PNG\r\n\x1a\n"


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)]


def _files(run):
    return sorted(
        (str(p.relative_to(run)), p.stat().st_mtime_ns)
        for p in run.rglob("*")
        if p.is_file() and "reports" not in p.relative_to(run).parts
    )


def test_train_report_is_self_contained_and_counts_what_the_audit_log_holds(runs):
    run = runs["base"]
    before = _files(run)
    paths = write_report(run)
    assert _files(run) == before  # only reports/ is written
    page = open(paths["html"]).read()
    md = open(paths["md"]).read()
    assert (
        paths["kind"] == "train"
        and paths["html"].endswith("reports/report.html")
        and paths["md"].endswith("reports/report.md")
    )
    assert "<script" not in page and not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # no external resource
    images = _images(page)
    assert len(images) >= 2 and all(img.startswith(PNG) for img in images)  # loss curves, coverage
    table = read_audit_log(run)
    for phase in ("data", "loss", "grad", "optim", "param"):
        count = int(pc.sum(pc.equal(table["phase"], phase)).as_py())
        assert count > 0 and re.search(rf"^\| {phase} \| [^|]+ \| {count} \| 4 \|", md, re.M), phase
    assert f"{table.num_rows} records" in md
    # the replay next to the run is found and verified bitwise over steps 3..4
    assert re.search(r"\| \S*base-replay \| 2 \| 3\.\.4 \| 1 \| \d+ \| 0 \| 0 \| - \| PASS identical \|", md), md
    assert re.search(r"^\| 0 \| 1 \| 0 \| dp \|", md, re.M)  # the one start: W=1 from step 0


def test_replay_report_compares_it_with_its_source(runs):
    md = open(write_report(runs["replay"])["md"]).read()
    assert "elastic replay of" in md and "PASS identical" in md


def test_against_gives_the_divergence_map_and_agrees_with_compare(runs):
    base, seed1 = runs["base"], runs["seed1"]
    paths = write_report(base, against=seed1)
    md = open(paths["md"]).read()
    assert "DIFFERENT" in md and "first divergence: step 1, phase data" in md
    assert len(_images(open(paths["html"]).read())) >= 3  # + the divergence map
    grid = divergence_map(base, seed1)
    result = compare_runs(base, seed1)
    totals = grid.totals()
    assert (totals.compared, totals.differing, totals.only_a, totals.only_b) == (
        result.compared,
        result.differing,
        result.only_in_a,
        result.only_in_b,
    )
    assert grid.first_step() == 1 and not grid.identical
    rows = {(r["phase"], r["module"]): r for r in grid.row_summary()}
    assert rows[("data", "tokens")]["first_step"] == 1 and rows[("param", "embed_tokens")]["differing"] == 4


def test_divergence_map_of_identical_runs_is_empty_and_counts_one_side_records(runs, tmp_path):
    base = runs["base"]
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    same = divergence_map(base, copy)
    assert same.identical and same.totals().compared == read_audit_log(base).num_rows
    # the replay holds steps 3..4 only: steps 1..2 of the source are in A only, nothing differs
    partial = divergence_map(base, runs["replay"])
    assert partial.totals().differing == 0 and partial.totals().only_b == 0
    assert {s for (_, s), c in partial.cells.items() if c.only_a} == {1, 2}


def test_rl_report_has_the_zero_gap_table_and_plot(runs):
    paths = write_report(runs["rl"])
    md = open(paths["md"]).read()
    assert (
        paths["kind"] == "rl" and "ZERO GAP" in md and "| step | reward_mean | gap_tokens | gap_tokens_differing" in md
    )
    assert re.search(r"^\| 2 \| [^|]+ \| \d+ \| 0 \|", md, re.M)
    assert len(_images(open(paths["html"]).read())) >= 3  # reward/loss, gap, coverage
    assert "batch-invariant op census (record): native ops seen: none" in md  # the RL run is in BI mode


@pytest.mark.control
def test_census_section_lists_the_native_ops_a_bi_run_saw():
    """Negative control of the line above: a manifest whose census saw native ops gets them listed."""
    from titan_audit.report.render import Doc, _census

    doc = Doc("t")
    _census(
        doc,
        {
            "bi_census": {
                "mode": "record",
                "native_ops_seen": {
                    "aten::tanh": {"count": 3, "reason": "native", "first_site": "model.py:10 (forward)"}
                },
            }
        },
    )
    md = "\n".join(doc.md)
    assert "native ops seen: 1" in md and "| aten::tanh | 3 | native | model.py:10 (forward) |" in md
    empty = Doc("t")
    _census(empty, {"config": {}})  # a run without BI mode: no census line
    assert empty.md == ["# t", ""]


@pytest.mark.parametrize(
    "module_name, group",
    [
        ("layers.3.mlp.down_proj.weight", "layers.3"),
        ("embed_tokens.weight", "embed_tokens"),
        ("<root>", "<root>"),
        ("layers.0@1", "layers.0"),
        ("tokens", "tokens"),
    ],
)
def test_module_group(module_name, group):
    assert module_group(module_name) == group


def test_cli_report_json_and_bad_input(runs, tmp_path):
    ok = CliRunner().invoke(cli, ["report", str(runs["base"]), "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"html"' in ok.output and "report.html" in ok.output
    (tmp_path / "empty").mkdir()
    for args, message in [
        ([str(tmp_path / "missing")], "missing: no such run directory"),
        ([str(tmp_path / "empty")], "empty: not a run directory"),
        ([str(runs["base"]), "--against", str(tmp_path / "empty")], "empty: not a run directory"),
    ]:
        result = CliRunner().invoke(cli, ["report", *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "empty" / "reports").exists()


def test_cli_report_open_hands_the_file_uri_to_the_browser(runs, monkeypatch):
    import webbrowser

    opened = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url) or True)
    result = CliRunner().invoke(cli, ["report", str(runs["base"]), "--open"])
    assert result.exit_code == 0, result.output
    assert opened == [(runs["base"] / "reports" / "report.html").resolve().as_uri()]
