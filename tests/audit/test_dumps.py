"""Tensor dumps in RUN/dumps.zarr: bitwise round trip for every dtype, bf16 as uint16, no overwrite."""

import pytest
import torch
import zarr

from titan_audit.audit import DumpWriter, bitwise_equal, list_dumps, read_dump
from titan_audit.audit.dumps import array_path, has_dump

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


def _values(dtype: torch.dtype, shape=(37, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 3).to(dtype)
        flat = t.view(-1)
        flat[0], flat[1] = -0.0, float("nan") if dtype not in (torch.float8_e4m3fn,) else -0.0
        return t
    return torch.randint(-100 if dtype is not torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bitwise(tmp_path, dtype):
    t = _values(dtype)
    DumpWriter(tmp_path).write(2, "forward", 0, "blocks.0/out", t)
    back = read_dump(tmp_path, 2, "forward", 0, "blocks.0/out")
    assert bitwise_equal(back, t)


def test_bf16_stored_as_uint16_view_with_dtype_attribute(tmp_path):
    t = _values(torch.bfloat16)
    DumpWriter(tmp_path).write(0, "grad", -1, "w", t)
    array = zarr.open_group(str(tmp_path / "dumps.zarr"), mode="r")[array_path(0, "grad", -1, "w")]
    assert str(array.dtype) == "uint16"
    assert array.attrs["torch_dtype"] == "bfloat16"
    assert array.metadata.codecs[-1].to_dict()["name"] == "zstd"


def test_chunked_large_and_scalar(tmp_path):
    big = torch.randn(1024, 512)  # 2 MiB: more than one chunk
    writer = DumpWriter(tmp_path)
    writer.write(0, "param", -1, "big", big)
    writer.write(0, "loss", 0, "loss", torch.tensor(0.5))
    array = zarr.open_group(str(tmp_path / "dumps.zarr"), mode="r")[array_path(0, "param", -1, "big")]
    assert array.chunks[0] < 1024
    assert bitwise_equal(read_dump(tmp_path, 0, "param", -1, "big"), big)
    assert bitwise_equal(read_dump(tmp_path, 0, "loss", 0, "loss"), torch.tensor(0.5))
    assert {d["name"] for d in list_dumps(tmp_path)} == {"big", "loss"}


def test_never_overwritten(tmp_path):
    writer = DumpWriter(tmp_path)
    t = torch.arange(4.0)
    writer.write(1, "param", -1, "w", t)
    writer.write(1, "param", -1, "w", t.clone())  # same bytes: a faithful replay, no-op
    with pytest.raises(ValueError, match="never overwritten"):
        writer.write(1, "param", -1, "w", t + 1)
    assert bitwise_equal(read_dump(tmp_path, 1, "param", -1, "w"), t)


def test_incomplete_dump_is_not_read(tmp_path):
    writer = DumpWriter(tmp_path)
    writer.write(0, "param", -1, "w", torch.ones(3))
    array = writer.group[array_path(0, "param", -1, "w")]
    array.attrs["complete"] = False  # as if the writer died before finishing
    assert not has_dump(tmp_path, 0, "param", -1, "w")
    with pytest.raises(ValueError, match="incomplete dump"):
        read_dump(tmp_path, 0, "param", -1, "w")
    assert list_dumps(tmp_path) == []


def test_missing_dumps_are_user_errors(tmp_path):
    with pytest.raises(ValueError, match="dumps.zarr not found"):
        read_dump(tmp_path, 0, "param", -1, "w")
    DumpWriter(tmp_path).write(0, "param", -1, "w", torch.ones(1))
    with pytest.raises(ValueError, match="no dump"):
        read_dump(tmp_path, 0, "param", -1, "other")
