"""Bitwise tensor equality: same dtype, same shape, same bytes (so -0.0 != +0.0, NaN payloads count).

`torch.equal` compares values (-0.0 == +0.0, NaN != NaN); these helpers compare the raw bits
through an integer view of the same width, which is what every "bitwise" claim here means.
"""

from __future__ import annotations

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a contiguous integer tensor of the same element width and shape."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype is torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(_INT_OF_WIDTH[tensor.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff a and b have the same dtype, the same shape and identical bytes (on any devices:
    tensors on two devices are compared on the CPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits_a, bits_b = bits(a), bits(b)
    if bits_a.device != bits_b.device:
        bits_a, bits_b = bits_a.cpu(), bits_b.cpu()
    return torch.equal(bits_a, bits_b)


def describe_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when bitwise equal; otherwise a short human description of the first difference."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    differ = bits(a).cpu() != bits(b).cpu()
    count = int(differ.sum())
    if count == 0:
        return None
    flat = int(differ.reshape(-1).nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    return (
        f"{count} of {a.numel()} elements differ; first at {index}: "
        f"{a.reshape(-1)[flat].item()!r} vs {b.reshape(-1)[flat].item()!r}"
    )


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "tensors") -> None:
    """Raise AssertionError naming the first differing element unless a and b are bitwise equal."""
    problem = describe_difference(a, b)
    if problem is not None:
        raise AssertionError(f"{what} not bitwise equal: {problem}")
