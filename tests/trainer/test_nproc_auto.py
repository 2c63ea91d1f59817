"""`--nproc auto`: the largest world size the usable cores and the config allow (trainer/launch/rendezvous.py)."""

import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli
from titan_audit.rl.config import load_rl_config
from titan_audit.trainer.config import load_config
from titan_audit.trainer.launch import Rendezvous, rendezvous, resolve_nproc


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n):
        monkeypatch.setattr(rendezvous, "usable_cores", lambda: n)

    return set_cores


@pytest.mark.parametrize(
    ("n_cores", "overrides", "expected"),
    [
        (4, [], 4),  # V = 8: W = 4 fits
        (3, [], 2),  # 3 does not divide V = 8: the next one down
        (16, [], 8),  # never more ranks than microbatches
        (4, ["parallel.threads=2"], 2),  # cores are shared out by the ranks' threads
        (3, ["parallel.tp=2"], 2),  # W a multiple of tp
        (1, [], None),  # one rank: in this process, no torchrun
        (1, ["parallel.threads=4"], None),
    ],
)
def test_auto_picks_the_largest_world_size_the_config_accepts(cores, n_cores, overrides, expected):
    cores(n_cores)
    assert resolve_nproc("auto", load_config("tiny-dense", overrides)) == expected


def test_auto_for_rl_follows_the_prompt_blocks(cores):
    config = load_rl_config("rl-tiny", ["task.prompts_per_step=6"])
    cores(4)
    assert resolve_nproc("auto", config) == 3


def test_numbers_and_none_pass_through_and_bad_values_are_refused():
    config = load_config("tiny-dense")
    assert resolve_nproc(None, config) is None and resolve_nproc(3, config) == 3
    with pytest.raises(ValueError, match="--nproc must be >= 1, got 0"):
        resolve_nproc(0, config)
    with pytest.raises(ValueError, match="'many'"):
        resolve_nproc("many", config)
    with pytest.raises(ValueError, match="is for one node"):
        resolve_nproc("auto", config, Rendezvous(2, 0, "localhost:29500"))


def test_cli_refuses_a_bad_nproc_with_exit_2(tmp_path):
    result = CliRunner().invoke(cli, ["train", "--config", "tiny-dense", "--nproc", "x", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "'x' is not a number or 'auto'" in result.output
    assert not (tmp_path / "r").exists()
