"""deterministic.enable: every switch set, everything restored on exit (also on exceptions)."""

import os
import random

import numpy as np
import pytest
import torch

from titan_audit import deterministic
from titan_audit.deterministic.switches import CUBLAS_WORKSPACE, Switches


def test_enable_sets_every_switch_and_context_restores_them():
    before = Switches.read()
    with deterministic.enable(7, threads=1):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.get_float32_matmul_precision() == "highest"
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert torch.get_num_threads() == 1
        assert deterministic.is_enabled()
    assert Switches.read() == before


def test_non_strict_mode_only_warns():
    with deterministic.enable(0, strict=False):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert deterministic.is_enabled()


def test_exception_inside_block_restores_switches_and_rng():
    before = Switches.read()
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    with pytest.raises(RuntimeError, match="boom"):
        with deterministic.enable(1):
            torch.rand(5)
            raise RuntimeError("boom")
    assert Switches.read() == before
    assert torch.equal(torch.rand(1), expected_next)


def test_nested_blocks_restore_the_outer_state():
    with deterministic.enable(1, threads=1):
        outer = Switches.read()
        with deterministic.enable(2, threads=2):
            assert torch.get_num_threads() == 2
        assert Switches.read() == outer
        assert deterministic.is_enabled()


def test_same_seed_same_random_numbers_everywhere_and_other_seed_differs():
    def draw(seed):
        with deterministic.enable(seed):
            return random.random(), np.random.rand(), torch.rand(4)

    a, b, other = draw(5), draw(5), draw(6)
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    assert a[0] != other[0] and a[1] != other[1] and not torch.equal(a[2], other[2])


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_seed_is_a_value_error(bad):
    with pytest.raises(ValueError, match="seed"):
        deterministic.enable(bad)


def test_bad_thread_count_is_a_value_error():
    with pytest.raises(ValueError, match="threads"):
        deterministic.enable(0, threads=0)


def test_state_restore_round_trip_covers_python_numpy_torch():
    saved = deterministic.state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    deterministic.restore(saved)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])
    # negative control: without restore the streams move on
    moved = (random.random(), np.random.rand(), torch.rand(3))
    assert moved[0] != first[0] and not torch.equal(moved[2], first[2])
