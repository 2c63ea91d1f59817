"""golden/: record, check (exact and tolerance), update, corruption and bad input, with negative
controls. Runs are tiny nn.Linear runs built with the Recorder (conftest.make_run), no trainer."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli
from titan_audit.golden import GoldenCorrupt, check_golden, read_golden, record_golden, store, update_golden


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def run_cli(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def golden(base_run, tmp_path) -> Path:
    path = tmp_path / "golden"
    record_golden(base_run, path)
    return path


# ------------------------------------------------------------------------------------ round trip
def test_record_then_check_passes_exact(base_run, golden):
    g = read_golden(golden)
    assert g.steps == [1, 2, 3]
    assert g.phases == list(store.DEFAULT_PHASES)  # the selection, whether or not the run had rollouts
    assert sorted(g.tolerance.metrics) == ["grad_norm", "loss", "lr"]  # "seconds" is never kept
    assert set(g.metrics.column_names) == {"step", "grad_norm", "loss", "lr"}
    result = run_cli("golden", "check", base_run, golden)
    assert result.exit_code == 0, result.output
    assert "PASS (mode: exact" in result.output
    data = json.loads(run_cli("golden", "check", base_run, golden, "--json").stdout)
    assert data["passed"] and data["mode"] == "exact" and data["fingerprint_differences"] == []
    assert data["audit"]["compared"] == g.audit.num_rows > 0 and data["metric_points"] == 9


def test_golden_is_small_and_a_comparable_run(base_run, golden):
    total = sum(p.stat().st_size for p in golden.rglob("*") if p.is_file())
    assert total < 100_000
    # a golden is also a (minimal) run directory: `compare` reads it (the run has only default phases)
    result = run_cli("compare", golden, base_run)
    assert result.exit_code == 0 and "all hashes equal" in result.output


def test_a_second_identical_run_matches(base_run, golden, tmp_path, make_run):
    again = make_run(tmp_path / "again")
    assert check_golden(again, golden).passed


# ------------------------------------------------------------------------------------ exact mode
def test_one_bit_flip_in_a_tensor_fails_and_names_the_place(golden, tmp_path, make_run):
    run = make_run(tmp_path / "flipped", flip_param_bit_at=2)
    result = run_cli("golden", "check", run, golden)
    assert result.exit_code == 1, result.output
    assert "first divergence: step 2, phase param, microbatch -1, name weight (hashes differ)" in result.output
    check = check_golden(run, golden)
    first = check.compare.first_divergence
    assert (first["step"], first["phase"], first["name"], first["kind"]) == (2, "param", "weight", "hash")


def _flip_hash_bit(table: pa.Table, row: int, bit: int) -> pa.Table:
    hashes = table["hash"].to_pylist()
    value = int(hashes[row], 16) ^ (1 << bit)
    hashes[row] = f"{value:0{len(hashes[row])}x}"
    return table.set_column(table.schema.get_field_index("hash"), "hash", pa.array(hashes, type=pa.string()))


def test_one_bit_change_in_any_recorded_hash_fails_and_names_it(base_run, golden, tmp_path, rewrite_audit_log):
    """Every record of the golden, in turn: a run whose hash for it differs in one bit fails, and
    the failure names exactly that record."""
    records = read_golden(golden).audit.to_pylist()
    run = copy_run(base_run, tmp_path / "run")
    original = tmp_path / "original.parquet"
    from titan_audit.audit import read_audit_log

    pq.write_table(read_audit_log(base_run), original)
    assert len(records) >= 30
    for i, record in enumerate(records):

        def transform(table, record=record, i=i):
            table = pq.read_table(original)
            mask = None
            for column in ("step", "phase", "microbatch", "name"):
                term = pc.equal(table[column], record[column])
                mask = term if mask is None else pc.and_(mask, term)
            (row,) = [j for j, m in enumerate(mask.to_pylist()) if m]
            return _flip_hash_bit(table, row, bit=i % 128)

        rewrite_audit_log(run, transform)
        check = check_golden(run, golden)
        assert not check.passed and check.mode == "exact"
        first = check.compare.first_divergence
        assert {k: first[k] for k in ("step", "phase", "microbatch", "name")} == {
            k: record[k] for k in ("step", "phase", "microbatch", "name")
        }
        assert check.compare.differing == 1


def test_one_ulp_change_in_a_metric_fails_in_exact_mode(base_run, golden, tmp_path):
    run = copy_run(base_run, tmp_path / "run")
    table = pq.read_table(run / "metrics.parquet").to_pylist()
    table[1]["loss"] = math.nextafter(table[1]["loss"], math.inf)
    pq.write_table(pa.Table.from_pylist(table), run / "metrics.parquet")
    result = run_cli("golden", "check", run, golden)
    assert result.exit_code == 1
    assert "metric value(s) differ bitwise; first: loss at step 2" in result.output


def test_moe_aux_loss_is_kept_and_checked_by_default(base_run, tmp_path):
    """A run whose metrics have `aux_loss` (the trainer's MoE runs) gets it in the golden by
    default; a one-ULP change in it fails the exact check."""
    run = copy_run(base_run, tmp_path / "run")
    rows = pq.read_table(run / "metrics.parquet").to_pylist()
    for row in rows:
        row["aux_loss"] = 2.0 + row["step"] / 7
    pq.write_table(pa.Table.from_pylist(rows), run / "metrics.parquet")
    record_golden(run, tmp_path / "golden")
    assert "aux_loss" in read_golden(tmp_path / "golden").tolerance.metrics
    rows[0]["aux_loss"] = math.nextafter(rows[0]["aux_loss"], math.inf)
    pq.write_table(pa.Table.from_pylist(rows), run / "metrics.parquet")
    result = run_cli("golden", "check", run, tmp_path / "golden")
    assert result.exit_code == 1 and "first: aux_loss at step 1" in result.output, result.output


def test_run_missing_a_golden_step_fails(golden, tmp_path, make_run):
    short = make_run(tmp_path / "short", steps=2)
    check = check_golden(short, golden)
    assert not check.passed
    assert check.compare.first_divergence["kind"] == "only_in_a" and check.compare.first_divergence["step"] == 3
    assert any("lacks metric values" in f for f in check.failures)


def test_longer_run_matches_the_recorded_steps(golden, tmp_path, make_run):
    longer = make_run(tmp_path / "longer", steps=5)
    assert check_golden(longer, golden).passed  # only the golden's steps and phases are compared


def test_step_and_phase_selection(base_run, tmp_path, make_run):
    path = tmp_path / "g"
    result = run_cli("golden", "record", base_run, path, "--steps", "2-3", "--phases", "loss,param", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == [2, 3] and summary["phases"] == ["loss", "param"]
    g = read_golden(path)
    assert set(g.audit["step"].to_pylist()) == {2, 3} and set(g.audit["phase"].to_pylist()) == {"loss", "param"}
    assert g.metrics["step"].to_pylist() == [2, 3]
    assert check_golden(base_run, path).passed
    flipped = make_run(tmp_path / "flipped", flip_param_bit_at=3)
    assert check_golden(flipped, path).compare.first_divergence["step"] == 3


# ------------------------------------------------------------------------------------ tolerance mode
OTHER_TORCH = {"torch_version": "0.0.0+other", "num_threads": 97}


def test_fingerprint_mismatch_switches_to_tolerance_mode_and_says_so(golden, tmp_path, make_run):
    run = make_run(tmp_path / "other", fingerprint_changes=OTHER_TORCH)
    result = run_cli("golden", "check", run, golden)
    assert result.exit_code == 0, result.output
    assert "mode: TOLERANCE, not bitwise" in result.output
    assert "torch_version" in result.output and "num_threads" in result.output
    assert "audit hashes were NOT compared" in result.output
    data = json.loads(run_cli("golden", "check", run, golden, "--json").stdout)
    assert data["mode"] == "tolerance" and data["passed"] and data["audit"] is None
    assert any(d.startswith("torch_version") for d in data["fingerprint_differences"])
    assert any(d.startswith("num_threads") for d in data["fingerprint_differences"])
    # never a silent pass in the weaker mode when exactness is required
    strict = run_cli("golden", "check", run, golden, "--require-exact")
    assert strict.exit_code == 1 and "exact comparison required" in strict.output


def test_a_kernel_version_change_is_named_as_the_cause(tmp_path, make_run):
    """Golden and run both in BI mode with other kernel versions: the check says the kernels moved
    the bits; negative control: the same kernels, or a non-BI run, name no kernel change."""
    golden = tmp_path / "golden"
    record_golden(make_run(tmp_path / "old", fingerprint_changes={"bi_kernels": "titan-bi-cpu v1"}), golden)
    run = make_run(tmp_path / "new", fingerprint_changes={"bi_kernels": "titan-bi-cpu v2"})
    strict = run_cli("golden", "check", run, golden, "--require-exact")
    assert strict.exit_code == 1
    assert (
        "the batch-invariant kernels changed version (golden 'titan-bi-cpu v1', run 'titan-bi-cpu v2')" in strict.output
    )
    data = json.loads(run_cli("golden", "check", run, golden, "--json").stdout)
    assert data["kernels_changed"] == {"golden": "titan-bi-cpu v1", "run": "titan-bi-cpu v2"}
    same = make_run(tmp_path / "same", fingerprint_changes={"bi_kernels": "titan-bi-cpu v1"})
    assert check_golden(same, golden).kernels_changed is None and check_golden(same, golden).mode == "exact"
    native = make_run(tmp_path / "native")
    assert check_golden(native, golden).kernels_changed is None


def test_tolerance_mode_ignores_hashes_but_checks_metrics(golden, tmp_path, make_run):
    """Negative controls: different bits pass within tolerance; metrics outside it fail."""
    bits_differ = make_run(tmp_path / "a", flip_param_bit_at=1, fingerprint_changes=OTHER_TORCH)
    assert check_golden(bits_differ, golden).passed
    within = make_run(tmp_path / "b", fingerprint_changes=OTHER_TORCH, loss_scale=1 + 1e-6)
    assert check_golden(within, golden).passed
    outside = make_run(tmp_path / "c", fingerprint_changes=OTHER_TORCH, loss_scale=1.01)
    result = run_cli("golden", "check", outside, golden)
    assert result.exit_code == 1, result.output
    assert "mode: TOLERANCE" in result.output and "3 of 9 metric points outside tolerance (budget 0)" in result.output
    # and the same metric change in exact mode fails too (bitwise)
    exact = make_run(tmp_path / "d", loss_scale=1 + 1e-6)
    assert not check_golden(exact, golden).passed


def test_failure_budget_and_stored_tolerances(base_run, tmp_path, make_run):
    path = tmp_path / "g"
    result = run_cli(
        "golden",
        "record",
        base_run,
        path,
        "--metrics",
        "loss",
        "--rtol",
        "loss=0.05",
        "--atol",
        "loss=0",
        "--max-failures",
        "3",
    )
    assert result.exit_code == 0, result.output
    g = read_golden(path)
    assert g.tolerance.metrics == {"loss": {"rtol": 0.05, "atol": 0.0}} and g.tolerance.max_failures == 3
    assert (
        run_cli(
            "golden", "check", make_run(tmp_path / "in", fingerprint_changes=OTHER_TORCH, loss_scale=1.04), path
        ).exit_code
        == 0
    )
    over = make_run(tmp_path / "over", fingerprint_changes=OTHER_TORCH, loss_scale=1.06)
    check = check_golden(over, path)
    assert check.passed and any("within the failure budget of 3" in n for n in check.notes)
    path2 = tmp_path / "g2"
    record_golden(base_run, path2, metrics=["loss"], rtol={"loss": 0.05}, max_failures=2)
    assert not check_golden(over, path2).passed


def test_tolerance_mode_without_metrics_fails(base_run, tmp_path):
    run = copy_run(base_run, tmp_path / "run")
    (run / "metrics.parquet").unlink()
    path = tmp_path / "g"
    record_golden(run, path)
    assert read_golden(path).metrics is None
    assert check_golden(run, path).passed  # exact mode: hashes carry the check
    other = copy_run(run, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["fingerprint"]["torch_version"] = "0.0.0+other"
    (other / "manifest.json").write_text(json.dumps(manifest))
    check = check_golden(other, path)
    assert check.mode == "tolerance" and not check.passed
    assert any("nothing to check" in f for f in check.failures)


# ------------------------------------------------------------------------------------ corruption
def _files(golden: Path) -> list[Path]:
    return sorted(p for p in golden.rglob("*") if p.is_file())


def test_every_flipped_byte_of_golden_json_is_corruption(base_run, golden):
    meta = golden / "golden.json"
    raw = meta.read_bytes()
    for position in range(len(raw)):
        for mask in (0x01, 0x80):
            meta.write_bytes(raw[:position] + bytes([raw[position] ^ mask]) + raw[position + 1 :])
            with pytest.raises(GoldenCorrupt):
                read_golden(golden)
    meta.write_bytes(raw)
    assert check_golden(base_run, golden).passed


@pytest.mark.parametrize("name", ["manifest.json", "metrics.parquet", "audit/part-r00000-00000000.parquet"])
def test_flipped_bytes_in_data_files_are_corruption(base_run, golden, name):
    file = golden / name
    raw = file.read_bytes()
    for position in list(range(0, len(raw), max(1, len(raw) // 40))) + [len(raw) - 1]:
        file.write_bytes(raw[:position] + bytes([raw[position] ^ 0x04]) + raw[position + 1 :])
        with pytest.raises(GoldenCorrupt, match="sha256"):
            read_golden(golden)
    file.write_bytes(raw)
    assert check_golden(base_run, golden).passed


def test_corruption_exits_2_and_says_corrupt_not_mismatch(base_run, golden):
    part = golden / "audit/part-r00000-00000000.parquet"
    raw = part.read_bytes()
    part.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    result = run_cli("golden", "check", base_run, golden)
    assert result.exit_code == 2
    assert "corrupt golden file" in result.output and "FAIL" not in result.output


@pytest.mark.parametrize(
    "name", ["golden.json", "manifest.json", "metrics.parquet", "audit/part-r00000-00000000.parquet"]
)
@pytest.mark.parametrize("keep", ["half", "minus_one", "empty"])
def test_truncated_file_is_corruption(base_run, golden, name, keep):
    file = golden / name
    raw = file.read_bytes()
    file.write_bytes({"half": raw[: len(raw) // 2], "minus_one": raw[:-1], "empty": b""}[keep])
    with pytest.raises(GoldenCorrupt):
        read_golden(golden)
    result = run_cli("golden", "check", base_run, golden)
    assert result.exit_code == 2 and "corrupt" in result.output


def test_missing_or_extra_file_is_corruption(golden):
    extra = golden / "audit" / "part-r00001-00000000.parquet"
    extra.write_bytes(b"x")
    with pytest.raises(GoldenCorrupt, match="not listed"):
        read_golden(golden)
    extra.unlink()
    (golden / "metrics.parquet").unlink()
    with pytest.raises(GoldenCorrupt, match="missing"):
        read_golden(golden)


# ------------------------------------------------------------------------------------ bad input
def test_missing_dir_not_a_golden_newer_version_exit_2(base_run, golden, tmp_path):
    result = run_cli("golden", "check", base_run, tmp_path / "nope")
    assert result.exit_code == 2 and "no such golden directory" in result.output
    (tmp_path / "empty").mkdir()
    result = run_cli("golden", "check", base_run, tmp_path / "empty")
    assert result.exit_code == 2 and "not a golden directory" in result.output
    result = run_cli("golden", "check", base_run, base_run)  # a run is not a golden
    assert result.exit_code == 2 and "not a golden directory" in result.output
    # a newer format version, written consistently (valid self-hash): not corruption, a clear error
    meta = json.loads((golden / "golden.json").read_text())
    meta["format_version"] = store.FORMAT_VERSION + 1
    meta["sha256"] = hashlib.sha256(store._canonical(meta)).hexdigest()
    (golden / "golden.json").write_text(json.dumps(meta))
    result = run_cli("golden", "check", base_run, golden)
    assert result.exit_code == 2 and "newer than this titan-audit understands" in result.output
    with pytest.raises(ValueError) as error:
        read_golden(golden)
    assert not isinstance(error.value, GoldenCorrupt)


def test_bad_run_and_bad_options_exit_2(base_run, golden, tmp_path):
    assert run_cli("golden", "check", tmp_path / "norun", golden).exit_code == 2
    assert run_cli("golden", "record", tmp_path / "norun", tmp_path / "g").exit_code == 2
    assert run_cli("golden", "record", base_run, tmp_path / "g", "--steps", "3-1").exit_code == 2
    assert run_cli("golden", "record", base_run, tmp_path / "g", "--steps", "7").exit_code == 2
    assert run_cli("golden", "record", base_run, tmp_path / "g", "--phases", "nope").exit_code == 2
    assert run_cli("golden", "record", base_run, tmp_path / "g", "--metrics", "nope").exit_code == 2
    assert run_cli("golden", "record", base_run, tmp_path / "g", "--rtol", "loss").exit_code == 2
    assert not (tmp_path / "g").exists()  # nothing half-written
    no_fp = copy_run(base_run, tmp_path / "nofp")
    manifest = json.loads((no_fp / "manifest.json").read_text())
    del manifest["fingerprint"]
    (no_fp / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("golden", "record", no_fp, tmp_path / "g")
    assert result.exit_code == 2 and "no numerics fingerprint" in result.output
    check = check_golden(no_fp, golden)  # a run without a fingerprint: tolerance mode, said so
    assert check.mode == "tolerance" and any("no numerics fingerprint" in d for d in check.fingerprint_differences)


def test_record_refuses_an_existing_golden(base_run, golden):
    before = {p: p.read_bytes() for p in _files(golden)}
    result = run_cli("golden", "record", base_run, golden)
    assert result.exit_code == 2 and "golden update" in result.output
    assert {p: p.read_bytes() for p in _files(golden)} == before


# ------------------------------------------------------------------------------------ update
def test_update_rewrites_and_reports_what_changed(base_run, tmp_path, make_run):
    path = tmp_path / "g"
    record_golden(base_run, path, steps=[2, 3], rtol={"loss": 0.01})
    flipped = make_run(tmp_path / "flipped", flip_param_bit_at=2)
    assert not check_golden(flipped, path).passed
    result = run_cli("golden", "update", flipped, path)
    assert result.exit_code == 0, result.output
    assert "numerics fingerprint: unchanged" in result.output
    assert "first change at step 2, phase param, microbatch -1, name weight" in result.output
    assert check_golden(flipped, path).passed and not check_golden(base_run, path).passed
    g = read_golden(path)
    assert g.steps == [2, 3] and g.tolerance.metrics["loss"]["rtol"] == 0.01  # selection and policy kept
    again = json.loads(run_cli("golden", "update", flipped, path, "--json").stdout)
    assert again["audit"]["identical"] and again["metric_changes"] == [] and again["fingerprint_changes"] == []


def test_update_reports_a_fingerprint_change_and_repairs_a_corrupt_golden(base_run, golden, tmp_path, make_run):
    other = make_run(tmp_path / "other", fingerprint_changes=OTHER_TORCH, loss_scale=1.5)
    changes = update_golden(other, golden)
    assert any(c.startswith("torch_version") for c in changes["fingerprint_changes"])
    assert [m["metric"] for m in changes["metric_changes"]] == ["loss"]
    (golden / "manifest.json").write_text("{}")
    changes = update_golden(base_run, golden)
    assert changes["previous_corrupt"] and "manifest.json" in changes["previous_corrupt"]
    assert check_golden(base_run, golden).passed


def test_update_of_a_missing_golden_exit_2(base_run, tmp_path):
    result = run_cli("golden", "update", base_run, tmp_path / "none")
    assert result.exit_code == 2 and "golden record" in result.output


def test_update_with_nothing_changed_leaves_the_golden_byte_for_byte(base_run, golden):
    before = {p: p.read_bytes() for p in _files(golden)}
    changes = update_golden(base_run, golden)
    assert changes["rewritten"] is False and changes["audit"]["identical"]
    assert {p: p.read_bytes() for p in _files(golden)} == before
    result = run_cli("golden", "update", base_run, golden, "--force")
    assert result.exit_code == 0 and "updated golden" in result.output
    assert check_golden(base_run, golden).passed
