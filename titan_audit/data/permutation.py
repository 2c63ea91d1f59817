"""A keyed pseudo-random permutation of [0, N) with O(1) state: a Feistel network + cycle walking.

Construction. Let b = max(1, ceil(bits(N - 1) / 2)); the Feistel network permutes [0, 4^b), a
domain of at most 4N values. A value x is split into halves L = x >> b and R = x & (2^b - 1);
each of `ROUNDS` = 6 rounds maps (L, R) -> (R, L xor F_i(R)), where F_i is the splitmix64
finalizer of (R + k_i) truncated to b bits and k_i is the i-th 64-bit round key. Any F gives a
bijection of [0, 4^b) (each round is invertible), whatever its quality. Cycle walking restricts
it to [0, N): apply the network repeatedly until the value falls below N. Starting from x < N,
the walk stays on x's cycle, which returns to x, so it ends and defines a bijection of [0, N);
since N > 4^b / 4 the expected number of applications is below 4.

State: the round keys only (6 x 64 bits), derived from the keyed stream
`numpy_generator(seed, "data.order", epoch, 0)`. Evaluating the permutation at any index is
O(1) expected, so a rank needs no O(N) table and a resume at any step costs the same.
"""

from __future__ import annotations

import numpy as np

from titan_audit.deterministic import numpy_generator

ROUNDS = 6
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


class FeistelPermutation:
    """perm(i) for i in [0, n): a bijection fixed by (n, round keys)."""

    def __init__(self, n: int, keys: np.ndarray) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        keys = np.asarray(keys, dtype=np.uint64)
        assert keys.shape == (ROUNDS,), keys.shape
        self.n = int(n)
        self.half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self.keys = keys
        self._shift = np.uint64(self.half_bits)
        self._mask = np.uint64((1 << self.half_bits) - 1)

    @classmethod
    def for_epoch(cls, n: int, seed: int, epoch: int) -> FeistelPermutation:
        rng = numpy_generator(seed, "data.order", epoch, 0)
        return cls(n, rng.integers(0, np.iinfo(np.uint64).max, size=ROUNDS, dtype=np.uint64, endpoint=True))

    def _round(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        return _mix((r + key) * _GOLD) & self._mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._shift, x & self._mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self._shift) | right

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        left, right = y >> self._shift, y & self._mask
        for key in self.keys[::-1]:
            left, right = right ^ self._round(left, key), left
        return (left << self._shift) | right

    def _walk(self, indices: np.ndarray | int, step) -> np.ndarray:
        x = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"permutation index out of range [0, {self.n}): {int(x.min())}..{int(x.max())}")
        y = step(x.astype(np.uint64))
        n = np.uint64(self.n)
        out = y >= n
        while out.any():
            y[out] = step(y[out])
            out = y >= n
        return y.astype(np.int64)

    def __call__(self, indices: np.ndarray | int) -> np.ndarray:
        """perm(indices), elementwise, as int64."""
        return self._walk(indices, self._encrypt)

    def inverse(self, values: np.ndarray | int) -> np.ndarray:
        return self._walk(values, self._decrypt)
