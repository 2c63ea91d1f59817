"""The op census of batch-invariant mode (batch_invariant/census.py) and the routes that keep it
clean (batch_invariant/elementwise.py).

What is checked: in BI mode the vendor-chosen ops (exp, log, sqrt, pow, mean, add with alpha) run
on our kernels or exact ops, bit for bit; an op with no kernel of ours is counted (record) or
refused naming the op and its call site (strict), in any thread and when called from inside one
of our own overrides; ops on the exact allowlist and integer work pass; BI train steps (dense,
MoE, bfloat16) run under the strict census with no refusal. Negative controls: a deliberately
added native op (torch.tanh) is refused under strict and counted under record; our routed sqrt is
the correctly rounded root and a root with one more rounding (x / sqrt(x)) is not, so the
comparison can fail.
The RL side (both generators, verify-onpolicy) runs strict in tests/rl/test_loop.py and
tests/rl/test_vllm_rl.py (their runs' manifests must say `native_ops_seen: {}`).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from titan_audit import batch_invariant as bi
from titan_audit.batch_invariant import census
from titan_audit.batch_invariant.cpu import pointwise


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 8: torch.int64, 2: torch.int16}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def data(seed: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n)).to(dtype)


@pytest.fixture(autouse=True)
def fresh_census():
    census.reset()
    yield
    census.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_log_sqrt_run_our_kernels_in_bi_mode(dtype):
    x = data(0, 10_001, dtype)
    with bi.enabled(), census.strict():
        got = {
            "exp": torch.exp(x),
            "log": torch.log(x.abs()),
            "sqrt": x.abs().sqrt(),
            "rsqrt": torch.rsqrt(x.abs()),
            "pow_half": x.abs().pow(0.5),
            "inplace_exp": x.clone().exp_(),
        }
    assert same_bits(got["exp"], pointwise.exp(x)) and same_bits(got["inplace_exp"], pointwise.exp(x))
    assert same_bits(got["log"], pointwise.log(x.abs()))
    assert same_bits(got["sqrt"], pointwise.sqrt(x.abs())) and same_bits(got["pow_half"], got["sqrt"])
    assert same_bits(got["rsqrt"], torch.reciprocal(pointwise.sqrt(x.abs())))


def test_bfloat16_rounds_our_float32_result_once():
    x = data(1, 999, torch.bfloat16)
    with bi.enabled(), census.strict():
        y = torch.exp(x)
    assert y.dtype == torch.bfloat16 and same_bits(y, pointwise.exp(x.float()).to(torch.bfloat16))


@pytest.mark.control
def test_sqrt_is_correctly_rounded_and_one_with_another_rounding_is_not():
    """The routed sqrt against the correctly rounded root (not another CPU); the control, a root
    with one more rounding (x / sqrt(x), IEEE division of our root), fails the same comparison.
    torch's own kernel (MKL VML on x86, its code path picked by the CPU vendor: the reason for the
    route) is reported, not asserted. The reference is numpy's float64 sqrt (the IEEE instruction)
    rounded to float32, exact for a square root (53 >= 2 * 24 + 2 bits); torch's own float64 sqrt
    goes through MKL VML too, which is not correctly rounded (about 1% of roots off by an ulp)."""
    x = data(2, 100_003).abs()
    correct = torch.from_numpy(np.sqrt(x.numpy().astype(np.float64)).astype(np.float32))
    with bi.enabled():
        ours = x.sqrt()
        native = census.call_native("aten::sqrt", x)
    assert same_bits(ours, correct)
    assert not same_bits(x / pointwise.sqrt(x), correct)
    print(f"torch's own sqrt: {int((bits(native) != bits(correct)).sum())} of {x.numel()} roots not correctly rounded")


def test_pow_mean_and_alpha_are_exact_ops():
    x, y = data(3, 4097), data(4, 4097)
    with bi.enabled(), census.strict():
        squares, cubes, inverse = x.pow(2), x.pow(3), x.pow(-1)
        mean = x.mean()
        added, subtracted = torch.add(x, y, alpha=0.3), torch.sub(x, y, alpha=3)
    assert same_bits(squares, x * x) and same_bits(cubes, x * x * x) and same_bits(inverse, torch.reciprocal(x))
    assert same_bits(mean, bi.sum(x) / x.numel())
    assert same_bits(added, x + y * 0.3) and same_bits(subtracted, x - y * 3)


def test_vector_norm_sqrt_inside_our_override_is_routed():
    """The nested call the issue found (`total.sqrt()` inside mode._vector_norm) runs our sqrt."""
    g = data(5, 50_000)
    with bi.enabled(), census.strict():
        norm = torch.linalg.vector_norm(g, 2.0)
    assert same_bits(norm, pointwise.sqrt(bi.sum(g * g)).reshape(()))


@pytest.mark.control
def test_negative_control_a_native_op_is_refused_under_strict_naming_it_and_the_call_site():
    x = data(6, 100)
    with bi.enabled(), census.strict(), pytest.raises(census.NativeOpError) as error:
        torch.tanh(x)
    message = str(error.value)
    assert "aten::tanh" in message and "test_census.py" in message


def test_record_mode_counts_native_ops_with_reason_and_first_site():
    x = data(7, 100)
    with bi.enabled():
        for _ in range(3):
            torch.tanh(x)
        x.pow(2.5)
        torch.zeros(4).index_put_((torch.tensor([1, 1]),), torch.ones(2), accumulate=True)
        torch.arange(5) + torch.arange(5)  # integer work: exact, not counted
        torch.zeros(4).index_put_((torch.tensor([0, 2]),), torch.ones(2), accumulate=True)  # distinct: exact
    seen = {s.op: s for s in census.seen()}
    assert seen["aten::tanh"].count == 3 and "test_census.py" in seen["aten::tanh"].first_site
    assert seen["aten::pow.Tensor_Scalar"].reason == "exponent=2.5"
    assert (
        "repeated destinations" in seen["aten::_index_put_impl_"].reason and seen["aten::_index_put_impl_"].count == 1
    )
    assert set(seen) == {"aten::tanh", "aten::pow.Tensor_Scalar", "aten::_index_put_impl_"}
    json.dumps(census.summary())  # what a manifest stores


def test_census_sees_other_threads_and_nothing_outside_bi_mode():
    x = data(8, 100)
    torch.tanh(x)  # BI mode off: no census
    with bi.enabled():
        worker = threading.Thread(target=torch.tanh, args=(x,))
        worker.start()
        worker.join()
    assert [(s.op, s.count) for s in census.seen()] == [("aten::tanh", 1)]


def _train_config(preset_overrides: list[str]):
    from titan_audit.trainer.config import load_config

    return load_config(
        "tiny-dense",
        [
            "steps=1",
            "determinism.batch_invariant=true",
            'determinism.census="strict"',
            "data.global_batch_size=4",
            "data.microbatch_size=2",
            "data.seq_len=64",
            "data.synthetic_records=64",
            "checkpoint.interval=0",
            *preset_overrides,
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides", [[], ['model.preset="tiny-moe"'], ['model.compute_dtype="bfloat16"']], ids=["dense", "moe", "bf16"]
)
def test_bi_train_step_runs_under_the_strict_census(tmp_path, overrides):
    """Forward, backward, fixed-tree reduction, clip and PortableAdamW of a BI step: nothing native."""
    from titan_audit.trainer.train import train

    train(_train_config(overrides), tmp_path / "run", quiet=True)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["bi_census"] == {"mode": "strict", "native_ops_seen": {}}
    assert manifest["fingerprint"]["batch_invariant"] is True


@pytest.mark.slow
def test_bi_fsdp2_step_on_two_ranks_runs_under_the_strict_census(tmp_path):
    """FSDP2 (DTensor shards, their all-gathers and the sharded PortableAdamW) at W=2: a native op
    on either rank would have stopped the run (strict), so exit 0 means neither saw one."""
    from titan_audit.trainer.launch import LaunchOptions, launch
    from titan_audit.trainer.train import TRAIN_JOB

    assert (
        launch(
            TRAIN_JOB,
            _train_config(['parallel.mode="fsdp"']),
            tmp_path / "run",
            nproc=2,
            options=LaunchOptions(quiet=True),
        )
        == 0
    )
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["bi_census"] == {"mode": "strict", "native_ops_seen": {}}
