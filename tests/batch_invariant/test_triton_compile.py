"""Every Triton kernel compiles for a Hopper GPU (sm_90), here, without a GPU (marker `triton`).

Triton's wheel carries ptxas, so `triton.compile` can take each kernel from Python to a cubin
for a named target with no device present: the compiled path the GPU runs is at least built and
checked for types here (the interpreter tests prove its arithmetic's invariance). The bf16 matmul
must use Hopper's wgmma instructions and no atomics (no split-K), and no kernel may use atomics.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

triton = pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")


def _compile(
    kernel,
    ptr_types: dict[str, str],
    constexprs: dict[str, object],
    floats: tuple[str, ...] = (),
    num_warps: int = 4,
    num_stages: int = 2,
):  # noqa: ANN001, ANN202
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": False},
    )


def _no_atomics(compiled) -> None:  # noqa: ANN001
    assert not re.search(r"^\s*(@%p\d+\s+)?(atom|red)\.", compiled.asm["ptx"], flags=re.MULTILINE)


def test_matmul_compiles_for_sm90_with_wgmma_and_no_atomics() -> None:
    from titan_audit.batch_invariant.gpu import matmul

    for dtype, ty in (("bf16", "*bf16"), ("fp32", "*fp32")):
        cfg = matmul.CONFIGS[{"bf16": matmul.torch.bfloat16, "fp32": matmul.torch.float32}[dtype]]
        k = _compile(
            matmul._gemm_kernel,
            {n: ty for n in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr")},
            dict(HAS_BIAS=True, DOT_F32=False, IEEE=dtype == "fp32", BM=cfg[0], BN=cfg[1], BK=cfg[2], GROUP_M=8),
            num_warps=cfg[3],
            num_stages=cfg[4],
        )
        _no_atomics(k)
        if dtype == "bf16":
            assert "wgmma.mma_async" in k.asm["ptx"]


def test_row_and_attention_kernels_compile_for_sm90() -> None:
    # by module path: the package exports functions of the same names (softmax, rms_norm, ...)
    attention, attention_backward, rms_norm, softmax, sum = (  # noqa: A001
        importlib.import_module(f"titan_audit.batch_invariant.gpu.{name}")
        for name in ("attention", "attention_backward", "rms_norm", "softmax", "sum")
    )

    f32 = "*fp32"
    compiled = [
        _compile(sum._row_sum_kernel, {"x_ptr": "*bf16", "out_ptr": f32}, dict(BLOCK=4096), num_warps=16),
        _compile(softmax._softmax_kernel, {"x_ptr": "*bf16", "y_ptr": f32}, dict(LOG=True, BLOCK=4096)),
        _compile(
            softmax._softmax_backward_kernel, {"g_ptr": f32, "y_ptr": f32, "out_ptr": f32}, dict(LOG=False, BLOCK=1024)
        ),
        _compile(
            rms_norm._rms_norm_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": f32, "rstd_ptr": f32},
            dict(HAS_W=True, BLOCK=4096),
            floats=("eps",),
        ),
        _compile(
            rms_norm._rms_norm_backward_kernel,
            {"g_ptr": f32, "x_ptr": f32, "w_ptr": "*bf16", "rstd_ptr": f32, "gx_ptr": f32},
            dict(HAS_W=True, BLOCK=4096),
        ),
        _compile(
            rms_norm._weight_grad_chunks_kernel,
            {"g_ptr": f32, "x_ptr": f32, "rstd_ptr": f32, "part_ptr": f32},
            dict(ROWS=64, BLOCK=128),
        ),
        _compile(rms_norm._chunk_sum_kernel, {"part_ptr": f32, "out_ptr": f32}, dict(BLOCK=128)),
    ]
    split, bm, bn, warps, stages = attention.CONFIG
    att_ptrs = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "bt_ptr": "*i32",
        "seq_ptr": "*i32",
        "pos_ptr": "*i64",
        "doc_ptr": "*i64",
        "mask_ptr": "*i1",
        "po_ptr": f32,
        "pm_ptr": f32,
        "pl_ptr": f32,
    }
    compiled.append(
        _compile(
            attention._split_kernel,
            att_ptrs,
            dict(
                G=4,
                CAUSAL=True,
                HAS_DOC=True,
                HAS_MASK=True,
                DOT_F32=False,
                IEEE=False,
                SPLIT=split,
                BLOCK_M=bm,
                BLOCK_N=bn,
                BLOCK_D=128,
            ),
            floats=("qk_scale",),
            num_warps=warps,
            num_stages=stages,
        )
    )
    compiled.append(
        _compile(
            attention._combine_kernel,
            {"po_ptr": f32, "pm_ptr": f32, "pl_ptr": f32, "out_ptr": f32, "lse_ptr": f32},
            dict(G=4, BLOCK_R=bm, BLOCK_D=128),
        )
    )
    bm, bn, warps, stages = attention_backward.CONFIG
    bwd_ptrs = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "do_ptr": "*bf16",
        "lse_ptr": f32,
        "delta_ptr": f32,
        "pos_ptr": "*i64",
        "doc_ptr": "*i64",
        "mask_ptr": "*i1",
        "dq_ptr": f32,
        "dk_ptr": f32,
        "dv_ptr": f32,
    }
    common = dict(
        G=4, CAUSAL=True, HAS_DOC=False, HAS_MASK=False, DOT_F32=False, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=128
    )
    for kern in (attention_backward._dq_kernel, attention_backward._dkv_kernel):
        compiled.append(
            _compile(kern, bwd_ptrs, common, floats=("qk_scale", "scale"), num_warps=warps, num_stages=stages)
        )
    compiled.append(
        _compile(
            attention_backward._delta_kernel,
            {"o_ptr": f32, "do_ptr": f32, "delta_ptr": f32},
            dict(BLOCK_R=64, BLOCK_D=128),
        )
    )
    for k in compiled:
        _no_atomics(k)


def test_pointwise_kernels_compile_for_sm90_with_ieee_division_sqrt_and_only_the_written_fmas() -> None:
    """The element-wise kernels' bits equal the CPU kernels' only if the GPU runs the same correctly
    rounded operations: division and square root as div.rn / sqrt.rn (Triton's plain `/` and
    tl.sqrt would be approximate), no approximate ex2 / lg2, and exactly the fmas the source
    writes (exp: 2 Cody-Waite steps + 7 Horner steps per element; fusion off adds none)."""
    from titan_audit.batch_invariant.gpu import pointwise

    block, warps = 1024, 4
    per_thread = block // (32 * warps)
    fmas = {"exp": 9, "exp2": 7, "log": 6, "sqrt": 0, "sigmoid": 9, "silu": 9}
    for op, count in fmas.items():
        ptx = _compile(pointwise._unary_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, dict(OP=op, BLOCK=block)).asm[
            "ptx"
        ]
        assert not re.search(r"\b(div\.(full|approx)|sqrt\.approx|ex2\.approx|lg2\.approx|rcp\.approx)", ptx), op
        assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == count * per_thread, op
        if op in ("log", "sigmoid", "silu"):
            assert "div.rn.f32" in ptx, op
    assert (
        "sqrt.rn.f32"
        in _compile(pointwise._unary_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, dict(OP="sqrt", BLOCK=block)).asm[
            "ptx"
        ]
    )
    f32 = "*fp32"
    for op, count in (("sigmoid_backward", 0), ("silu_backward", 10)):
        kernel = _compile(
            pointwise._backward_kernel, {"g_ptr": f32, "saved_ptr": f32, "gx_ptr": f32}, dict(OP=op, BLOCK=block)
        )
        _no_atomics(kernel)
        assert len(re.findall(r"\bfma\.rn\.f32\b", kernel.asm["ptx"])) == count * per_thread, op


def test_control_plain_division_and_sqrt_compile_to_approximations() -> None:
    """The check above can fail: Triton's plain `/` and `tl.sqrt` compile to approximate PTX."""
    import triton.language as tl

    @triton.jit
    def plain(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        tl.store(y_ptr + offs, tl.sqrt(x) / (1.0 + x))

    ptx = _compile(plain, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, dict(BLOCK=1024)).asm["ptx"]
    assert re.search(r"\bdiv\.(full|approx)", ptx) and re.search(r"\bsqrt\.approx", ptx)


def test_lattice_kernel_compiles_for_sm90_with_wrapping_64_bit_products() -> None:
    """The audit's device lattice kernel (batch_invariant/gpu/lattice.py), for each word width:
    two low 64-bit products per word and lane (the lanes are sums modulo 2^64: mul.lo keeps the
    low 64 bits, as the CPU kernel's uint64 arithmetic does) and no atomics (the programs'
    partial lanes are added by torch afterwards)."""
    from titan_audit.batch_invariant.gpu import lattice

    block, warps = lattice.MAX_BLOCK, 4
    ptrs = {n: "*i64" for n in ("local_ptr", "global_ptr", "t0_ptr", "t1_ptr", "b0_ptr", "b1_ptr", "out_ptr")}
    for ty, dtype in (("*u8", lattice.torch.uint8), ("*i16", lattice.torch.int16), ("*i32", lattice.torch.int32)):
        constexprs = dict(
            MASK=lattice._cpu.WORD_MASK[dtype],
            X0=lattice._cpu.X0,
            X1=lattice._cpu.X1,
            SHIFT=lattice._cpu.BLOCK_SHIFT,
            BLOCK=block,
        )
        kernel = _compile(lattice._lanes_kernel, {**ptrs, "words_ptr": ty}, constexprs, num_warps=warps)
        _no_atomics(kernel)
        products = re.findall(r"\bmul\.lo\.[su]64\b", kernel.asm["ptx"])
        assert len(products) == 4 * block // (32 * warps), ty
