// ta_common.h: what every titan-audit CPU kernel shares.
//
// Guarantee this header exists to make possible: every kernel computes each output element by a
// fixed sequence of IEEE-754 float operations that depends only on the problem's fixed dims
// (K, head_dim, key positions, row length), never on M, the batch, the thread count or the ISA.
// How:
//   * Each source file is compiled once per ISA variant (scalar, avx2, avx512) with
//     -ffp-contract=off and no fast-math, so the compiler may neither fuse a*b+c nor reorder sums;
//     every fused multiply-add is an explicit fma (std::fma / _mm*_fmadd_ps), which rounds once
//     on every ISA that has it, so a scalar std::fma chain and a vector lane give the same bits.
//   * Vector lanes run along dimensions that are not reduced (gemm: N; attention scores: keys).
//     A reduction along a row uses TA_LANES (16) logical lanes -- lane l accumulates elements
//     l, l+16, l+32, ... in ascending order -- and then the fixed pairwise tree of
//     `ta_tree16`. AVX-512 holds the 16 lanes in one zmm, AVX2 in two ymm, scalar in an array:
//     the same operations on the same values in the same order.
//   * Threads (OpenMP, the runtime torch already loaded) split outputs, never a reduction.
//   * Denormals: the kernels do not touch MXCSR; torch's default (no flush) is what they run under.
//
// Each exported function is `extern "C" ta_<name>__<isa>`, made by TA_EXPORT; Python
// (cpu/_lib.py) resolves the variant chosen at run time.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(TA_ISA_SCALAR) && !defined(TA_ISA_AVX2) && !defined(TA_ISA_AVX512)
#error "compile with one of -DTA_ISA_SCALAR, -DTA_ISA_AVX2, -DTA_ISA_AVX512 (the Makefile does)"
#endif

#if defined(TA_ISA_AVX2) || defined(TA_ISA_AVX512)
#include <immintrin.h>
#endif

#if defined(TA_ISA_SCALAR)
#define TA_ISA_SUFFIX scalar
#elif defined(TA_ISA_AVX2)
#define TA_ISA_SUFFIX avx2
#else
#define TA_ISA_SUFFIX avx512
#endif

#define TA_CAT2(a, b) a##__##b
#define TA_CAT(a, b) TA_CAT2(a, b)
// TA_EXPORT(ret, name)(args...) declares extern "C" ret ta_name__<isa>(args...).
#define TA_EXPORT(ret, name) extern "C" __attribute__((visibility("default"))) ret TA_CAT(ta_##name, TA_ISA_SUFFIX)

// Bump when any kernel's output bits change; recorded in the numerics fingerprint (compared).
#define TA_KERNELS_VERSION 2  // 2: float64 pointwise exp / log / sqrt; canonical NaN out of gemm and cos_sin

#define TA_LANES 16

namespace ta {

// The fixed pairwise tree over 16 lane partial sums: ((l0+l8)+(l4+l12)) ... exactly:
// step 1: s[i] = l[i] + l[i+8] (i < 8); step 2: s[i] += s[i+4] (i < 4); step 3: s[i] += s[i+2];
// step 4: s[0] + s[1]. Every variant reduces its 16 lanes with this function's order.
static inline float tree16(const float* l) {
    float s[8];
    for (int i = 0; i < 8; ++i) s[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
    for (int i = 0; i < 2; ++i) s[i] = s[i] + s[i + 2];
    return s[0] + s[1];
}

static inline double tree16(const double* l) {
    double s[8];
    for (int i = 0; i < 8; ++i) s[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
    for (int i = 0; i < 2; ++i) s[i] = s[i] + s[i + 2];
    return s[0] + s[1];
}

// Threads split [0, n) into contiguous, disjoint output ranges; fn(begin, end) must write only
// the outputs of its range. The result never depends on num_threads.
template <typename F>
static inline void parallel_for(int64_t n, int num_threads, F fn) {
    if (num_threads <= 1 || n <= 1) {
        fn(int64_t(0), n);
        return;
    }
    int64_t nt = num_threads < n ? num_threads : n;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int64_t t = 0; t < nt; ++t) {
        int64_t begin = n * t / nt, end = n * (t + 1) / nt;
        if (begin < end) fn(begin, end);
    }
}

}  // namespace ta
