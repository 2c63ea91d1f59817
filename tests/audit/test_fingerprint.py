"""audit.fingerprint: xxh3-128 over (dtype, shape) header + raw bytes, exactly as documented."""

import subprocess
import sys

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from titan_audit.audit import fingerprint, fingerprint_many


def _documented(tensor: torch.Tensor) -> str:
    """The byte format from the module docstring, built independently (through numpy bytes)."""
    t = tensor.detach().contiguous()
    header = b"titan-audit.tensor.v1|%s|%s|" % (
        str(t.dtype).removeprefix("torch.").encode(),
        ",".join(str(s) for s in t.shape).encode(),
    )
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return xxhash.xxh3_128(header + raw).hexdigest()


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_documented_format_for_every_dtype(dtype):
    t = (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    assert fingerprint(t) == _documented(t)
    assert len(fingerprint(t)) == 32


def test_negative_and_positive_zero_differ():
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))
    assert fingerprint(torch.tensor([0.0], dtype=torch.bfloat16)) != fingerprint(
        torch.tensor([-0.0], dtype=torch.bfloat16)
    )


def test_same_bytes_under_another_dtype_or_shape_differ():
    t = torch.arange(12, dtype=torch.int32)
    assert fingerprint(t) != fingerprint(t.view(torch.float32))
    assert fingerprint(t) != fingerprint(t.view(3, 4))
    assert fingerprint(t.view(3, 4)) != fingerprint(t.view(4, 3))
    assert fingerprint(torch.empty(0, 3)) != fingerprint(torch.empty(3, 0))


def test_nan_payloads_count():
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(a).all() and torch.isnan(b).all()
    assert fingerprint(a) != fingerprint(b)


@given(
    numel=st.integers(1, 4096),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
    data=st.data(),
)
def test_one_flipped_bit_anywhere_changes_the_fingerprint(numel, dtype, data):
    t = torch.randint(0, 255, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8).view(dtype)
    raw = t.view(torch.uint8).clone()
    byte = data.draw(st.integers(0, raw.numel() - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    raw[byte] ^= 1 << bit
    assert fingerprint(t) != fingerprint(raw.view(dtype))
    assert fingerprint(t) == fingerprint(t.clone())  # control: an untouched copy matches


def test_logical_tensor_is_hashed_not_its_layout():
    t = torch.randn(4, 6)
    assert fingerprint(t.t()) == fingerprint(t.t().contiguous())
    assert fingerprint(t[:, ::2]) == fingerprint(t[:, ::2].clone())
    assert fingerprint(t[1:3]) == _documented(t[1:3])
    assert fingerprint(torch.nn.Parameter(t)) == fingerprint(t)
    assert fingerprint(t.requires_grad_()) == fingerprint(t.detach())


def test_conjugate_and_negative_views_are_resolved():
    z = torch.complex(torch.randn(3), torch.randn(3))
    assert fingerprint(z.conj()) == fingerprint(z.conj().resolve_conj())
    assert fingerprint(z.conj()) != fingerprint(z)


def test_zero_dim_and_empty_tensors():
    assert fingerprint(torch.tensor(1.5)) == _documented(torch.tensor(1.5))
    assert fingerprint(torch.tensor(1.5)) != fingerprint(torch.tensor([1.5]))
    assert fingerprint(torch.empty(0)) == _documented(torch.empty(0))


def test_stable_across_processes():
    code = (
        "import torch; from titan_audit.audit import fingerprint; "
        "print(fingerprint(torch.arange(100, dtype=torch.bfloat16)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == fingerprint(torch.arange(100, dtype=torch.bfloat16))


def test_fingerprint_many_matches_single_calls_and_skips_non_tensors():
    state = {"a": torch.randn(3), "b": torch.zeros(2, dtype=torch.bfloat16), "step": 3}
    hashes = fingerprint_many(state)
    assert hashes == {"a": fingerprint(state["a"]), "b": fingerprint(state["b"])}
    assert fingerprint_many([state["a"], state["b"]]) == [hashes["a"], hashes["b"]]


def test_unsupported_inputs_are_clear_errors():
    with pytest.raises(TypeError, match="torch.Tensor"):
        fingerprint([1.0, 2.0])
    with pytest.raises(ValueError, match="meta"):
        fingerprint(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="layout"):
        fingerprint(torch.eye(3).to_sparse())
