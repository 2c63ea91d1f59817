// optim.cpp: the AdamW update of one float32 parameter (trainer/optim.py's PortableAdamW), fused:
// one pass over memory in place of ~10 full-tensor torch ops, each its own allocation and pass.
//
// Guarantee: every element runs the fixed sequence of correctly rounded IEEE float32 operations
// below, which is op for op what PortableAdamW's torch path computes (each torch op with a Python
// scalar first rounds the scalar to float32, static_cast<float>, and `add_` with alpha 1 is a plain
// add: fma(b, 1, a) rounds once, exactly like a + b), so the bits equal that path's wherever the
// element sits, whatever the length, the thread count or the ISA variant (the vector loops the
// compiler makes run the same operations per lane; -ffp-contract=off: no fused multiply-add).
// The scalars are the Python doubles of that path, rounded to float32 here:
//   p = p * f(1 - lr*wd)
//   m = m * f(b1) + g * f(1 - b1)
//   v = v * f(b2) + (g * g) * f(1 - b2)
//   s = canon_nan(sqrt(v))                 (pointwise.sqrt's kernel: the one quiet NaN 0x7fc00000)
//   p = p + (m / (s / f(sqrt(1 - b2^t)) + f(eps))) * f(-lr / (1 - b1^t))
// An op whose two operands are both NaN may return either one's payload (the compiler may swap
// operands), as the torch path's vector and scalar loops may: bits are pinned for inputs without
// NaN (infinities and subnormals included); a NaN input still gives NaN.
#include "ta_common.h"
#include "ta_math.h"

namespace {

// Elements per thread below which one thread does the whole buffer (never changes bits).
constexpr int64_t kGrain = 1 << 15;

void adamw_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                 int64_t begin, int64_t end, float decay, float b1, float c1, float b2, float c2, float bc2_sqrt,
                 float eps, float step_size) {
    for (int64_t i = begin; i < end; ++i) {
        const float gi = g[i];
        const float pi = p[i] * decay;
        const float mi = m[i] * b1 + gi * c1;
        const float vi = v[i] * b2 + (gi * gi) * c2;
        const float denom = ta::canon_nan_f32(std::sqrt(vi)) / bc2_sqrt + eps;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi + (mi / denom) * step_size;
    }
}

}  // namespace

// In place over n contiguous elements of p (param), m (exp_avg), v (exp_avg_sq); g (grad) is read.
// The scalars (doubles, as Python computed them) are rounded to float32 once, as torch does:
// decay = 1 - lr*wd, c1 = 1 - b1, c2 = 1 - b2, bc2_sqrt = sqrt(1 - b2^t), step_size = -lr / (1 - b1^t).
TA_EXPORT(void, adamw_step_f32)(float* p, const float* g, float* m, float* v, int64_t n, double decay, double b1,
                                double c1, double b2, double c2, double bc2_sqrt, double eps, double step_size,
                                int threads) {
    const float f_decay = (float)decay, f_b1 = (float)b1, f_c1 = (float)c1, f_b2 = (float)b2, f_c2 = (float)c2;
    const float f_bc2 = (float)bc2_sqrt, f_eps = (float)eps, f_step = (float)step_size;
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    ta::parallel_for(chunks, threads, [&](int64_t c0, int64_t c1_) {
        const int64_t e = c1_ * kGrain < n ? c1_ * kGrain : n;
        adamw_range(p, g, m, v, c0 * kGrain, e, f_decay, f_b1, f_c1, f_b2, f_c2, f_bc2, f_eps, f_step);
    });
}
