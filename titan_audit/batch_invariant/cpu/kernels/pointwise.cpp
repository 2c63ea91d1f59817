// pointwise.cpp: element-wise exp, exp2, log, sqrt, sigmoid, silu, silu(gate) * up and the backward
// of sigmoid, silu and silu(gate) * up in float32, and exp, log, sqrt in float64, over contiguous
// buffers.
//
// Guarantee: an element's bits are a function of its value alone (and its gradient's), the
// same on every ISA variant and wherever the element sits in its buffer: each element runs the
// one fixed sequence written next to its kernel (ta_math.h's polynomials and correctly rounded
// IEEE operations; no tail path, no table, no libm call), and threads only split the buffer.
// Every NaN result is stored as the one quiet NaN 0x7fc00000 (ta::canon_nan_f32; float64:
// 0x7ff8000000000000, ta::canon_nan_f64): x86 makes an invalid operation's NaN negative, arm64
// positive, and which operand's NaN propagates depends on the operand order the compiler picks.
// The float64 kernels are one scalar loop in every variant (the avx2 / avx512 objects compile the
// same source; whatever the compiler vectorises, each lane does the same IEEE operations).
#include "ta_common.h"
#include "ta_math.h"

namespace {

// Elements per thread below which one thread does the whole buffer (never changes bits).
constexpr int64_t kGrain = 1 << 15;

template <typename F>
void map(int64_t n, int threads, F f) {
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    ta::parallel_for(chunks, threads, [&](int64_t c0, int64_t c1) {
        const int64_t e = c1 * kGrain < n ? c1 * kGrain : n;
        for (int64_t i = c0 * kGrain; i < e; ++i) f(i);
    });
}

// e = exp(-|x|) (never overflows), by ta::exp_f32; sigmoid(x) = num / (1 + e) with
// num = 1 for x >= 0 and e otherwise (so a very negative x keeps its tiny, subnormal value).
inline float exp_neg_abs(float x) { return ta::exp_f32(-std::fabs(x)); }
inline float sigmoid_f32(float x) {
    const float e = exp_neg_abs(x);
    return ta::select_f32(x >= 0.0f, 1.0f, e) / (1.0f + e);
}
// silu(x) = (x * num) / (1 + e) with e and num as in sigmoid_f32 (one rounding fewer for x >= 0).
inline float silu_one(float x) {
    const float e = exp_neg_abs(x);
    return (x * ta::select_f32(x >= 0.0f, 1.0f, e)) / (1.0f + e);
}

#if defined(TA_ISA_AVX512)
// AVX-512: 16 elements a step with ta::exp_f32_v16 (exp_f32's bits), the tail as one masked
// step; each formula is the one of the generic kernel below it, op for op (the tests compare
// every variant with the scalar one).
template <typename F>
void map16(int64_t n, int threads, F f) {
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    ta::parallel_for(chunks, threads, [&](int64_t c0, int64_t c1) {
        const int64_t e = c1 * kGrain < n ? c1 * kGrain : n;
        int64_t i = c0 * kGrain;
        for (; i + 16 <= e; i += 16) f(i, (__mmask16)0xffff);
        if (i < e) f(i, (__mmask16)((1u << (e - i)) - 1u));
    });
}

// -|x|: the sign bit set (what -std::fabs(x) does).
inline __m512 neg_abs16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

inline __m512 canon16(__m512 y) {
    const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, y, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

// e = exp(-|x|), num = x >= 0 ? 1 : e; returns num / (1 + e) (sigmoid_f32).
inline __m512 sigmoid16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = ta::exp_f32_v16(neg_abs16(x));
    const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_div_ps(_mm512_mask_blend_ps(nonneg, e, one), _mm512_add_ps(one, e));
}

// (x * num) / (1 + e) (silu_one).
inline __m512 silu16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = ta::exp_f32_v16(neg_abs16(x));
    const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_div_ps(_mm512_mul_ps(x, _mm512_mask_blend_ps(nonneg, e, one)), _mm512_add_ps(one, e));
}
#endif

#if defined(TA_ISA_AVX2)
// AVX2: 8 elements a step with ta::exp_f32_v8 (exp_f32's bits), the tail as one masked step;
// each formula is the one of the generic kernel below it, op for op (tests compare variants).
template <typename F>
void map8(int64_t n, int threads, F f) {
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    ta::parallel_for(chunks, threads, [&](int64_t c0, int64_t c1) {
        const int64_t e = c1 * kGrain < n ? c1 * kGrain : n;
        int64_t i = c0 * kGrain;
        for (; i + 8 <= e; i += 8) f(i, _mm256_set1_epi32(-1));
        if (i < e) f(i, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(e - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    });
}

inline __m256 neg_abs8(__m256 x) { return _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u))); }

inline __m256 canon8(__m256 y) {
    return _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
}

inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = ta::exp_f32_v8(neg_abs8(x));
    const __m256 nonneg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_div_ps(_mm256_blendv_ps(e, one, nonneg), _mm256_add_ps(one, e));
}

inline __m256 silu8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = ta::exp_f32_v8(neg_abs8(x));
    const __m256 nonneg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_div_ps(_mm256_mul_ps(x, _mm256_blendv_ps(e, one, nonneg)), _mm256_add_ps(one, e));
}
#endif

}  // namespace

// y = ta::exp_f32(x)
TA_EXPORT(void, exp_f32)(const float* x, float* y, int64_t n, int threads) {
#if defined(TA_ISA_AVX2)
    map8(n, threads, [&](int64_t i, __m256i k) {
        _mm256_maskstore_ps(y + i, k, canon8(ta::exp_f32_v8(_mm256_maskload_ps(x + i, k))));
    });
    return;
#endif
#if defined(TA_ISA_AVX512)
    map16(n, threads, [&](int64_t i, __mmask16 k) {
        _mm512_mask_storeu_ps(y + i, k, canon16(ta::exp_f32_v16(_mm512_maskz_loadu_ps(k, x + i))));
    });
    return;
#endif
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(ta::exp_f32(x[i])); });
}

// y = ta::exp2_f32(x)
TA_EXPORT(void, exp2_f32)(const float* x, float* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(ta::exp2_f32(x[i])); });
}

// y = ta::log_f32(x)
TA_EXPORT(void, log_f32)(const float* x, float* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(ta::log_f32(x[i])); });
}

// y = sqrt(x): IEEE's correctly rounded square root (sqrtss / vsqrtps; -fno-math-errno keeps it
// inline). torch.sqrt may go through MKL VML, whose result changes with MKL_CBWR (tested).
TA_EXPORT(void, sqrt_f32)(const float* x, float* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(std::sqrt(x[i])); });
}

// y = sigmoid_f32(x): num / (1 + e), e = exp(-|x|), num = x >= 0 ? 1 : e
TA_EXPORT(void, sigmoid_f32)(const float* x, float* y, int64_t n, int threads) {
#if defined(TA_ISA_AVX2)
    map8(n, threads, [&](int64_t i, __m256i k) {
        _mm256_maskstore_ps(y + i, k, canon8(sigmoid8(_mm256_maskload_ps(x + i, k))));
    });
    return;
#endif
#if defined(TA_ISA_AVX512)
    map16(n, threads, [&](int64_t i, __mmask16 k) {
        _mm512_mask_storeu_ps(y + i, k, canon16(sigmoid16(_mm512_maskz_loadu_ps(k, x + i))));
    });
    return;
#endif
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(sigmoid_f32(x[i])); });
}

// y = (x * num) / (1 + e), e = exp(-|x|), num = x >= 0 ? 1 : e  (x * sigmoid(x), one rounding
// fewer for x >= 0)
TA_EXPORT(void, silu_f32)(const float* x, float* y, int64_t n, int threads) {
#if defined(TA_ISA_AVX2)
    map8(n, threads, [&](int64_t i, __m256i k) {
        _mm256_maskstore_ps(y + i, k, canon8(silu8(_mm256_maskload_ps(x + i, k))));
    });
    return;
#endif
#if defined(TA_ISA_AVX512)
    map16(n, threads, [&](int64_t i, __mmask16 k) {
        _mm512_mask_storeu_ps(y + i, k, canon16(silu16(_mm512_maskz_loadu_ps(k, x + i))));
    });
    return;
#endif
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(silu_one(x[i])); });
}

// silu_mul (forward only; SwiGLU's silu(gate) * up): per row r of m, y[r, j] = silu(g[r, j]) *
// u[r, j] for j < n, g's rows ld_g elements apart, u's ld_u (one fused gate/up matrix: u = g + n).
// silu is silu_f32's formula above, op for op, made canonical, then one IEEE multiply by u: the
// bits of silu_f32 followed by torch's `*`, NaNs canonical. Threads split rows.
TA_EXPORT(void, silu_mul_f32)(const float* g, const float* u, float* y, int64_t m, int64_t n, int64_t ld_g,
                              int64_t ld_u, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *gr = g + r * ld_g, *ur = u + r * ld_u;
            float* yr = y + r * n;
            int64_t j = 0;
#if defined(TA_ISA_AVX2)
            for (; j < n; j += 8) {
                const __m256i k = j + 8 <= n ? _mm256_set1_epi32(-1)
                                             : _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)),
                                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                const __m256 s = canon8(silu8(_mm256_maskload_ps(gr + j, k)));
                _mm256_maskstore_ps(yr + j, k, canon8(_mm256_mul_ps(s, _mm256_maskload_ps(ur + j, k))));
            }
#endif
#if defined(TA_ISA_AVX512)
            for (; j < n; j += 16) {
                const __mmask16 k = j + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
                const __m512 s = canon16(silu16(_mm512_maskz_loadu_ps(k, gr + j)));
                _mm512_mask_storeu_ps(yr + j, k, canon16(_mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, ur + j))));
            }
#endif
            for (; j < n; ++j) yr[j] = ta::canon_nan_f32(ta::canon_nan_f32(silu_one(gr[j])) * ur[j]);
        }
    });
}

// silu_mul backward (SwiGLU's y = silu(g) * u, the gradient of that product as autograd takes it
// through the two ops): per element, with s = silu(g) (silu_f32's bits, canonical),
//   du = dy * s;  dg = (dy * u) * (sg * fma(g, 1 - sg, 1)), sg = sigmoid(g)
// (the multiply's backward, then silu_backward_f32 op for op); NaNs canonical. g's rows are ld_g
// elements apart, u's ld_u; dy, dg and du are contiguous [m, n]. Threads split rows.
TA_EXPORT(void, silu_mul_backward_f32)(const float* dy, const float* g, const float* u, float* dg, float* du,
                                       int64_t m, int64_t n, int64_t ld_g, int64_t ld_u, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *gr = g + r * ld_g, *ur = u + r * ld_u, *dyr = dy + r * n;
            float *dgr = dg + r * n, *dur = du + r * n;
            int64_t j = 0;
#if defined(TA_ISA_AVX2)
            const __m256 one = _mm256_set1_ps(1.0f);
            for (; j < n; j += 8) {
                const __m256i k = j + 8 <= n ? _mm256_set1_epi32(-1)
                                             : _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)),
                                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                const __m256 x = _mm256_maskload_ps(gr + j, k), d = _mm256_maskload_ps(dyr + j, k);
                const __m256 s = canon8(silu8(x)), sg = sigmoid8(x);  // the compiler shares their exp
                _mm256_maskstore_ps(dur + j, k, canon8(_mm256_mul_ps(d, s)));
                const __m256 t = _mm256_fmadd_ps(x, _mm256_sub_ps(one, sg), one);
                const __m256 gs = _mm256_mul_ps(d, _mm256_maskload_ps(ur + j, k));
                _mm256_maskstore_ps(dgr + j, k, canon8(_mm256_mul_ps(gs, _mm256_mul_ps(sg, t))));
            }
#endif
#if defined(TA_ISA_AVX512)
            const __m512 one = _mm512_set1_ps(1.0f);
            for (; j < n; j += 16) {
                const __mmask16 k = j + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
                const __m512 x = _mm512_maskz_loadu_ps(k, gr + j), d = _mm512_maskz_loadu_ps(k, dyr + j);
                const __m512 s = canon16(silu16(x)), sg = sigmoid16(x);  // the compiler shares their exp
                _mm512_mask_storeu_ps(dur + j, k, canon16(_mm512_mul_ps(d, s)));
                const __m512 t = _mm512_fmadd_ps(x, _mm512_sub_ps(one, sg), one);
                const __m512 gs = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(k, ur + j));
                _mm512_mask_storeu_ps(dgr + j, k, canon16(_mm512_mul_ps(gs, _mm512_mul_ps(sg, t))));
            }
#endif
            for (; j < n; ++j) {
                const float x = gr[j], s = ta::canon_nan_f32(silu_one(x)), sg = sigmoid_f32(x);
                dur[j] = ta::canon_nan_f32(dyr[j] * s);
                dgr[j] = ta::canon_nan_f32((dyr[j] * ur[j]) * (sg * std::fma(x, 1.0f - sg, 1.0f)));
            }
        }
    });
}

// d sigmoid from its output y: gx = g * (y * (1 - y))
TA_EXPORT(void, sigmoid_backward_f32)(const float* g, const float* y, float* gx, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { gx[i] = ta::canon_nan_f32(g[i] * (y[i] * (1.0f - y[i]))); });
}

// d silu: s = sigmoid_f32(x); gx = g * (s * fma(x, 1 - s, 1))
TA_EXPORT(void, silu_backward_f32)(const float* g, const float* x, float* gx, int64_t n, int threads) {
#if defined(TA_ISA_AVX2)
    map8(n, threads, [&](int64_t i, __m256i k) {
        const __m256 v = _mm256_maskload_ps(x + i, k), gv = _mm256_maskload_ps(g + i, k);
        const __m256 one = _mm256_set1_ps(1.0f), sv = sigmoid8(v);
        const __m256 t = _mm256_fmadd_ps(v, _mm256_sub_ps(one, sv), one);
        _mm256_maskstore_ps(gx + i, k, canon8(_mm256_mul_ps(gv, _mm256_mul_ps(sv, t))));
    });
    return;
#endif
#if defined(TA_ISA_AVX512)
    map16(n, threads, [&](int64_t i, __mmask16 k) {
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i), gv = _mm512_maskz_loadu_ps(k, g + i);
        const __m512 one = _mm512_set1_ps(1.0f), sv = sigmoid16(v);
        const __m512 t = _mm512_fmadd_ps(v, _mm512_sub_ps(one, sv), one);
        _mm512_mask_storeu_ps(gx + i, k, canon16(_mm512_mul_ps(gv, _mm512_mul_ps(sv, t))));
    });
    return;
#endif
    map(n, threads, [&](int64_t i) {
        const float s = sigmoid_f32(x[i]);
        gx[i] = ta::canon_nan_f32(g[i] * (s * std::fma(x[i], 1.0f - s, 1.0f)));
    });
}

// ---------------------------------------------------------------- float64
// Why the bits are the same everywhere: each element is ta::exp_f64 / ta::log_f64 (ta_math.h: a
// fixed sequence of IEEE adds, multiplies, explicit fmas, one division for log, integer bit
// operations and selects; no libm call, no table, no branch on the value) or the correctly
// rounded IEEE sqrt, then the canonical NaN. Accuracy (ta_math.h): exp 0.89 ulp, log 2.85 ulp,
// sqrt 0.5 ulp (correctly rounded).

// y = ta::exp_f64(x)
TA_EXPORT(void, exp_f64)(const double* x, double* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f64(ta::exp_f64(x[i])); });
}

// y = ta::log_f64(x)
TA_EXPORT(void, log_f64)(const double* x, double* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f64(ta::log_f64(x[i])); });
}

// y = sqrt(x): IEEE's correctly rounded square root (sqrtsd / vsqrtpd / fsqrt; -fno-math-errno
// keeps it inline); sqrt(-0) = -0, sqrt(x < 0) = NaN (canonical).
TA_EXPORT(void, sqrt_f64)(const double* x, double* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f64(std::sqrt(x[i])); });
}
