// pointwise.cpp: element-wise exp, exp2, log, sigmoid, silu and the backward of sigmoid and
// silu, float32, over contiguous buffers.
//
// Guarantee: an element's bits are a function of its value alone (and its gradient's), the
// same on every ISA variant and wherever the element sits in its buffer: each element runs the
// one fixed sequence written next to its kernel (ta_math.h's polynomials and correctly rounded
// IEEE operations; no tail path, no table, no libm call), and threads only split the buffer.
// Every NaN result is stored as the one quiet NaN 0x7fc00000 (ta::canon_nan_f32).
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

}  // namespace

// y = ta::exp_f32(x)
TA_EXPORT(void, exp_f32)(const float* x, float* y, int64_t n, int threads) {
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

// y = sigmoid_f32(x): num / (1 + e), e = exp(-|x|), num = x >= 0 ? 1 : e
TA_EXPORT(void, sigmoid_f32)(const float* x, float* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { y[i] = ta::canon_nan_f32(sigmoid_f32(x[i])); });
}

// y = (x * num) / (1 + e), e = exp(-|x|), num = x >= 0 ? 1 : e  (x * sigmoid(x), one rounding
// fewer for x >= 0)
TA_EXPORT(void, silu_f32)(const float* x, float* y, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) {
        const float e = exp_neg_abs(x[i]);
        y[i] = ta::canon_nan_f32((x[i] * ta::select_f32(x[i] >= 0.0f, 1.0f, e)) / (1.0f + e));
    });
}

// d sigmoid from its output y: gx = g * (y * (1 - y))
TA_EXPORT(void, sigmoid_backward_f32)(const float* g, const float* y, float* gx, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) { gx[i] = ta::canon_nan_f32(g[i] * (y[i] * (1.0f - y[i]))); });
}

// d silu: s = sigmoid_f32(x); gx = g * (s * fma(x, 1 - s, 1))
TA_EXPORT(void, silu_backward_f32)(const float* g, const float* x, float* gx, int64_t n, int threads) {
    map(n, threads, [&](int64_t i) {
        const float s = sigmoid_f32(x[i]);
        gx[i] = ta::canon_nan_f32(g[i] * (s * std::fma(x[i], 1.0f - s, 1.0f)));
    });
}
