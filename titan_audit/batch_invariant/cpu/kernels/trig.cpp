// trig.cpp: cos and sin of float32 angles (the RoPE tables), the same bits on every CPU and ISA.
//
// torch.cos / torch.sin run Sleef or MKL VML depending on ATEN_CPU_CAPABILITY and MKL_CBWR, and
// a large table (qwen3's 40960 x 128 angles) gets other bits under either knob (tested). Here
// every element is a fixed sequence of IEEE float64 operations, rounded once to float32:
//   t = a * (1 / 2pi); t = t - floor(t)            (t in [0, 1); floor is exact)
//   k = rint(4t) (the 1.5 * 2^52 add/subtract), f = 4t - k in [-1/2, 1/2] (exact), x = f * pi/2
//   sin x, cos x: Taylor polynomials to x^15 / x^16 by Horner in x^2 with fma (|x| <= pi/4,
//   truncation < 1e-16), then the quadrant k by selects.
// Accuracy: within 1 ulp of float32 for |a| < 2^16 (tested against float64 numpy).
// A NaN or infinite angle gives the canonical NaN 0x7fc00000 for both (ta::canon_nan_f32).
#include "ta_common.h"
#include "ta_math.h"

namespace {

inline void cos_sin(float a, float* c_out, float* s_out) {
    const double magic = 6755399441055744.0;  // 1.5 * 2^52
    double t = (double)a * 0.15915494309189535;  // 1 / (2 pi)
    t = t - std::floor(t);
    double t4 = t * 4.0;
    double k = (t4 + magic) - magic;
    double f = t4 - k;
    double x = f * 1.5707963267948966;
    double z = x * x;
    double s = -7.6471637318198164759e-13;             // -1/15!
    s = std::fma(s, z, 1.6059043836821614599e-10);     // 1/13!
    s = std::fma(s, z, -2.5052108385441718775e-08);    // -1/11!
    s = std::fma(s, z, 2.7557319223985890653e-06);     // 1/9!
    s = std::fma(s, z, -1.9841269841269841270e-04);    // -1/7!
    s = std::fma(s, z, 8.3333333333333333333e-03);     // 1/5!
    s = std::fma(s, z, -1.6666666666666666667e-01);    // -1/3!
    s = x + x * (z * s);                               // sin x = x - x^3/3! + ... - x^15/15!
    double c = 4.7794773323873852974e-14;              // 1/16!
    c = std::fma(c, z, -1.1470745597729724714e-11);    // -1/14!
    c = std::fma(c, z, 2.0876756987868098979e-09);     // 1/12!
    c = std::fma(c, z, -2.7557319223985890653e-07);    // -1/10!
    c = std::fma(c, z, 2.4801587301587301587e-05);     // 1/8!
    c = std::fma(c, z, -1.3888888888888888889e-03);    // -1/6!
    c = std::fma(c, z, 4.1666666666666666667e-02);     // 1/4!
    c = std::fma(c, z, -0.5);
    c = std::fma(c, z, 1.0);
    int q = ((int)k) & 3;
    double cq = q == 0 ? c : (q == 1 ? -s : (q == 2 ? -c : s));
    double sq = q == 0 ? s : (q == 1 ? c : (q == 2 ? -s : -c));
    *c_out = ta::canon_nan_f32((float)cq);  // a NaN or infinite angle: the one quiet NaN (x86 makes
    *s_out = ta::canon_nan_f32((float)sq);  // inf - inf negative, arm64 positive)
}

}  // namespace

// cos[i], sin[i] of angle[i] for i < n (see the file comment); threads split the elements.
TA_EXPORT(void, cos_sin_f32)(const float* angle, float* cos_out, float* sin_out, int64_t n, int threads) {
    ta::parallel_for(n, threads, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) cos_sin(angle[i], cos_out + i, sin_out + i);
    });
}

// RoPE inverse frequencies: out[i] = (float)(1 / theta^(2i / head_dim)) for i < head_dim / 2,
// the power as ta::exp_f64(ta::log_f64(theta) * (2i / head_dim)) in float64 (torch.pow's bits
// follow ATEN_CPU_CAPABILITY), rounded once.
TA_EXPORT(void, rope_inv_freq_f32)(double theta, int64_t head_dim, float* out) {
    const double log_theta = ta::log_f64(theta);
    for (int64_t i = 0; i < head_dim / 2; ++i) {
        out[i] = (float)(1.0 / ta::exp_f64(log_theta * ((double)(2 * i) / (double)head_dim)));
    }
}
