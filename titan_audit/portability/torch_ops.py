"""The torch-ops section of the kernel golden: what batch-invariant (BI) mode makes of the torch
calls a BI train or RL step runs outside the model (norms, clipping, the AdamW step, the
sampler's choice, the RL loss and advantages, sqrt/exp/log), on inputs made from integers.

Guarantees:
- Every input is built by integer arithmetic in numpy (splitmix64 keyed by the case name, turned
  into float bit patterns or into floats by exact conversions), then `torch.from_numpy`: never
  torch's RNG, whose bits change with the ISA. So a case's inputs are the same bytes on every CPU.
- `run_cases()` runs each case inside `titan_audit.batch_invariant.enabled()` under every ISA
  variant of our kernels the CPU has (`kernel_library.forced_isa`) at 1 and 2 intra-op threads, and yields
  the same `CaseOutputs` as the kernel battery (xxh3-128 of each output's raw bytes), so the
  golden checks them alike: one hash per (op, case) that every variant and thread count must
  reproduce. An op that still runs a vendor-chosen library path in BI mode (MKL VML picks its code
  by CPU vendor) shows up here as a hash that differs on another CPU.
- This section needs torch; the kernel section (`battery.py`) does not, and the two are recorded
  and checked separately.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from titan_audit.portability.battery import CaseOutputs, Record, digest

THREADS = (1, 2)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# ---------------------------------------------------------------- inputs from integers


def _fnv1a(text: str) -> int:
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def words(n: int, key: str) -> np.ndarray:
    """n uint64 from splitmix64 seeded by FNV-1a(key) (the battery's generator, in numpy)."""
    with np.errstate(over="ignore"):
        z = np.uint64(_fnv1a(key)) + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniform32(n: int, key: str, lo: float, hi: float) -> np.ndarray:
    """float32 in [lo, hi): 24 random bits * 2^-24 (exact), then lo + u * (hi - lo) in float32."""
    u = (words(n, key) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    return (np.float32(lo) + u * (np.float32(hi) - np.float32(lo))).astype(np.float32)


def uniform64(n: int, key: str, lo: float, hi: float) -> np.ndarray:
    u = (words(n, key) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return lo + u * (hi - lo)


def bits32(n: int, key: str) -> np.ndarray:
    """float32 of every bit pattern (uint32 words viewed as float32)."""
    return (words(n, key) >> np.uint64(32)).astype(np.uint32).view(np.float32)


def sqrt_sweep32(key: str, n: int = 1 << 17) -> np.ndarray:
    """Two inputs per 16-bit mantissa prefix over both exponent parities ([0.5, 1) and [1, 2)),
    7 random low bits: the hard inputs of an approximate sqrt (the battery's sqrt_f32/sweep)."""
    i = np.arange(n, dtype=np.uint32)
    low = (words(n, key) >> np.uint64(32)).astype(np.uint32) & np.uint32(0x7F)
    e = np.uint32(126) + (i & np.uint32(1))
    mant = ((i >> np.uint32(1)) << np.uint32(7)) | low
    return ((e << np.uint32(23)) | (mant & np.uint32(0x7FFFFF))).view(np.float32)


def _t(a: np.ndarray):  # noqa: ANN202
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).copy())


# ---------------------------------------------------------------- the cases
# Each case: a function of no arguments that builds its inputs and returns {part: tensor}.


def _vector_norm(n: int, kind: str) -> Callable[[], dict]:
    def run() -> dict:
        import torch

        key = f"vector_norm/{kind}_{n}"
        if kind == "f64":
            x = _t(uniform64(n, key, -1.0, 1.0))
        else:
            x = uniform32(n, key, -1.0, 1.0)
            if kind == "special":  # zeros, subnormals, huge (squares overflow) and tiny values
                x[::7] = 0.0
                x[1::11] = np.float32(1e-41)
                x[2::13] *= np.float32(1e-30)
                x[3::101] = np.float32(3e19)
            x = _t(x)
        return {"norm": torch.linalg.vector_norm(x, 2.0)}

    return run


def _clip(n: int, max_norm: float) -> Callable[[], dict]:
    def run() -> dict:
        from titan_audit.trainer.step import clip_

        flat = _t(uniform32(n, f"clip_/{n}", -0.05, 0.05))
        norm = clip_(flat, max_norm)
        return {"norm": norm, "flat": flat}

    return run


def _params(key: str) -> list:
    import torch

    shapes = [(64, 256), (7,), (1023,), (3, 5)]
    params = []
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape))
        p = torch.nn.Parameter(_t(uniform32(n, f"{key}/p{i}", -0.1, 0.1)).view(shape))
        p.grad = _t(uniform32(n, f"{key}/g{i}", -0.3, 0.3)).view(shape)
        params.append(p)
    return params


def _clip_grad_norm(max_norm: float) -> Callable[[], dict]:
    def run() -> dict:
        import torch

        params = _params("clip_grad_norm_")
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return {"norm": total, **{f"grad{i}": p.grad for i, p in enumerate(params)}}

    return run


def _adamw(steps: int) -> Callable[[], dict]:
    def run() -> dict:
        from titan_audit.trainer.optim import PortableAdamW

        params = _params("adamw")
        opt = PortableAdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False, fused=False)
        for step in range(steps):
            if step:
                for i, p in enumerate(params):
                    p.grad = _t(uniform32(p.numel(), f"adamw/step{step}/g{i}", -0.3, 0.3)).view(p.shape)
            opt.step()
        out = {}
        for i, p in enumerate(params):
            out[f"param{i}"] = p.detach()
            out[f"exp_avg{i}"] = opt.state[p]["exp_avg"]
            out[f"exp_avg_sq{i}"] = opt.state[p]["exp_avg_sq"]
        return out

    return run


def _sample(top_k: int, top_p: float) -> Callable[[], dict]:
    def run() -> dict:
        from titan_audit.rl.generator import SamplingParams
        from titan_audit.rl.sampling import sample_rows

        rows, vocab = 64, 2048
        logits = _t(uniform32(rows * vocab, "sample_rows/logits", -8.0, 8.0)).view(rows, vocab)
        uniforms = [float(u) for u in uniform64(rows, "sample_rows/u", 0.0, 1.0)]
        return {"tokens": sample_rows(logits, uniforms, SamplingParams(top_k=top_k, top_p=top_p))}

    return run


def _advantages(kind: str) -> Callable[[], dict]:
    def run() -> dict:
        import torch

        from titan_audit.rl.loss import group_advantages

        if kind == "binary_g8":
            r = (words(8, "adv/binary") >> np.uint64(63)).astype(np.float32)
        elif kind == "equal_g5":
            r = np.full(5, 0.75, dtype=np.float32)
        else:
            r = uniform32(16, "adv/uniform", -1.0, 2.0)
        return {"advantages": group_advantages(torch.from_numpy(r.copy()), 1e-6)}

    return run


def _lps(n: int, key: str):  # noqa: ANN202
    lp = uniform32(n, f"{key}/lp", -12.0, 0.0)
    # generator log-probs: equal, one ulp off, or a little off (some ratios leave the clip range)
    gen = lp.copy()
    sel = (words(n, f"{key}/sel") >> np.uint64(62)).astype(np.int64)
    gen[sel == 1] = np.nextafter(lp[sel == 1], np.float32(0.0))
    gen[sel >= 2] = lp[sel >= 2] + uniform32(int((sel >= 2).sum()), f"{key}/off", -0.5, 0.5)
    return lp, gen.astype(np.float32)


def _policy_loss(with_ref: bool) -> Callable[[], dict]:
    def run() -> dict:
        import torch

        from titan_audit.rl.loss import policy_loss

        n = 1000
        lp, gen = _lps(n, "policy_loss")
        adv = uniform32(n, "policy_loss/adv", -2.0, 2.0)
        ref = uniform32(n, "policy_loss/ref", -12.0, 0.0) if with_ref else None
        loss, parts = policy_loss(
            _t(lp), _t(gen), _t(adv), 4096, 0.2, None if ref is None else _t(ref), 0.05 if with_ref else 0.0
        )
        values = torch.tensor([parts["pg"], parts["clipped"], parts["ref_kl"]], dtype=torch.float64)
        return {"loss": loss, "parts": values}

    return run


def _gap_figures() -> dict:
    from titan_audit.rl.loss import gap_figures

    lp, gen = _lps(1000, "gap_figures")
    return {"figures": gap_figures(_t(lp), _t(gen))}


def _elementwise(name: str, dtype: str) -> Callable[[], dict]:
    def run() -> dict:
        import torch

        key = f"{name}/{dtype}"
        if dtype == "f32_sweep":
            x = sqrt_sweep32(key)
        elif dtype == "f32_bits":
            x = bits32(4099, key)
        elif dtype == "f64":
            lo, hi = (-745.0, 709.0) if name == "exp" else (0.0, 1e6)
            x = uniform64(4099, key, lo, hi)
        else:
            lo, hi = (-104.0, 88.0) if name == "exp" else (0.0, 1e6)
            x = uniform32(4099, key, lo, hi)
        return {"y": getattr(torch, name)(_t(x))}

    return run


CASES: dict[str, Callable[[], dict]] = {
    **{f"vector_norm/f32_{n}": _vector_norm(n, "f32") for n in (1, 7, 1023, 4099, 262_147)},
    "vector_norm/special_4099": _vector_norm(4099, "special"),
    "vector_norm/f64_4099": _vector_norm(4099, "f64"),
    "clip_/max1_65537": _clip(65_537, 1.0),
    "clip_/max0_65537": _clip(65_537, 0.0),
    "clip_/max1000_1023": _clip(1023, 1000.0),
    "clip_grad_norm_/max1": _clip_grad_norm(1.0),
    "clip_grad_norm_/max1000": _clip_grad_norm(1000.0),
    "adamw/step1": _adamw(1),
    "adamw/step3": _adamw(3),
    "sample_rows/plain": _sample(0, 1.0),
    "sample_rows/top_k50": _sample(50, 1.0),
    "sample_rows/top_p0.9": _sample(0, 0.9),
    "sample_rows/top_k50_top_p0.8": _sample(50, 0.8),
    "group_advantages/binary_g8": _advantages("binary_g8"),
    "group_advantages/equal_g5": _advantages("equal_g5"),
    "group_advantages/uniform_g16": _advantages("uniform_g16"),
    "policy_loss/ref": _policy_loss(True),
    "policy_loss/noref": _policy_loss(False),
    "gap_figures/n1000": _gap_figures,
    "sqrt/f32_sweep": _elementwise("sqrt", "f32_sweep"),
    "sqrt/f32_bits": _elementwise("sqrt", "f32_bits"),
    "sqrt/f64": _elementwise("sqrt", "f64"),
    "exp/f32": _elementwise("exp", "f32"),
    "exp/f32_bits": _elementwise("exp", "f32_bits"),
    "exp/f64": _elementwise("exp", "f64"),
    "log/f32": _elementwise("log", "f32"),
    "log/f32_bits": _elementwise("log", "f32_bits"),
    "log/f64": _elementwise("log", "f64"),
}

_DTYPE_CODES = {"float32": "f32", "float64": "f64", "int64": "i64"}


def _raw(t) -> tuple[str, int, bytes]:  # noqa: ANN001
    """(dtype code, element count, raw bytes) of a tensor's contiguous values."""
    t = t.detach().contiguous()
    code = _DTYPE_CODES.get(str(t.dtype).removeprefix("torch."))
    if code is None:
        raise ValueError(f"torch-ops golden: unsupported output dtype {t.dtype}")
    return code, t.numel(), t.numpy().tobytes()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def variants() -> list[str]:
    """The ISA variants of our kernels this CPU runs (each case runs under every one)."""
    from titan_audit.batch_invariant.cpu import kernel_library

    return list(kernel_library.available_isas())


def run_cases(*, only: str | None = None, threads: tuple[int, ...] = THREADS) -> Iterator[CaseOutputs]:
    """Run every case (or those whose "op/case" starts with `only`) in BI mode under every ISA
    variant and thread count; one CaseOutputs per (op, case, output part)."""
    import torch

    from titan_audit.batch_invariant import enabled
    from titan_audit.batch_invariant.cpu import kernel_library

    for name, case in CASES.items():
        if only and not name.startswith(only):
            continue
        op, case_name = name.split("/", 1)
        parts: dict[str, CaseOutputs] = {}
        for isa in variants():
            for n in threads:
                with kernel_library.forced_isa(isa), _threads(n), enabled(), torch.no_grad():
                    outputs = case()
                for part, tensor in outputs.items():
                    code, count, data = _raw(tensor)
                    out = parts.setdefault(part, CaseOutputs(op, f"{case_name}.{part}", code, count))
                    out.records.append(Record(isa, n, digest(data), data))
        yield from parts.values()
