// ta_math.h: exp, exp2 and log in float32 by our own polynomials, the same bits on every ISA.
//
// Each function is a fixed sequence of IEEE-754 adds, multiplies, fmas, one division (log) and
// integer bit operations, with no table, no libm call and no data-dependent branch (selects
// only), so a loop over them auto-vectorises and every variant (scalar, avx2, avx512) rounds
// each step the same way. Round-to-nearest-integer is the 1.5 * 2^23 add/subtract trick
// (exact for |v| < 2^22), not nearbyint, so it is the same instruction sequence everywhere.
// Accuracy against a float64 reference: exp/exp2 within 2 ulp, log within 3 ulp (tested).
// Special values: exp(-inf) = exp2(-inf) = 0, exp2(0) = exp(0) = 1 exactly, +inf -> +inf,
// NaN -> NaN; log(0) = -inf, log(x < 0) = NaN, log(+inf) = +inf, subnormal inputs handled.
#pragma once

#include <cstdint>
#include <cstring>

namespace ta {

static inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

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
    x = x < -160.0f ? -160.0f : x;
    x = x > 128.0f ? 128.0f : x;
    float n = (x + kRoundMagic) - kRoundMagic;
    float f = x - n;
    return scale_pow2(exp2_poly(f), n);
}

// e^x. Order: clamp to [-110, 89] (NaN passes), n = rint(x * log2e), r = x - n ln2 in two
// fma steps (Cody-Waite, ln2 = hi + lo), e^r by exp_poly, times 2^n.
static inline float exp_f32(float x) {
    x = x < -110.0f ? -110.0f : x;
    x = x > 89.0f ? 89.0f : x;
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
    float xs = sub ? x * 8388608.0f : x;
    float eadj = sub ? -23.0f : 0.0f;
    uint32_t u = f32_to_bits(xs);
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127;
    float m = bits_to_f32((u & 0x007fffffu) | 0x3f800000u);
    bool big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
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
    r = x == 0.0f ? -inf : r;
    r = x < 0.0f ? qnan : r;
    r = x == inf ? inf : r;
    r = x != x ? x : r;
    return r;
}

}  // namespace ta
