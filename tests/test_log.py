"""titan_audit.log: the rank on every line, rank 0 only at INFO unless verbose, configure is
idempotent, an unconfigured library is silent, and the CLI keeps --json stdout free of log lines."""

import json
import logging

import pytest
from click.testing import CliRunner

from titan_audit import log as ta_log
from titan_audit.log import VERBOSE_ENV, configure, get_logger, get_rank


@pytest.fixture(autouse=True)
def clean_logging(monkeypatch):
    """Each test starts unconfigured, rank 0, not verbose; the package logger is restored after."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    package = logging.getLogger(ta_log.PACKAGE)
    saved = (list(package.handlers), package.level)
    package.handlers = [h for h in package.handlers if not getattr(h, "_titan_audit", False)]
    yield
    package.handlers, package.level = saved


def _ours() -> list[logging.Handler]:
    return [h for h in logging.getLogger(ta_log.PACKAGE).handlers if getattr(h, "_titan_audit", False)]


def test_loggers_live_under_the_package_namespace():
    assert get_logger("titan_audit.data.loader").name == "titan_audit.data.loader"
    assert get_logger("myscript").name == "titan_audit.myscript"
    assert get_logger("titan_audit").name == "titan_audit"


def test_the_rank_is_on_every_line(capsys, monkeypatch):
    configure()
    log = get_logger("test.rank")
    log.info("first line\nsecond line")
    log.warning("careful")
    monkeypatch.setenv("RANK", "1")  # read when the line is written, not at configure time
    log.warning("from another rank")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[rank 0] first line",
        "[rank 0] second line",
        "[rank 0] warning: careful",
        "[rank 1] warning: from another rank",
    ]


def test_other_ranks_are_silent_at_info_unless_verbose(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    log = get_logger("test.ranks")
    configure()
    log.debug("detail")
    log.info("progress")
    assert capsys.readouterr().err == ""
    log.warning("a warning")
    assert capsys.readouterr().err == "[rank 3] warning: a warning\n"

    configure(verbose=True)
    log.info("progress")
    log.debug("detail")
    assert capsys.readouterr().err.splitlines() == ["[rank 3] progress", "[rank 3] debug: detail"]


def test_rank_0_logs_info_but_not_debug_by_default(capsys):
    configure()
    log = get_logger("test.rank0")
    log.debug("detail")
    log.info("progress")
    assert capsys.readouterr().err == "[rank 0] progress\n"


def test_verbose_from_the_environment(capsys, monkeypatch):
    """What the launcher relies on: `-v` exports TITAN_AUDIT_VERBOSE=1 and each rank's plain
    configure() picks it up."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv(VERBOSE_ENV, "1")
    configure()
    get_logger("test.env").debug("detail")
    assert capsys.readouterr().err == "[rank 2] debug: detail\n"


def test_configure_is_idempotent(capsys):
    for verbose in (False, True, False):
        configure(verbose)
    assert len(_ours()) == 1
    get_logger("test.idem").info("once")
    get_logger("test.idem").debug("not verbose any more")
    assert capsys.readouterr().err == "[rank 0] once\n"


def test_unconfigured_library_is_silent(capsys):
    log = get_logger("test.quiet")
    log.info("progress")
    log.warning("a warning")  # no last-resort handler either: the package logger has a NullHandler
    assert capsys.readouterr().err == ""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger(ta_log.PACKAGE).handlers)


def test_rank_comes_from_torch_distributed_when_initialised(monkeypatch, tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not already initialised")
    monkeypatch.setenv("RANK", "5")
    assert get_rank() == 5
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert get_rank() == 0  # the process group wins over the environment
    finally:
        dist.destroy_process_group()
    assert get_rank() == 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from audit._audit_runs import train

    root = tmp_path_factory.mktemp("log_runs")
    train(root / "a", steps=1)
    train(root / "b", steps=1)
    return root


def test_cli_json_on_stdout_logs_on_stderr(runs):
    from titan_audit.cli.main import cli

    result = CliRunner().invoke(
        cli, ["-v", "compare", str(runs / "a"), str(runs / "b"), "--json"], env={VERBOSE_ENV: None, "RANK": None}
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # the whole of stdout is the JSON object
    assert data["identical"] is True
    log_lines = result.stderr.splitlines()
    assert log_lines and all(line.startswith("[rank 0] ") for line in log_lines), result.stderr
    assert any("audit records" in line for line in log_lines), result.stderr

    quiet = CliRunner().invoke(cli, ["compare", str(runs / "a"), str(runs / "b"), "--json"], env={VERBOSE_ENV: None})
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr  # no -v: the detail stays out
    assert json.loads(quiet.stdout) == data
