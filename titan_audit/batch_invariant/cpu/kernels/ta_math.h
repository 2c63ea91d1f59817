// ta_math.h: exp, exp2 and log in float32 by our own polynomials, the same bits on every ISA.
//
// Each function is a fixed sequence of IEEE-754 adds, multiplies, fmas, one division (log) and
// integer bit operations, with no table, no libm call and no data-dependent branch (selects
// only), so a loop over them auto-vectorises and every variant (scalar, avx2, avx512) rounds
// each step the same way. Round-to-nearest-integer is the 1.5 * 2^23 add/subtract trick
// (exact for |v| < 2^22), not nearbyint, so it is the same instruction sequence everywhere.
// Accuracy against a float64 reference: exp/exp2 within 1 ulp, log within 3 ulp (measured
// 0.91 / 0.87 / 2.81 ulp; tests/batch_invariant/test_math.py).
// Special values: exp(-inf) = exp2(-inf) = 0, exp2(0) = exp(0) = 1 exactly, +inf -> +inf,
// NaN -> NaN; log(0) = -inf, log(x < 0) = NaN, log(+inf) = +inf, subnormal inputs handled.
// exp_f64 / log_f64: the same constructions in float64 (the float64 row ops, attention, RoPE
// frequencies and the pointwise exp_f64 / log_f64 kernels). Accuracy against a long-double
// (64-bit mantissa) expl / logl reference, measured on 2e7 random inputs over the whole range plus
// 3e6 in each hard region (subnormal and near-overflow results, |x| < 1e-5, log near 1, sqrt 2,
// 1/sqrt 2, subnormal inputs): exp_f64 0.90 ulp (worst in the subnormal-result range), log_f64
// 2.93 ulp (worst just above 1, from the rounding of s = f / (2 + f)); tested in
// tests/batch_invariant/test_math_f64.py. Special values as for float32 (exp: clamp to
// [-746, 710], so -inf -> +0 and +inf -> +inf; log: subnormal inputs scaled by 2^52).
// exp_f32_v16 (AVX-512) and exp_f32_v8 (AVX2): exp_f32 on a vector, the same bits lane by lane
// in fewer instructions (max/min clamps, round_ps, scalef or a one-multiply 2^n); use them in
// hand-written vector loops (rowops.cpp, pointwise.cpp do).
// NaN bits: a NaN *result's* sign and payload are not fixed by IEEE (x86 keeps the first
// operand's NaN, and the compiler may order a commutative op's operands differently in each
// variant: the tests found exp(NaN) differing between the scalar and avx2 objects), so a kernel
// whose output may be NaN stores canon_nan_f32(y) (the one quiet NaN 0x7fc00000).
// Change log (names and bits of the float32 scalar functions are unchanged since the
// coordinator's version; K2's attention relies on ta::exp2_f32 / ta::exp_f32): K3 added
// exp_f64, log_f64, select_f32/f64 (bit selects in place of ?: so that AVX2 loops vectorise;
// same values), canon_nan_f32/f64, exp_f32_v16, exp_f32_v8.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ta {

static inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// c ? a : b as a bit select. Both arms are always computed: with a plain ?: GCC (trapping math
// on) will not if-convert a branch holding float arithmetic, and the loop stays scalar on AVX2.
// The value is that of ?: exactly.
static inline float select_f32(bool c, float a, float b) {
    uint32_t m = 0u - (uint32_t)c;
    return bits_to_f32((f32_to_bits(a) & m) | (f32_to_bits(b) & ~m));
}

// Any NaN becomes the one quiet NaN 0x7fc00000; every other value is unchanged.
static inline float canon_nan_f32(float y) { return select_f32(y != y, bits_to_f32(0x7fc00000u), y); }

static constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: v + magic - magic == rint(v)

// 2^n for an integer-valued float n in [-252, 254], as two normal factors (so a subnormal
// result is rounded once, by the second multiply).
static inline float scale_pow2(float p, float n) {
    int32_t ni = (int32_t)n;
    int32_t n1 = ni >> 1;  // arithmetic shift: floor(n / 2)
    int32_t n2 = ni - n1;
    float s1 = bits_to_f32((uint32_t)(n1 + 127) << 23);
    float s2 = bits_to_f32((uint32_t)(n2 + 127) << 23);
    return (p * s1) * s2;
}

// 2^f for |f| <= 0.5: Taylor series of e^(f ln2) to degree 7 (truncation < 1e-8 relative),
// Horner with fma. Coefficients c_k = ln2^k / k!, rounded to float.
static inline float exp2_poly(float f) {
    float p = 1.5252733804059841e-05f;            // ln2^7 / 7!
    p = std::fma(p, f, 1.5403530393381609e-04f);  // ln2^6 / 6!
    p = std::fma(p, f, 1.3333558146428443e-03f);  // ln2^5 / 5!
    p = std::fma(p, f, 9.6181291076284772e-03f);  // ln2^4 / 4!
    p = std::fma(p, f, 5.5504108664821580e-02f);  // ln2^3 / 3!
    p = std::fma(p, f, 2.4022650695910071e-01f);  // ln2^2 / 2!
    p = std::fma(p, f, 6.9314718055994531e-01f);  // ln2
    p = std::fma(p, f, 1.0f);
    return p;
}

// e^r for |r| <= ln2 / 2: Taylor series to degree 7, Horner with fma.
static inline float exp_poly(float r) {
    float p = 1.9841269841269841e-04f;            // 1/7!
    p = std::fma(p, r, 1.3888888888888889e-03f);  // 1/6!
    p = std::fma(p, r, 8.3333333333333333e-03f);  // 1/5!
    p = std::fma(p, r, 4.1666666666666667e-02f);  // 1/4!
    p = std::fma(p, r, 1.6666666666666667e-01f);  // 1/3!
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    return p;
}

// 2^x. Order: clamp to [-160, 128] (NaN passes), n = rint(x), f = x - n (exact), 2^f by
// exp2_poly, times 2^n.
static inline float exp2_f32(float x) {
    x = select_f32(x < -160.0f, -160.0f, x);
    x = select_f32(x > 128.0f, 128.0f, x);
    float n = (x + kRoundMagic) - kRoundMagic;
    float f = x - n;
    return scale_pow2(exp2_poly(f), n);
}

// e^x. Order: clamp to [-110, 89] (NaN passes), n = rint(x * log2e), r = x - n ln2 in two
// fma steps (Cody-Waite, ln2 = hi + lo), e^r by exp_poly, times 2^n.
static inline float exp_f32(float x) {
    x = select_f32(x < -110.0f, -110.0f, x);
    x = select_f32(x > 89.0f, 89.0f, x);
    float n = (x * 1.4426950408889634f + kRoundMagic) - kRoundMagic;
    float r = std::fma(-n, 6.93145752e-01f, x);     // ln2 hi (exact in 16 bits)
    r = std::fma(-n, 1.42860677e-06f, r);           // ln2 lo
    return scale_pow2(exp_poly(r), n);
}

// natural log. Order: subnormals scaled by 2^23; x = m * 2^e with m in [sqrt(1/2), sqrt(2));
// f = m - 1, s = f / (2 + f); log(1 + f) = 2s + 2s^3/3 + ... + 2s^9/9 (Horner in s^2);
// result = e * ln2_hi + (e * ln2_lo + log(1 + f)); then the special values by selects.
static inline float log_f32(float x) {
    bool sub = x < 1.17549435e-38f;  // also true for 0, negatives (fixed up below)
    float xs = select_f32(sub, x * 8388608.0f, x);
    float eadj = select_f32(sub, -23.0f, 0.0f);
    uint32_t u = f32_to_bits(xs);
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127;
    float m = bits_to_f32((u & 0x007fffffu) | 0x3f800000u);
    bool big = m > 1.41421356f;
    m = select_f32(big, m * 0.5f, m);
    float ef = (float)(e + (big ? 1 : 0)) + eadj;
    float f = m - 1.0f;
    float s = f / (2.0f + f);
    float z = s * s;
    float p = 2.0f / 9.0f;
    p = std::fma(p, z, 2.0f / 7.0f);
    p = std::fma(p, z, 2.0f / 5.0f);
    p = std::fma(p, z, 2.0f / 3.0f);
    p = std::fma(p, z, 2.0f);
    float logm = p * s;
    float r = std::fma(ef, 6.93145752e-01f, std::fma(ef, 1.42860677e-06f, logm));
    const float inf = bits_to_f32(0x7f800000u), qnan = bits_to_f32(0x7fc00000u);
    r = select_f32(x == 0.0f, -inf, r);
    r = select_f32(x < 0.0f, qnan, r);
    r = select_f32(x == inf, inf, r);
    r = select_f32(x != x, x, r);
    return r;
}

#if defined(TA_ISA_AVX512)
// exp_f32 on 16 lanes in AVX-512, the same bits as exp_f32 lane by lane (tests compare every
// variant against the scalar one), in fewer instructions:
//   select(x < -110, -110, x)     == max_ps(-110, x)   (MAXPS(a, b) = a > b ? a : b; NaN -> b)
//   select(x > 89, 89, x)         == min_ps(89, x)
//   (v + 1.5*2^23) - 1.5*2^23     == roundscale(v, nearest-even) for |v| < 2^22 (a zero's sign
//                                    may differ; n = +-0 gives r = x - 0 and 2^0 alike)
//   scale_pow2(p, n) = (p*2^n1)*2^n2 (p*2^n1 exact) == scalef(p, n): both round p*2^n once.
// (The all-lanes maskz_ forms avoid GCC 12's false -Wmaybe-uninitialized on the plain ones.)
static inline __m512 exp_f32_v16(__m512 x) {
    const __mmask16 all = 0xffff;
    x = _mm512_maskz_max_ps(all, _mm512_set1_ps(-110.0f), x);
    x = _mm512_maskz_min_ps(all, _mm512_set1_ps(89.0f), x);
    const __m512 n = _mm512_maskz_roundscale_ps(all, _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(6.93145752e-01f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(1.9841269841269841e-04f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3888888888888889e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333333333333e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666666666666667e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666666666666667e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(all, p, n);
}
#endif

#if defined(TA_ISA_AVX2)
// exp_f32 on 8 lanes in AVX2, the same bits as exp_f32 lane by lane (tested against the scalar
// variant): clamps by max_ps / min_ps and rint by round_ps as in exp_f32_v16; 2^n by one
// multiply when every lane has n in [-126, 127] (2^n a normal float: p * 2^n is then rounded
// once, as scale_pow2's two factors round it once), else by scale_pow2's two factors.
static inline __m256 exp_f32_v8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-110.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(6.93145752e-01f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-06f), r);
    __m256 p = _mm256_set1_ps(1.9841269841269841e-04f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3888888888888889e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333333333333e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666666666666667e-02f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666666666666667e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvttps_epi32(n);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 in_range = _mm256_and_ps(_mm256_cmp_ps(n, _mm256_set1_ps(-126.0f), _CMP_GE_OQ),
                                          _mm256_cmp_ps(n, _mm256_set1_ps(127.0f), _CMP_LE_OQ));
    if (_mm256_movemask_ps(in_range) == 0xff)
        return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, bias), 23)));
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

// ---------------------------------------------------------------- float64

static inline double bits_to_f64(uint64_t u) { double f; std::memcpy(&f, &u, 8); return f; }
static inline uint64_t f64_to_bits(double f) { uint64_t u; std::memcpy(&u, &f, 8); return u; }

static inline double select_f64(bool c, double a, double b) {
    uint64_t m = 0ull - (uint64_t)c;
    return bits_to_f64((f64_to_bits(a) & m) | (f64_to_bits(b) & ~m));
}

static inline double canon_nan_f64(double y) { return select_f64(y != y, bits_to_f64(0x7ff8000000000000ull), y); }

static constexpr double kRoundMagic64 = 6755399441055744.0;  // 1.5 * 2^52

// 2^n for an integer-valued double n in [-1076, 1026], as two normal factors.
static inline double scale_pow2_f64(double p, double n) {
    int64_t ni = (int64_t)n;
    int64_t n1 = ni >> 1;
    int64_t n2 = ni - n1;
    double s1 = bits_to_f64((uint64_t)(n1 + 1023) << 52);
    double s2 = bits_to_f64((uint64_t)(n2 + 1023) << 52);
    return (p * s1) * s2;
}

// e^x in float64. Order: clamp to [-746, 710] (NaN passes), n = rint(x * log2e),
// r = x - n ln2 in two fma steps (fdlibm's ln2 hi/lo), e^r by its Taylor series to degree 13
// (Horner with fma; truncation < 1e-17 relative on |r| <= ln2/2), times 2^n.
static inline double exp_f64(double x) {
    x = select_f64(x < -746.0, -746.0, x);
    x = select_f64(x > 710.0, 710.0, x);
    double n = (x * 1.4426950408889634 + kRoundMagic64) - kRoundMagic64;
    double r = std::fma(-n, 6.93147180369123816490e-01, x);  // ln2 hi (low 32 bits zero)
    r = std::fma(-n, 1.90821492927058770002e-10, r);         // ln2 lo
    double p = 1.0 / 6227020800.0;                            // 1/13!
    p = std::fma(p, r, 1.0 / 479001600.0);
    p = std::fma(p, r, 1.0 / 39916800.0);
    p = std::fma(p, r, 1.0 / 3628800.0);
    p = std::fma(p, r, 1.0 / 362880.0);
    p = std::fma(p, r, 1.0 / 40320.0);
    p = std::fma(p, r, 1.0 / 5040.0);
    p = std::fma(p, r, 1.0 / 720.0);
    p = std::fma(p, r, 1.0 / 120.0);
    p = std::fma(p, r, 1.0 / 24.0);
    p = std::fma(p, r, 1.0 / 6.0);
    p = std::fma(p, r, 0.5);
    p = std::fma(p, r, 1.0);
    p = std::fma(p, r, 1.0);
    return scale_pow2_f64(p, n);
}

// natural log in float64: log_f32's construction, series 2s + 2s^3/3 + ... + 2s^21/21.
static inline double log_f64(double x) {
    bool sub = x < 2.2250738585072014e-308;
    double xs = select_f64(sub, x * 4503599627370496.0, x);  // 2^52
    double eadj = select_f64(sub, -52.0, 0.0);
    uint64_t u = f64_to_bits(xs);
    int64_t e = (int64_t)((u >> 52) & 0x7ff) - 1023;
    double m = bits_to_f64((u & 0x000fffffffffffffull) | 0x3ff0000000000000ull);
    bool big = m > 1.4142135623730951;
    m = select_f64(big, m * 0.5, m);
    double ef = (double)(e + (big ? 1 : 0)) + eadj;
    double f = m - 1.0;
    double s = f / (2.0 + f);
    double z = s * s;
    double p = 2.0 / 21.0;
    p = std::fma(p, z, 2.0 / 19.0);
    p = std::fma(p, z, 2.0 / 17.0);
    p = std::fma(p, z, 2.0 / 15.0);
    p = std::fma(p, z, 2.0 / 13.0);
    p = std::fma(p, z, 2.0 / 11.0);
    p = std::fma(p, z, 2.0 / 9.0);
    p = std::fma(p, z, 2.0 / 7.0);
    p = std::fma(p, z, 2.0 / 5.0);
    p = std::fma(p, z, 2.0 / 3.0);
    p = std::fma(p, z, 2.0);
    double logm = p * s;
    double r = std::fma(ef, 6.93147180369123816490e-01, std::fma(ef, 1.90821492927058770002e-10, logm));
    const double inf = bits_to_f64(0x7ff0000000000000ull), qnan = bits_to_f64(0x7ff8000000000000ull);
    r = select_f64(x == 0.0, -inf, r);
    r = select_f64(x < 0.0, qnan, r);
    r = select_f64(x == inf, inf, r);
    r = select_f64(x != x, x, r);
    return r;
}

}  // namespace ta
