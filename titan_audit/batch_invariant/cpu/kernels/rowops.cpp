// rowops.cpp: row reductions and the fused row ops (sum, sum of squares, softmax, log_softmax,
// rms_norm and their backward, the forward-only residual add + rms_norm and q/k-norm + RoPE) over
// a contiguous [M, N] matrix, float32 and float64; and the same sums down the columns.
//
// Guarantee: every output element is a fixed sequence of IEEE operations on its own row (and the
// shared weight), set by N alone: never by M, the thread count or the ISA variant. How:
//   * A reduction along a row uses TA_LANES (16) logical lanes: lane l starts at -0.0 (the exact
//     additive identity) and accumulates elements l, l+16, l+32, ... in ascending order; the 16
//     lanes are then combined by ta::tree16. The lanes are written as a plain 16-wide inner loop:
//     the compiler holds them in one zmm (avx512), two ymm (avx2) or 16 scalars (scalar), and
//     without fast-math or contraction it may not change a single operation of the loop.
//   * The row max is exact, so its order is free: the select `x > m ? x : m` skips NaN elements
//     (a NaN still reaches every output through the exp sum), and the result gets `+ 0.0`, so a
//     max of zeros is +0.0 whatever their signs and order.
//   * exp is ta::exp_f32 / ta::exp_f64, log ta::log_f32 / ta::log_f64 (ta_math.h), the same
//     bits on every variant; sqrt and division are correctly rounded everywhere.
//   * Every NaN result is stored as the one quiet NaN (ta::canon_nan_f32 / f64): a NaN's sign and
//     payload otherwise depend on operand order, which the compiler picks per variant.
//   * Threads split rows (ta::parallel_for); the reductions over rows (col_sum, rms_norm's weight
//     gradient) are split by columns, each column summing its rows in a fixed order.
#include "ta_common.h"
#include "ta_math.h"

#include <limits>
#include <vector>

namespace {

constexpr int L = TA_LANES;

inline float exp_t(float x) { return ta::exp_f32(x); }
inline double exp_t(double x) { return ta::exp_f64(x); }
inline float log_t(float x) { return ta::log_f32(x); }
inline double log_t(double x) { return ta::log_f64(x); }
inline float canon(float y) { return ta::canon_nan_f32(y); }
inline double canon(double y) { return ta::canon_nan_f64(y); }

template <typename T>
inline T tree16_max(const T* l) {
    T s[8];
    for (int i = 0; i < 8; ++i) s[i] = l[i + 8] > l[i] ? l[i + 8] : l[i];
    for (int i = 0; i < 4; ++i) s[i] = s[i + 4] > s[i] ? s[i + 4] : s[i];
    for (int i = 0; i < 2; ++i) s[i] = s[i + 2] > s[i] ? s[i + 2] : s[i];
    return s[1] > s[0] ? s[1] : s[0];
}

// The term a sum adds for element v: v itself, or its square (rounded, as a materialised x * x).
struct Plain {
    template <typename T>
    T operator()(T v) const { return v; }
};
struct Square {
    template <typename T>
    T operator()(T v) const { return v * v; }
};

// Order: lane l = (((-0 + t(x[l])) + t(x[l+16])) + ...), then ta::tree16 (t: Plain or Square).
template <typename T, typename Term = Plain>
inline T lane_sum(const T* x, int64_t n, Term t = Term()) {
    T acc[L];
    for (int l = 0; l < L; ++l) acc[l] = T(-0.0);
    int64_t i = 0;
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; ++l) acc[l] = acc[l] + t(x[i + l]);
    for (int l = 0; i + l < n; ++l) acc[l] = acc[l] + t(x[i + l]);
    return ta::tree16(acc);
}

// Order: lane l = fma(a[l+16k], b[l+16k], lane l) for k ascending, from -0.0; then ta::tree16.
template <typename T>
inline T lane_dot(const T* a, const T* b, int64_t n) {
    T acc[L];
    for (int l = 0; l < L; ++l) acc[l] = T(-0.0);
    int64_t i = 0;
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
    for (int l = 0; i + l < n; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
    return ta::tree16(acc);
}

// Order: lane l = fma(a*w, b, lane l) over l+16k ascending (a*w rounded first), then ta::tree16.
template <typename T>
inline T lane_dot_scaled(const T* a, const T* w, const T* b, int64_t n) {
    T acc[L];
    for (int l = 0; l < L; ++l) acc[l] = T(-0.0);
    int64_t i = 0;
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; ++l) acc[l] = std::fma(a[i + l] * w[i + l], b[i + l], acc[l]);
    for (int l = 0; i + l < n; ++l) acc[l] = std::fma(a[i + l] * w[i + l], b[i + l], acc[l]);
    return ta::tree16(acc);
}

// The row max. Max is exact, so any order gives the same value: NaN elements are skipped by the
// select `x > m ? x : m`, and `+ 0.0` turns a max of -0.0 into +0.0 whichever zero came first.
// Order (for speed only): 4 x 16 lanes over blocks of 64 from -inf, merged, then tree16_max.
template <typename T>
inline T lane_max(const T* x, int64_t n) {
    T a0[L], a1[L], a2[L], a3[L];
    const T ninf = -std::numeric_limits<T>::infinity();
    for (int l = 0; l < L; ++l) a0[l] = a1[l] = a2[l] = a3[l] = ninf;
    int64_t i = 0;
    for (; i + 4 * L <= n; i += 4 * L)
        for (int l = 0; l < L; ++l) {
            a0[l] = x[i + l] > a0[l] ? x[i + l] : a0[l];
            a1[l] = x[i + L + l] > a1[l] ? x[i + L + l] : a1[l];
            a2[l] = x[i + 2 * L + l] > a2[l] ? x[i + 2 * L + l] : a2[l];
            a3[l] = x[i + 3 * L + l] > a3[l] ? x[i + 3 * L + l] : a3[l];
        }
    for (; i < n; ++i) a0[i % L] = x[i] > a0[i % L] ? x[i] : a0[i % L];
    for (int l = 0; l < L; ++l) {
        a0[l] = a1[l] > a0[l] ? a1[l] : a0[l];
        a2[l] = a3[l] > a2[l] ? a3[l] : a2[l];
        a0[l] = a2[l] > a0[l] ? a2[l] : a0[l];
    }
    return tree16_max(a0) + T(0.0);
}

// Order: lane l = (((-0 + e[l]) + e[l+16]) + ...) with e_j = exp(x_j - mx), then ta::tree16;
// e_j is stored to y when y is non-null.
template <typename T>
inline T lane_sum_exp(const T* x, T mx, T* y, int64_t n) {
    T acc[L];
    for (int l = 0; l < L; ++l) acc[l] = T(-0.0);
    int64_t i = 0;
    if (y) {
        for (; i + L <= n; i += L)
            for (int l = 0; l < L; ++l) {
                const T e = exp_t(x[i + l] - mx);
                y[i + l] = e;
                acc[l] = acc[l] + e;
            }
        for (int l = 0; i + l < n; ++l) {
            const T e = exp_t(x[i + l] - mx);
            y[i + l] = e;
            acc[l] = acc[l] + e;
        }
    } else {
        for (; i + L <= n; i += L)
            for (int l = 0; l < L; ++l) acc[l] = acc[l] + exp_t(x[i + l] - mx);
        for (int l = 0; i + l < n; ++l) acc[l] = acc[l] + exp_t(x[i + l] - mx);
    }
    return ta::tree16(acc);
}

#if defined(TA_ISA_AVX512)
// The same order with the 16 lanes in one zmm and ta::exp_f32_v16 (exp_f32's bits); the tail
// is a masked step (masked-off lanes keep their sums).
template <>
inline float lane_sum_exp<float>(const float* x, float mx, float* y, int64_t n) {
    __m512 acc = _mm512_set1_ps(-0.0f);
    const __m512 m = _mm512_set1_ps(mx);
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        const __m512 e = ta::exp_f32_v16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
        if (y) _mm512_storeu_ps(y + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = ta::exp_f32_v16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
        if (y) _mm512_mask_storeu_ps(y + i, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    float lanes[L];
    _mm512_storeu_ps(lanes, acc);
    return ta::tree16(lanes);
}
#endif

#if defined(TA_ISA_AVX2)
// The same order with lanes 0-7 in one ymm and 8-15 in another, and ta::exp_f32_v8 (exp_f32's
// bits); the tail is a masked step (masked-off lanes keep their sums).
template <>
inline float lane_sum_exp<float>(const float* x, float mx, float* y, int64_t n) {
    __m256 lo = _mm256_set1_ps(-0.0f), hi = lo;
    const __m256 m = _mm256_set1_ps(mx);
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        const __m256 e0 = ta::exp_f32_v8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        const __m256 e1 = ta::exp_f32_v8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m));
        if (y) {
            _mm256_storeu_ps(y + i, e0);
            _mm256_storeu_ps(y + i + 8, e1);
        }
        lo = _mm256_add_ps(lo, e0);
        hi = _mm256_add_ps(hi, e1);
    }
    if (i < n) {
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const int rest = (int)(n - i);
        const __m256i k0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), iota);
        const __m256i k1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest - 8), iota);
        const __m256 e0 = ta::exp_f32_v8(_mm256_sub_ps(_mm256_maskload_ps(x + i, k0), m));
        const __m256 e1 = ta::exp_f32_v8(_mm256_sub_ps(_mm256_maskload_ps(x + i + 8, k1), m));
        if (y) {
            _mm256_maskstore_ps(y + i, k0, e0);
            _mm256_maskstore_ps(y + i + 8, k1, e1);
        }
        lo = _mm256_blendv_ps(lo, _mm256_add_ps(lo, e0), _mm256_castsi256_ps(k0));
        hi = _mm256_blendv_ps(hi, _mm256_add_ps(hi, e1), _mm256_castsi256_ps(k1));
    }
    float lanes[L];
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    return ta::tree16(lanes);
}
#endif

// out_j = exp(x_j): the element-wise exp of a row (exp_t's bits; vector exps where written).
template <typename T>
inline void exp_row(const T* x, T* out, int64_t n) {
    for (int64_t j = 0; j < n; ++j) out[j] = exp_t(x[j]);
}

#if defined(TA_ISA_AVX512)
template <>
inline void exp_row<float>(const float* x, float* out, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, ta::exp_f32_v16(_mm512_loadu_ps(x + j)));
    if (j < n) {
        const __mmask16 k = (__mmask16)((1u << (n - j)) - 1u);
        _mm512_mask_storeu_ps(out + j, k, ta::exp_f32_v16(_mm512_maskz_loadu_ps(k, x + j)));
    }
}
#elif defined(TA_ISA_AVX2)
template <>
inline void exp_row<float>(const float* x, float* out, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, ta::exp_f32_v8(_mm256_loadu_ps(x + j)));
    if (j < n) {
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(out + j, k, ta::exp_f32_v8(_mm256_maskload_ps(x + j, k)));
    }
}
#endif

// sum over the last dim: out[r] = lane_sum(t(x[r, :])) (t = Square: the sum of squares, the bits
// of row_sum over x * x without the [M, N] temporary).
template <typename T, typename Term = Plain>
void row_sum(const T* x, T* out, int64_t m, int64_t n, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) out[r] = canon(lane_sum(x + r * n, n, Term()));
    });
}

// Column sums in the lane order: out[c] = 16 lanes over the rows (lane l adds term(l, c),
// term(l + 16, c), ... ascending, from -0.0), then ta::tree16: for each column the order of
// lane_sum over that column's terms. Vector lanes run along the columns (a block of CB columns
// keeps its 16 lane sums in acc); blocks, and so threads, never split a column.
template <typename T, typename Term>
void col_lane_sum(int64_t m, int64_t n, int threads, T* out, Term term) {
    constexpr int64_t CB = 128 / sizeof(T);  // columns per block: 32 float32 / 16 float64
    ta::parallel_for((n + CB - 1) / CB, threads, [&](int64_t b0, int64_t b1) {
        T acc[L][CB];
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t c0 = b * CB, w = n - c0 < CB ? n - c0 : CB;
            for (int l = 0; l < L; ++l)
                for (int64_t j = 0; j < CB; ++j) acc[l][j] = T(-0.0);
            for (int64_t r = 0; r < m; ++r) {
                T* a = acc[r % L];
                for (int64_t j = 0; j < w; ++j) a[j] = a[j] + term(r, c0 + j);
            }
            T lanes[L];
            for (int64_t j = 0; j < w; ++j) {
                for (int l = 0; l < L; ++l) lanes[l] = acc[l][j];
                out[c0 + j] = canon(ta::tree16(lanes));
            }
        }
    });
}

// sum over the rows of [M, N], per column: out[c] = lane_sum(t(x[:, c])): the bits of row_sum
// over the transposed matrix, without the transpose.
template <typename T, typename Term = Plain>
void col_sum(const T* x, T* out, int64_t m, int64_t n, int threads) {
    const Term t;
    col_lane_sum<T>(m, n, threads, out, [&](int64_t r, int64_t c) { return t(x[r * n + c]); });
}

// softmax: mx = lane_max(x); s = lane_sum_exp(x, mx) (e_j = exp(x_j - mx)); y_j = e_j * (1 / s).
template <typename T>
void softmax(const T* x, T* y, int64_t m, int64_t n, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T* xr = x + r * n;
            T* yr = y + r * n;
            const T mx = lane_max(xr, n);
            const T inv = T(1) / lane_sum_exp(xr, mx, yr, n);
            for (int64_t j = 0; j < n; ++j) yr[j] = canon(yr[j] * inv);
        }
    });
}

// log_softmax: mx = lane_max(x); s = lane_sum_exp(x, mx); y_j = (x_j - mx) - log(s).
template <typename T>
void log_softmax(const T* x, T* y, int64_t m, int64_t n, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T* xr = x + r * n;
            T* yr = y + r * n;
            const T mx = lane_max(xr, n);
            const T ls = log_t(lane_sum_exp(xr, mx, static_cast<T*>(nullptr), n));
            for (int64_t j = 0; j < n; ++j) yr[j] = canon((xr[j] - mx) - ls);
        }
    });
}

// softmax backward: d = lane_dot(g, y); out_j = y_j * (g_j - d).
template <typename T>
void softmax_backward(const T* g, const T* y, T* out, int64_t m, int64_t n, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T *gr = g + r * n, *yr = y + r * n;
            T* orow = out + r * n;
            const T d = lane_dot(gr, yr, n);
            for (int64_t j = 0; j < n; ++j) orow[j] = canon(yr[j] * (gr[j] - d));
        }
    });
}

// log_softmax backward: s = lane_sum(g); out_j = fma(-exp(y_j), s, g_j).
template <typename T>
void log_softmax_backward(const T* g, const T* y, T* out, int64_t m, int64_t n, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T *gr = g + r * n, *yr = y + r * n;
            T* orow = out + r * n;
            const T s = lane_sum(gr, n);
            exp_row(yr, orow, n);
            for (int64_t j = 0; j < n; ++j) orow[j] = canon(std::fma(-orow[j], s, gr[j]));
        }
    });
}

// rms_norm of one row: ss = lane_dot(x, x); rstd = 1 / sqrt(ss / n + eps); y_j = (x_j * rstd) * w_j
// (w null: y_j = x_j * rstd); returns rstd.
template <typename T>
inline T rms_norm_row(const T* x, const T* w, T* y, int64_t n, T eps) {
    const T rs = T(1) / std::sqrt(lane_dot(x, x, n) / T(n) + eps);
    if (w) {
        for (int64_t j = 0; j < n; ++j) y[j] = canon((x[j] * rs) * w[j]);
    } else {
        for (int64_t j = 0; j < n; ++j) y[j] = canon(x[j] * rs);
    }
    return rs;
}

// rms_norm: rms_norm_row per row; rstd is written per row.
template <typename T>
void rms_norm(const T* x, const T* w, T* y, T* rstd, int64_t m, int64_t n, T eps, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) rstd[r] = canon(rms_norm_row(x + r * n, w, y + r * n, n, eps));
    });
}

// add_rms_norm (forward only): per row, s_j = h_j + d_j (one IEEE add; written out), then
// rms_norm_row of s with w. So s and y are bitwise `h + d` and then rms_norm(h + d, w) (the
// residual add and the next norm of a transformer block) in one call; NaNs come out canonical.
template <typename T>
void add_rms_norm(const T* h, const T* d, const T* w, T* s, T* y, int64_t m, int64_t n, T eps, int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T *hr = h + r * n, *dr = d + r * n;
            T *sr = s + r * n, *yr = y + r * n;
            for (int64_t j = 0; j < n; ++j) sr[j] = canon(hr[j] + dr[j]);
            rms_norm_row(sr, w, yr, n, eps);
        }
    });
}

// rms_norm_rope (forward only; q/k-norm then RoPE): row r = (token t, head h) of x, token t's
// heads ld_tok elements apart, a head's d (even) elements contiguous; the head's weight at
// w + h * ld_w, the token's cos/sin rows at t * d. As rms_norm without weight, then the weight,
// then models/rope.py's rotate-half RoPE, op for op:
//   n_j = w_j * rms_norm_row(x, no weight)_j;
//   y_j = n_j * cos_j + (-n_{j+d/2}) * sin_j (j < d/2),  n_j * cos_j + n_{j-d/2} * sin_j (j >= d/2)
// (two products, then one add; NaNs canonical). y is [tokens, heads, d], contiguous.
template <typename T>
void rms_norm_rope(const T* x, const T* w, const T* cs, const T* sn, T* y, int64_t tokens, int64_t heads, int64_t d,
                   int64_t ld_tok, int64_t ld_w, T eps, int threads) {
    const int64_t half = d / 2;
    ta::parallel_for(tokens * heads, threads, [&](int64_t r0, int64_t r1) {
        std::vector<T> n(d);
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t t = r / heads, h = r % heads;
            const T *xr = x + t * ld_tok + h * d, *wr = w + h * ld_w, *c = cs + t * d, *s = sn + t * d;
            T* yr = y + r * d;
            rms_norm_row(xr, static_cast<const T*>(nullptr), n.data(), d, eps);
            for (int64_t j = 0; j < d; ++j) n[j] = wr[j] * n[j];
            for (int64_t j = 0; j < half; ++j) yr[j] = canon(n[j] * c[j] + (-n[j + half]) * s[j]);
            for (int64_t j = half; j < d; ++j) yr[j] = canon(n[j] * c[j] + n[j - half] * s[j]);
        }
    });
}

// rms_norm backward, per row: gw_j = g_j * w_j (w null: g_j); d = lane_dot(gw, x) (gw rounded
// first); k = ((rstd * rstd) * rstd) * (d / n); gx_j = fma(-x_j, k, rstd * gw_j).
// Weight gradient (w non-null), per column j: gwt_j = fma(g_ij * x_ij, rstd_i, gwt_j) for rows
// i ascending from -0.0; threads split the columns.
template <typename T>
void rms_norm_backward(const T* g, const T* x, const T* w, const T* rstd, T* gx, T* gwt, int64_t m, int64_t n,
                       int threads) {
    ta::parallel_for(m, threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T *gr = g + r * n, *xr = x + r * n;
            T* out = gx + r * n;
            const T rs = rstd[r];
            if (w) {
                const T k = ((rs * rs) * rs) * (lane_dot_scaled(gr, w, xr, n) / T(n));
                for (int64_t j = 0; j < n; ++j) out[j] = canon(std::fma(-xr[j], k, rs * (gr[j] * w[j])));
            } else {
                const T k = ((rs * rs) * rs) * (lane_dot(gr, xr, n) / T(n));
                for (int64_t j = 0; j < n; ++j) out[j] = canon(std::fma(-xr[j], k, rs * gr[j]));
            }
        }
    });
    if (!w || !gwt) return;
    // Column blocks of 64 (whole cache lines); block boundaries do not touch any column's order.
    const int64_t blocks = (n + 63) / 64;
    ta::parallel_for(blocks, threads, [&](int64_t b0, int64_t b1) {
        const int64_t c0 = b0 * 64, c1 = b1 * 64 < n ? b1 * 64 : n;
        for (int64_t j = c0; j < c1; ++j) gwt[j] = T(-0.0);
        for (int64_t i = 0; i < m; ++i) {
            const T *gr = g + i * n, *xr = x + i * n;
            const T rs = rstd[i];
            for (int64_t j = c0; j < c1; ++j) gwt[j] = std::fma(gr[j] * xr[j], rs, gwt[j]);
        }
        for (int64_t j = c0; j < c1; ++j) gwt[j] = canon(gwt[j]);
    });
}

// The backward of y = w * rms_norm(x) with the weight applied after the norm (the model's
// composition: normed_ij = x_ij * rstd_i, then w_j * normed_ij). gx: rms_norm_backward's with w
// (its gradient into normed is g_ij * w_j, rounded, as the multiply's backward gives it). gw_j:
// the sum over rows of g_ij * normed_ij (normed rounded first, as the forward computed it) in
// col_lane_sum's order: the bits of the multiply's gradient summed by sum_dims over the rows.
template <typename T>
void rms_norm_scaled_backward(const T* g, const T* x, const T* w, const T* rstd, T* gx, T* gw, int64_t m, int64_t n,
                              int threads) {
    rms_norm_backward<T>(g, x, w, rstd, gx, nullptr, m, n, threads);
    col_lane_sum<T>(m, n, threads, gw, [&](int64_t r, int64_t c) { return g[r * n + c] * (x[r * n + c] * rstd[r]); });
}

}  // namespace

#define TA_ROWOPS(T, sfx)                                                                                      \
    TA_EXPORT(void, row_sum_##sfx)(const T* x, T* out, int64_t m, int64_t n, int threads) {                    \
        row_sum<T>(x, out, m, n, threads);                                                                     \
    }                                                                                                          \
    TA_EXPORT(void, row_sum_sq_##sfx)(const T* x, T* out, int64_t m, int64_t n, int threads) {                 \
        row_sum<T, Square>(x, out, m, n, threads);                                                             \
    }                                                                                                          \
    TA_EXPORT(void, col_sum_##sfx)(const T* x, T* out, int64_t m, int64_t n, int threads) {                    \
        col_sum<T, Plain>(x, out, m, n, threads);                                                              \
    }                                                                                                          \
    TA_EXPORT(void, col_sum_sq_##sfx)(const T* x, T* out, int64_t m, int64_t n, int threads) {                 \
        col_sum<T, Square>(x, out, m, n, threads);                                                             \
    }                                                                                                          \
    TA_EXPORT(void, softmax_##sfx)(const T* x, T* y, int64_t m, int64_t n, int threads) {                      \
        softmax<T>(x, y, m, n, threads);                                                                       \
    }                                                                                                          \
    TA_EXPORT(void, log_softmax_##sfx)(const T* x, T* y, int64_t m, int64_t n, int threads) {                  \
        log_softmax<T>(x, y, m, n, threads);                                                                   \
    }                                                                                                          \
    TA_EXPORT(void, softmax_backward_##sfx)(const T* g, const T* y, T* out, int64_t m, int64_t n, int threads) { \
        softmax_backward<T>(g, y, out, m, n, threads);                                                         \
    }                                                                                                          \
    TA_EXPORT(void, log_softmax_backward_##sfx)(const T* g, const T* y, T* out, int64_t m, int64_t n,          \
                                                int threads) {                                                 \
        log_softmax_backward<T>(g, y, out, m, n, threads);                                                     \
    }                                                                                                          \
    TA_EXPORT(void, rms_norm_##sfx)(const T* x, const T* w, T* y, T* rstd, int64_t m, int64_t n, double eps,   \
                                    int threads) {                                                             \
        rms_norm<T>(x, w, y, rstd, m, n, T(eps), threads);                                                     \
    }                                                                                                          \
    TA_EXPORT(void, add_rms_norm_##sfx)(const T* h, const T* d, const T* w, T* s, T* y, int64_t m, int64_t n,    \
                                        double eps, int threads) {                                             \
        add_rms_norm<T>(h, d, w, s, y, m, n, T(eps), threads);                                                 \
    }                                                                                                          \
    TA_EXPORT(void, rms_norm_rope_##sfx)(const T* x, const T* w, const T* cs, const T* sn, T* y, int64_t tokens, \
                                         int64_t heads, int64_t d, int64_t ld_tok, int64_t ld_w, double eps,   \
                                         int threads) {                                                        \
        rms_norm_rope<T>(x, w, cs, sn, y, tokens, heads, d, ld_tok, ld_w, T(eps), threads);                     \
    }                                                                                                          \
    TA_EXPORT(void, rms_norm_backward_##sfx)(const T* g, const T* x, const T* w, const T* rstd, T* gx, T* gwt, \
                                             int64_t m, int64_t n, int threads) {                              \
        rms_norm_backward<T>(g, x, w, rstd, gx, gwt, m, n, threads);                                           \
    } \
    TA_EXPORT(void, rms_norm_scaled_backward_##sfx)(const T* g, const T* x, const T* w, const T* rstd, T* gx,   \
                                                    T* gw, int64_t m, int64_t n, int threads) {                \
        rms_norm_scaled_backward<T>(g, x, w, rstd, gx, gw, m, n, threads);                                     \
    }

TA_ROWOPS(float, f32)
TA_ROWOPS(double, f64)
