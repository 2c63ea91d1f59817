// random.cpp: normal samples from given random bits, the same bits on every CPU and ISA.
//
// torch's `normal_` runs a vectorised Box-Muller whose log/cos approximations depend on the ISA
// ATen dispatches to (ATEN_CPU_CAPABILITY=default gives other bits than avx2/avx512), so weight
// init from a seed would depend on the CPU. Here the caller supplies the random bits (numpy's
// Philox: integer arithmetic, platform independent) and every sample is a fixed sequence of
// IEEE float32 operations:
//   u1 = (b0 >> 8) + 1) * 2^-24 in (0, 1], u2 = (b1 >> 8) * 2^-24 in [0, 1)   (exact)
//   r = sqrt(-2 * log(u1))                        (ta::log_f32, correctly rounded sqrt)
//   z0 = r * cos(2 pi u2), z1 = r * sin(2 pi u2)  (cos_sin_2pi below)
//   out = z * std + mean                          (separate multiply and add)
// A pair of 32-bit words gives a pair of samples (out[2i], out[2i+1]).
#include "ta_common.h"
#include "ta_math.h"

namespace {

// cos(2 pi t), sin(2 pi t) for t in [0, 1). Order: k = rint(4t), f = 4t - k in [-1/2, 1/2]
// (both exact), x = f * (pi/2), Taylor polynomials for sin x (degree 9) and cos x (degree 8)
// by Horner in x^2 with fma, then the quadrant k by selects.
inline void cos_sin_2pi(float t, float* c_out, float* s_out) {
    float t4 = t * 4.0f;
    float k = (t4 + ta::kRoundMagic) - ta::kRoundMagic;
    float f = t4 - k;
    float x = f * 1.57079632679489662f;
    float z = x * x;
    float s = 2.7557319223985893e-06f;           // 1/9!  (sin x = x - x^3/3! + ... + x^9/9!)
    s = std::fma(s, z, -1.9841269841269841e-04f);  // -1/7!
    s = std::fma(s, z, 8.3333333333333333e-03f);   // 1/5!
    s = std::fma(s, z, -1.6666666666666667e-01f);  // -1/3!
    s = std::fma(s, z, 1.0f);
    s = s * x;
    float c = 2.4801587301587302e-05f;           // 1/8!
    c = std::fma(c, z, -1.3888888888888889e-03f);  // -1/6!
    c = std::fma(c, z, 4.1666666666666667e-02f);   // 1/4!
    c = std::fma(c, z, -0.5f);
    c = std::fma(c, z, 1.0f);
    int q = ((int)k) & 3;
    float cq = q == 0 ? c : (q == 1 ? -s : (q == 2 ? -c : s));
    float sq = q == 0 ? s : (q == 1 ? c : (q == 2 ? -s : -c));
    *c_out = cq;
    *s_out = sq;
}

}  // namespace

// out[0 .. 2*pairs) ~ N(mean, std^2) from bits[0 .. 2*pairs) (see the file comment).
TA_EXPORT(void, normal_from_bits)(const uint32_t* bits, float* out, int64_t pairs, float mean, float stddev) {
    for (int64_t i = 0; i < pairs; ++i) {
        float u1 = (float)((bits[2 * i] >> 8) + 1u) * 5.9604644775390625e-08f;  // 2^-24
        float u2 = (float)(bits[2 * i + 1] >> 8) * 5.9604644775390625e-08f;
        float r = std::sqrt(-2.0f * ta::log_f32(u1));
        float c, s;
        cos_sin_2pi(u2, &c, &s);
        out[2 * i] = (r * c) * stddev + mean;
        out[2 * i + 1] = (r * s) * stddev + mean;
    }
}
