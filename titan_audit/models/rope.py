"""Rotary position embedding (RoPE) with float32 frequencies, HF "rotate_half" convention.

Guarantee: the cos/sin of a position are computed once, for all positions [0, max_positions),
in one float32 table, and looked up by index. A token's rotation therefore has the same bits
whatever the batch, the sequence length or the other positions in the call (computing cos/sin
on the fly would not: CPU transcendental kernels give tail elements different bits, see
`pointwise.py`). The table's cos/sin come from our own kernel (`batch_invariant.cpu.trig`), so
its bits are the same on every CPU and under every library knob. The rotation itself runs in
float32 (mul/add, correctly rounded) and is cast back to the input dtype.
"""

from __future__ import annotations

import torch

from titan_audit.batch_invariant.cpu.trig import cos_sin, rope_inv_freq


class RotaryTable:
    """cos/sin tables [max_positions, head_dim] in float32, built lazily once per device."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        assert head_dim % 2 == 0
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _build(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Built on CPU in float32 (the HF formula on our kernels), then moved: device independent.
        inv_freq = rope_inv_freq(self.theta, self.head_dim)  # 1 / theta^(2i/d), our exp/log
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs_PF = torch.outer(positions, inv_freq)
        angles_PD = torch.cat((freqs_PF, freqs_PF), dim=-1)
        return cos_sin(angles_PD)  # our kernel: torch.cos/sin bits follow ATEN_CPU_CAPABILITY and MKL_CBWR

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape positions.shape + (head_dim,), float32, on positions' device."""
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_positions):
            raise ValueError(
                f"positions must lie in [0, {self.max_positions}) (max_position_embeddings); got "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        device = positions.device
        if device not in self._tables:
            cos, sin = self._build()
            self._tables[device] = (cos.to(device), sin.to(device))
        cos_PD, sin_PD = self._tables[device]
        return cos_PD[positions], sin_PD[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the per-token cos/sin [B, T, D] (float32)."""
    x32 = x_BHTD.float()
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return (x32 * cos + rotate_half(x32) * sin).to(x_BHTD.dtype)
