// attention.cpp: softmax attention forward and backward (causal prefill, chunked prefill, decode,
// documents, masks, GQA), float32 and float64, one fixed order of operations per query row.
//
// Guarantee: the bits of out[b, h, i], lse[b, h, i] and dq[b, h, i] depend only on that query
// row, its position, the keys/values it can see and their absolute positions; never on the
// batch, Tq, Tk beyond its visible keys, the thread count or the ISA variant. dk and dv (sums
// over query rows) are deterministic: one fixed order whatever the threads.
//
// Order by construction, for query row (b, h, i) with kv head h / G (G = Hq / Hkv):
//   visible keys: j < Tk, causal: j <= position, same document (doc id >= 0), mask true.
//   chunks: keys in chunks of KC = 128 aligned to absolute key position (chunk c = keys
//     [128c, 128c + 128)), ascending; a chunk with no visible key is skipped entirely.
//   score s_j = fma chain over d = 0..D-1 ascending, from +0.0, of qs[d] * k_j[d], where
//     qs = q * sscale rounded once (sscale = scale * log2(e) for float32: base-2 scores;
//     scale for float64). Vector lanes run along keys (a transposed copy of the chunk's keys).
//     Invisible keys: the score is replaced by -inf (a select, never arithmetic).
//   per chunk (online softmax): m_c = max of the chunk's scores (exact); m' = max(m, m_c);
//     p_j = exp2_f32(s_j - m') (float64: exp_f64), invisible keys give exactly 0;
//     l_c = 16 lanes (lane t adds p_j of keys j = t mod 16 of the chunk, ascending) then
//     ta::tree16; first visible chunk: l = l_c, acc = 0; later: alpha = exp2(m - m'),
//     l = l * alpha + l_c, acc[d] = acc[d] * alpha; then acc[d] = fma(p_j, v_j[d], acc[d]) over
//     the visible keys j of the chunk ascending (invisible keys are skipped, never times zero).
//   out[d] = acc[d] / l + 0.0 (0 where no key is visible); lse = fma(m, ln2, log_f32(l))
//     (float64: m + log_f64(l)), -inf where no key is visible. A NaN output (NaN inputs) is
//     stored as the one canonical NaN (ta::canon_nan_*), here and in the backward.
// Backward (p recomputed from lse, in the forward's chunks):
//   delta = 16 lanes (lane t: fma chain over d = t mod 16 ascending of dO[d] * O[d]) + tree16.
//   per visible (row, key): p_j = exp2(s_j - lse * log2(e)) (float64: exp(s_j - lse)),
//     dp_j = fma chain over d ascending of dO[d] * v_j[d], ds_j = p_j * (dp_j - delta);
//     invisible keys: p = ds = 0 (selects).
//   dq[d] = (fma chain over visible keys ascending of ds_j * k_j[d]) * scale + 0.0.
//   dk_j[d] = (fma chain over query rows r ascending of ds_rj * q_r[d]) * scale + 0.0 and
//     dv_j[d] = fma chain over query rows r ascending of p_rj * dO_r[d], + 0.0, where rows run
//     over (query position index i ascending, then the G heads of the kv head ascending) and
//     only rows that see some key of j's chunk enter; such a row that does not see key j adds
//     p = ds = 0 exactly (at most a zero's sign changes, and the final + 0.0 canonicalises it).
// Paged forward (attention_paged_fwd_*, decode and prefill from a paged KV cache): key j of row b
//   is read at block table[b, j / bs], slot j % bs, and row b holds seqlen[b] keys. It is the
//   forward above with only the key/value addresses changed (Strided -> Listed, built per chunk),
//   so its bits equal the dense forward's on the same keys at the same positions.
// Threads: forward and dq split (b, kv head, query block) tasks, dk/dv split (b, kv head, key
//   chunk) tasks; a task writes only its own outputs and no reduction is split.
// Every fma is explicit (std::fma / _mm*_fmadd_*), -ffp-contract=off: each variant performs the
// same IEEE operations on the same values in the same order, so scalar == avx2 == avx512.
#include "ta_common.h"
#include "ta_math.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

// GCC 12 warns about the intrinsics' own undefined-vector idiom inside the transposes.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

constexpr int KC = 128;      // KEY_CHUNK (cpu/attention.py): keys per chunk, aligned to position
constexpr int L = TA_LANES;  // 16 logical lanes of the l_c / delta sums
constexpr int QROWS = 64;    // query rows per forward / dq task (speed only)

// ---------------------------------------------------------------- vector types (speed only)
// V::W lanes of T; every op is one IEEE operation per lane, so W never changes a value.

template <typename T>
struct VS {  // one lane: the portable scalar path, and every float64 path
    using R = T;
    static constexpr int W = 1;
    static R load(const T* p) { return *p; }
    static void store(T* p, R a) { *p = a; }
    static R bcast(T x) { return x; }
    static R zero() { return T(0); }
    static R fma(R a, R b, R c) { return std::fma(a, b, c); }
    static R add(R a, R b) { return a + b; }
    static R max(R a, R b) { return a > b ? a : b; }  // the select every variant performs
};

#if defined(TA_ISA_AVX512)
struct VF {
    using R = __m512;
    static constexpr int W = 16;
    static R load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, R a) { _mm512_storeu_ps(p, a); }
    static R bcast(float x) { return _mm512_set1_ps(x); }
    static R zero() { return _mm512_setzero_ps(); }
    static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
    static R add(R a, R b) { return _mm512_add_ps(a, b); }
    static R max(R a, R b) { return _mm512_max_ps(a, b); }  // a > b ? a : b per lane (NaN: b)
};
#elif defined(TA_ISA_AVX2)
struct VF {
    using R = __m256;
    static constexpr int W = 8;
    static R load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, R a) { _mm256_storeu_ps(p, a); }
    static R bcast(float x) { return _mm256_set1_ps(x); }
    static R zero() { return _mm256_setzero_ps(); }
    static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
    static R add(R a, R b) { return _mm256_add_ps(a, b); }
    static R max(R a, R b) { return _mm256_max_ps(a, b); }  // a > b ? a : b per lane (NaN: b)
};
#else
using VF = VS<float>;
#endif

template <typename T> struct VecOf { using type = VS<T>; };
template <> struct VecOf<float> { using type = VF; };

// Register tiles (speed only): rows x vectors of the dot and axpy tiles.
template <typename V> struct Tile { static constexpr int ROWS = 4, VECS = 4; };
#if defined(TA_ISA_AVX512)
template <> struct Tile<VF> { static constexpr int ROWS = 6, VECS = 4; };  // 24 of 32 zmm
#elif defined(TA_ISA_AVX2)
template <> struct Tile<VF> { static constexpr int ROWS = 6, VECS = 2; };  // 12 of 16 ymm
#endif
constexpr int MAXROWS = 6;

inline float exp_b(float x) { return ta::exp2_f32(x); }  // float32 scores are base 2
inline double exp_b(double x) { return ta::exp_f64(x); }

#if defined(TA_ISA_AVX512)
// ta::exp2_f32 on 16 lanes, the same bits lane by lane (the cross-variant tests compare it with
// the scalar variant), in fewer instructions (ta_math.h's exp_f32_v16 argument):
//   select(x < -160, -160, x) == max_ps(-160, x), select(x > 128, 128, x) == min_ps(128, x)
//   (MAXPS(a, b) = a > b ? a : b, NaN -> b); (v + 1.5*2^23) - 1.5*2^23 == roundscale(v) to
//   nearest-even for |v| <= 160 (a zero's sign may differ: f = x - (+-0) and 2^(+-0) agree);
//   scale_pow2(p, n) = (p * 2^n1) * 2^n2 with p * 2^n1 exact == scalef(p, n): one rounding.
inline __m512 exp2_v16(__m512 x) {
    const __mmask16 all = 0xffff;
    x = _mm512_maskz_max_ps(all, _mm512_set1_ps(-160.0f), x);
    x = _mm512_maskz_min_ps(all, _mm512_set1_ps(128.0f), x);
    const __m512 n = _mm512_maskz_roundscale_ps(all, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(all, p, n);
}
#endif

// s[j] = exp_b(s[j] - m) for j < top (top % 16 == 0).
template <typename T>
inline void exp_shifted(T* s, int top, T m) {
    for (int j = 0; j < top; ++j) s[j] = exp_b(s[j] - m);
}
#if defined(TA_ISA_AVX512)
template <>
inline void exp_shifted<float>(float* s, int top, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    for (int j = 0; j < top; j += 16) _mm512_storeu_ps(s + j, exp2_v16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
}
#endif

inline float canon(float y) { return ta::canon_nan_f32(y); }  // a NaN output: one fixed NaN
inline double canon(double y) { return ta::canon_nan_f64(y); }
inline float lse_of(float m, float l) { return std::fma(m, 0.693147180559945309f, ta::log_f32(l)); }
inline double lse_of(double m, double l) { return m + ta::log_f64(l); }
inline float lse_to_b(float lse) { return lse * 1.44269504088896341f; }
inline double lse_to_b(double lse) { return lse; }

// ---------------------------------------------------------------- addressing (addresses only)
// Where row j (a key, or in the dk/dv pass a query row) of a run lives: Strided for a dense
// [.., T, D] operand, Listed for keys read through a paged cache's block table (a pointer per
// key, built once per chunk). The kernels below take either and read the same values through it
// in the same order, so the addressing never changes a bit.

template <typename T>
struct Strided {
    const T* base;
    int64_t ld;
    const T* operator()(int64_t j) const { return base + j * ld; }
};

template <typename T>
struct Listed {
    const T* const* row;
    const T* operator()(int64_t j) const { return row[j]; }
};

// ---------------------------------------------------------------- packing (copies only)

// dst[d * KC + j] = src(j)[d] for j < nk, 0 for nk <= j < ntop; d < D.
template <typename T, typename X>
void pack_t(X src, int nk, int ntop, int64_t D, T* dst) {
    int j = 0;
#if defined(TA_ISA_AVX512)
    if constexpr (std::is_same<T, float>::value) {
        for (; j + 16 <= nk; j += 16) {
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) {
                __m512 r[16], t[16];
                for (int x = 0; x < 16; ++x) r[x] = _mm512_loadu_ps(src(j + x) + d);
                for (int x = 0; x < 16; x += 2) {
                    t[x] = _mm512_unpacklo_ps(r[x], r[x + 1]);
                    t[x + 1] = _mm512_unpackhi_ps(r[x], r[x + 1]);
                }
                for (int x = 0; x < 16; x += 4) {
                    r[x] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[x]), _mm512_castps_pd(t[x + 2])));
                    r[x + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[x]), _mm512_castps_pd(t[x + 2])));
                    r[x + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[x + 1]), _mm512_castps_pd(t[x + 3])));
                    r[x + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[x + 1]), _mm512_castps_pd(t[x + 3])));
                }
                // r[4a + c] holds, in 128-bit lane L, column 4L + c of rows 4a..4a+3.
                for (int x = 0; x < 16; x += 8)
                    for (int c = 0; c < 4; ++c) {
                        t[x + c] = _mm512_shuffle_f32x4(r[x + c], r[x + 4 + c], 0x88);
                        t[x + 4 + c] = _mm512_shuffle_f32x4(r[x + c], r[x + 4 + c], 0xdd);
                    }
                for (int c = 0; c < 8; ++c) {
                    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
                    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
                }
                // r[o] now holds column o of the block (rows 0..15 in lanes 0..15).
                for (int o = 0; o < 16; ++o) _mm512_storeu_ps(dst + (d + o) * KC + j, r[o]);
            }
            for (; d < D; ++d)
                for (int x = 0; x < 16; ++x) dst[d * KC + j + x] = src(j + x)[d];
        }
    }
#elif defined(TA_ISA_AVX2)
    if constexpr (std::is_same<T, float>::value) {
        for (; j + 8 <= nk; j += 8) {
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) {
                __m256 r[8], t[8];
                for (int x = 0; x < 8; ++x) r[x] = _mm256_loadu_ps(src(j + x) + d);
                for (int x = 0; x < 8; x += 2) {
                    t[x] = _mm256_unpacklo_ps(r[x], r[x + 1]);
                    t[x + 1] = _mm256_unpackhi_ps(r[x], r[x + 1]);
                }
                for (int x = 0; x < 8; x += 4) {
                    r[x] = _mm256_shuffle_ps(t[x], t[x + 2], 0x44);
                    r[x + 1] = _mm256_shuffle_ps(t[x], t[x + 2], 0xee);
                    r[x + 2] = _mm256_shuffle_ps(t[x + 1], t[x + 3], 0x44);
                    r[x + 3] = _mm256_shuffle_ps(t[x + 1], t[x + 3], 0xee);
                }
                for (int c = 0; c < 4; ++c) {
                    t[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
                    t[4 + c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
                }
                for (int o = 0; o < 8; ++o) _mm256_storeu_ps(dst + (d + o) * KC + j, t[o]);
            }
            for (; d < D; ++d)
                for (int x = 0; x < 8; ++x) dst[d * KC + j + x] = src(j + x)[d];
        }
    }
#endif
    for (; j < nk; ++j)
        for (int64_t d = 0; d < D; ++d) dst[d * KC + j] = src(j)[d];
    for (; j < ntop; ++j)
        for (int64_t d = 0; d < D; ++d) dst[d * KC + j] = T(0);
}

// ---------------------------------------------------------------- microkernels
// dot_tile: out[r][n*W + w] = fma chain over d = 0..D-1 ascending of a[r][d] * bt[d*KC + n*W + w],
// from +0.0 (the score / dp order). Lanes: keys.
template <typename V, int RT, int NV, typename T>
inline void dot_tile(const T* const* a, const T* bt, int64_t D, T* const* out) {
    using R = typename V::R;
    R acc[RT][NV];
    for (int r = 0; r < RT; ++r)
        for (int n = 0; n < NV; ++n) acc[r][n] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
        R b[NV];
        for (int n = 0; n < NV; ++n) b[n] = V::load(bt + d * KC + n * V::W);
        for (int r = 0; r < RT; ++r) {
            R x = V::bcast(a[r][d]);
            for (int n = 0; n < NV; ++n) acc[r][n] = V::fma(x, b[n], acc[r][n]);
        }
    }
    for (int r = 0; r < RT; ++r)
        for (int n = 0; n < NV; ++n) V::store(out[r] + n * V::W, acc[r][n]);
}

// Scores of RT rows (a[r]: D values) against keys [0, ntop) of a packed chunk (ntop % 16 == 0).
template <typename V, int RT, typename T>
inline void dot_rows(const T* const* a, const T* bt, int64_t D, int ntop, T* const* out) {
    constexpr int NV = RT == 1 ? 2 * Tile<V>::VECS : Tile<V>::VECS, W = V::W;  // one row: more chains
    int j = 0;
    for (; j + NV * W <= ntop; j += NV * W) {
        T* o[RT];
        for (int r = 0; r < RT; ++r) o[r] = out[r] + j;
        dot_tile<V, RT, NV>(a, bt + j, D, o);
    }
    for (; j < ntop; j += W) {
        T* o[RT];
        for (int r = 0; r < RT; ++r) o[r] = out[r] + j;
        dot_tile<V, RT, 1>(a, bt + j, D, o);
    }
}

template <typename V, typename T>
void dot_any(const T* const* a, int rows, const T* bt, int64_t D, int ntop, T* const* out) {
    constexpr int RT = Tile<V>::ROWS;
    int r = 0;
    for (; r + RT <= rows; r += RT) dot_rows<V, RT>(a + r, bt, D, ntop, out + r);
    switch (rows - r) {
        case 5: dot_rows<V, 5>(a + r, bt, D, ntop, out + r); break;
        case 4: dot_rows<V, 4>(a + r, bt, D, ntop, out + r); break;
        case 3: dot_rows<V, 3>(a + r, bt, D, ntop, out + r); break;
        case 2: dot_rows<V, 2>(a + r, bt, D, ntop, out + r); break;
        case 1: dot_rows<V, 1>(a + r, bt, D, ntop, out + r); break;
        default: break;
    }
}

// axpy_tile: acc[r][n*W + w] = fma(w[r][j], x_j[n*W + w], acc[r][...]) for j = idx[0..cnt)
// in that (ascending) order, x_j = xs(j) + d0. Lanes: d. The p @ v and ds @ k order.
template <typename V, int RT, int NV, typename T, typename X>
inline void axpy_tile(const T* const* w, const int* idx, int cnt, X xs, int64_t d0, T* const* acc) {
    using R = typename V::R;
    R a[RT][NV];
    for (int r = 0; r < RT; ++r)
        for (int n = 0; n < NV; ++n) a[r][n] = V::load(acc[r] + n * V::W);
    for (int t = 0; t < cnt; ++t) {
        const int j = idx[t];
        const T* xr = xs(j) + d0;
        R x[NV];
        for (int n = 0; n < NV; ++n) x[n] = V::load(xr + n * V::W);
        for (int r = 0; r < RT; ++r) {
            R p = V::bcast(w[r][j]);
            for (int n = 0; n < NV; ++n) a[r][n] = V::fma(p, x[n], a[r][n]);
        }
    }
    for (int r = 0; r < RT; ++r)
        for (int n = 0; n < NV; ++n) V::store(acc[r] + n * V::W, a[r][n]);
}

template <typename V, int RT, typename T, typename X>
inline void axpy_rows(const T* const* w, const int* idx, int cnt, X xs, int64_t Dv, T* const* acc) {
    constexpr int NV = Tile<V>::VECS, W = V::W;
    int64_t d = 0;
    for (; d + NV * W <= Dv; d += NV * W) {
        T* o[RT];
        for (int r = 0; r < RT; ++r) o[r] = acc[r] + d;
        axpy_tile<V, RT, NV>(w, idx, cnt, xs, d, o);
    }
    for (; d + W <= Dv; d += W) {
        T* o[RT];
        for (int r = 0; r < RT; ++r) o[r] = acc[r] + d;
        axpy_tile<V, RT, 1>(w, idx, cnt, xs, d, o);
    }
    for (; d < Dv; ++d) {  // the tail: one lane, the same fma
        T* o[RT];
        for (int r = 0; r < RT; ++r) o[r] = acc[r] + d;
        axpy_tile<VS<T>, RT, 1>(w, idx, cnt, xs, d, o);
    }
}

template <typename V, typename T, typename X>
void axpy_any(const T* const* w, int rows, const int* idx, int cnt, X xs, int64_t Dv, T* const* acc) {
    switch (rows) {
        case 6: axpy_rows<V, 6>(w, idx, cnt, xs, Dv, acc); break;
        case 5: axpy_rows<V, 5>(w, idx, cnt, xs, Dv, acc); break;
        case 4: axpy_rows<V, 4>(w, idx, cnt, xs, Dv, acc); break;
        case 3: axpy_rows<V, 3>(w, idx, cnt, xs, Dv, acc); break;
        case 2: axpy_rows<V, 2>(w, idx, cnt, xs, Dv, acc); break;
        default: axpy_rows<V, 1>(w, idx, cnt, xs, Dv, acc); break;
    }
}

// ---------------------------------------------------------------- problem description

struct Problem {
    int64_t B, Hq, Hkv, Tq, Tk, D, Dv, causal;
    int64_t qs[3], ks[3], vs[3];  // element strides over (b, h, t); the last dim is contiguous
    int64_t ms[4];                // mask strides over (b, h, i, j) (0 where broadcast)
    const int64_t* qpos;          // [B, Tq]
    const int64_t* doc;           // [B, Tk] or null
    const uint8_t* mask;          // bool, or null
    // A paged cache (table non-null): k, v are [blocks, Hkv, bs, D], ks/vs their (block, head,
    // slot) strides; key j of row b at block table[b * tw + j / bs], slot j % bs; row b holds
    // seqlen[b] keys (keys past it are absent, as keys past Tk are).
    const int64_t* table = nullptr;
    const int64_t* seqlen = nullptr;
    int64_t tw = 0, bs = 0;
    int64_t G() const { return Hq / Hkv; }
};

Problem read_problem(const int64_t* p, const int64_t* qpos, const int64_t* doc, const uint8_t* mask) {
    Problem pr;
    pr.B = p[0], pr.Hq = p[1], pr.Hkv = p[2], pr.Tq = p[3], pr.Tk = p[4], pr.D = p[5], pr.Dv = p[6], pr.causal = p[7];
    for (int i = 0; i < 3; ++i) pr.qs[i] = p[8 + i], pr.ks[i] = p[11 + i], pr.vs[i] = p[14 + i];
    for (int i = 0; i < 4; ++i) pr.ms[i] = p[17 + i];
    pr.qpos = qpos, pr.doc = doc, pr.mask = mask;
    return pr;
}

struct Row {
    int64_t b, h, i;
    int64_t limit;  // keys >= limit are invisible (causal / past the cache)
    int64_t qdoc;
};

inline Row make_row(const Problem& pr, int64_t b, int64_t h, int64_t i) {
    const int64_t tk = pr.seqlen ? std::min(pr.seqlen[b], pr.Tk) : pr.Tk;  // keys present in the row
    Row r{b, h, i, tk, 0};
    const int64_t pos = pr.qpos[b * pr.Tq + i];
    if (pr.causal) r.limit = std::min<int64_t>(pos + 1, tk);
    if (pr.doc && pr.Tk > 0) r.qdoc = pr.doc[b * pr.Tk + std::min<int64_t>(std::max<int64_t>(pos, 0), pr.Tk - 1)];
    return r;
}

// The visible keys of chunk [j0, j0 + KC) for a row: vis[j] (j < KC) and the ascending list
// idx[0..cnt) of chunk-relative indices. Returns cnt; *top = (last visible + 1) rounded up to 16.
inline int chunk_keys(const Problem& pr, const Row& row, int64_t j0, uint8_t* vis, int* idx, int* top) {
    const int hi = (int)std::max<int64_t>(0, std::min<int64_t>(KC, row.limit - j0));
    int cnt = 0;
    if (!pr.doc && !pr.mask) {
        for (int j = 0; j < hi; ++j) vis[j] = 1, idx[j] = j;
        for (int j = hi; j < KC; ++j) vis[j] = 0;
        *top = (hi + L - 1) / L * L;
        return hi;
    } else {
        const int64_t* dk = pr.doc ? pr.doc + row.b * pr.Tk + j0 : nullptr;
        const uint8_t* mk = pr.mask ? pr.mask + row.b * pr.ms[0] + row.h * pr.ms[1] + row.i * pr.ms[2] + j0 * pr.ms[3] : nullptr;
        for (int j = 0; j < hi; ++j) {  // keys past `hi` are hidden whatever their document or mask
            bool v = true;
            if (dk) v = dk[j] >= 0 && dk[j] == row.qdoc;
            if (v && mk) v = mk[j * pr.ms[3]] != 0;
            vis[j] = v;
            if (v) idx[cnt++] = j;
        }
        std::memset(vis + hi, 0, KC - hi);
    }
    *top = cnt ? ((idx[cnt - 1] + 1 + L - 1) / L) * L : 0;
    return cnt;
}

// Rows [r, r + n) of a tile share the first `common` visible keys (their lists agree there).
inline int common_prefix(int* const* idx, const int* cnt, int n) {
    int c = cnt[0];
    bool prefixes = idx[0][cnt[0] - 1] == cnt[0] - 1;  // lists [0, cnt): the shortest is common
    for (int r = 1; r < n && prefixes; ++r) prefixes = idx[r][cnt[r] - 1] == cnt[r] - 1, c = std::min(c, cnt[r]);
    if (prefixes) return c;
    c = cnt[0];
    for (int r = 1; r < n; ++r) {
        int k = 0;
        const int lim = std::min(c, cnt[r]);
        while (k < lim && idx[r][k] == idx[0][k]) ++k;
        c = k;
    }
    return c;
}

// Weighted rows in tiles of up to 4: the keys all rows of a tile share, jointly, then each row's
// remaining keys alone; each row's chain stays in ascending key order.
template <typename V, typename T, typename X>
void axpy_grouped(T* const* w, int* const* idx, const int* cnt, int rows, X xs, int64_t Dv, T* const* acc) {
    constexpr int RT = Tile<V>::ROWS;
    for (int r0 = 0; r0 < rows; r0 += RT) {
        const int n = std::min(RT, rows - r0);
        const int common = common_prefix(idx + r0, cnt + r0, n);
        if (common > 0) axpy_any<V>(w + r0, n, idx[r0], common, xs, Dv, acc + r0);
        for (int r = r0; r < r0 + n; ++r)
            if (cnt[r] > common) axpy_any<V>(w + r, 1, idx[r] + common, cnt[r] - common, xs, Dv, acc + r);
    }
}

// 16 lanes over [0, top) (top % 16 == 0), lane t taking elements t, t + 16, ... ascending, then
// the fixed tree: ta::tree16 for the sum, tree16_max for the max. The 16 lanes are one zmm, two
// ymm or 16 scalars: the same operation on the same values per lane.
template <typename V, typename T>
inline T lane_sum(const T* p, int top) {
    constexpr int N = L / V::W;
    typename V::R part[N];
    for (int n = 0; n < N; ++n) part[n] = V::load(p + n * V::W);
    for (int j = L; j < top; j += L)
        for (int n = 0; n < N; ++n) part[n] = V::add(part[n], V::load(p + j + n * V::W));
    T lanes[L];
    for (int n = 0; n < N; ++n) V::store(lanes + n * V::W, part[n]);
    return ta::tree16(lanes);
}

template <typename V, typename T>
inline T lane_max(const T* s, int top) {
    constexpr int N = L / V::W;
    typename V::R part[N];
    for (int n = 0; n < N; ++n) part[n] = V::load(s + n * V::W);
    for (int j = L; j < top; j += L)
        for (int n = 0; n < N; ++n) part[n] = V::max(V::load(s + j + n * V::W), part[n]);
    T l[L];
    for (int n = 0; n < N; ++n) V::store(l + n * V::W, part[n]);
    for (int i = 0; i < 8; ++i) l[i] = l[i + 8] > l[i] ? l[i + 8] : l[i];
    for (int i = 0; i < 4; ++i) l[i] = l[i + 4] > l[i] ? l[i + 4] : l[i];
    for (int i = 0; i < 2; ++i) l[i] = l[i + 2] > l[i] ? l[i + 2] : l[i];
    return l[1] > l[0] ? l[1] : l[0];
}

// c ? a : b by bits (both computed), so the loop vectorises; the value of ?: exactly.
inline float sel(bool c, float a, float b) {
    uint32_t m = 0u - (uint32_t)c, ua, ub;
    std::memcpy(&ua, &a, 4), std::memcpy(&ub, &b, 4);
    ua = (ua & m) | (ub & ~m);
    std::memcpy(&a, &ua, 4);
    return a;
}
inline double sel(bool c, double a, double b) { return c ? a : b; }

// Scores of hidden keys -> -inf in [0, top): a row whose visible keys are [0, cnt) only needs
// its tail set; others go through the per-key select.
template <typename T>
inline void hide(T* s, const uint8_t* vis, int cnt, const int* idx, int top) {
    const T ninf = -std::numeric_limits<T>::infinity();
    if (idx[cnt - 1] == cnt - 1) {
        for (int j = cnt; j < top; ++j) s[j] = ninf;
    } else {
        for (int j = 0; j < top; ++j) s[j] = sel(vis[j] != 0, s[j], ninf);
    }
}

// Per-thread buffers of one block of rows.
template <typename T>
struct Work {
    std::vector<T> kt, vt, qs, s, dp, acc;
    std::vector<uint8_t> vis;
    std::vector<int> idx, cnt, top;
    std::vector<Row> rows;
    void size(int64_t rows_, int64_t D, int64_t Dv) {
        kt.resize(D * KC), vt.resize(Dv * KC), qs.resize(rows_ * D), s.resize(rows_ * KC), dp.resize(rows_ * KC);
        acc.resize(rows_ * std::max(D, Dv)), vis.resize(rows_ * KC), idx.resize(rows_ * KC);
        cnt.resize(rows_), top.resize(rows_), rows.resize(rows_);
    }
};

// Run tasks [0, n) on up to nt threads; each task writes only its own outputs, so which thread
// runs it never matters (dynamic scheduling for balance).
template <typename F>
void run_tasks(int64_t n, int nt, F fn) {
    if (nt <= 1 || n <= 1) {
        fn(int64_t(0), n);
        return;
    }
    const int threads = (int)std::min<int64_t>(nt, n);
#pragma omp parallel num_threads(threads)
    {
        // Each thread takes single tasks in turn; fn keeps its buffers across the calls.
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n; ++t) fn(t, t + 1);
    }
}

// Query rows of the block: positions [i0, i1) x the G heads of kv head hk, row r = (i - i0) * G + g.
template <typename T>
int load_rows(const Problem& pr, int64_t b, int64_t hk, int64_t i0, int64_t i1, const T* q, T sscale, Work<T>& w) {
    const int64_t G = pr.G();
    int nrows = 0;
    for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            w.rows[nrows] = make_row(pr, b, h, i);
            const T* src = q + b * pr.qs[0] + h * pr.qs[1] + i * pr.qs[2];
            T* dst = w.qs.data() + nrows * pr.D;
            for (int64_t d = 0; d < pr.D; ++d) dst[d] = src[d] * sscale;
            ++nrows;
        }
    return nrows;
}

// Visible-key lists of every row for chunk c; returns the number of rows seeing any key and the
// largest `top`. Rows with no visible key keep cnt == 0.
template <typename T>
int block_chunk_keys(const Problem& pr, int nrows, int64_t j0, Work<T>& w, int* max_top) {
    int active = 0, mt = 0;
    for (int r = 0; r < nrows; ++r) {
        int top;
        w.cnt[r] = chunk_keys(pr, w.rows[r], j0, w.vis.data() + r * KC, w.idx.data() + r * KC, &top);
        w.top[r] = top;
        if (w.cnt[r]) ++active, mt = std::max(mt, top);
    }
    *max_top = mt;
    return active;
}

// dot products of the active rows (cnt > 0) of `a` (row stride lda) against the packed chunk bt,
// over keys [0, top of the tile) -> out rows (stride KC).
template <typename V, typename T>
void block_dots(int nrows, const int* cnt, const int* top, const T* a, int64_t lda, const T* bt, int64_t D, T* out) {
    constexpr int RT = Tile<V>::ROWS;
    const T* ap[MAXROWS];
    T* op[MAXROWS];
    int n = 0, ntop = 0;
    auto flush = [&]() {
        if (n) dot_any<V>(ap, n, bt, D, ntop, op);
        n = 0, ntop = 0;
    };
    for (int r = 0; r < nrows; ++r) {
        if (!cnt[r]) continue;
        ap[n] = a + r * lda, op[n] = out + r * KC, ntop = std::max(ntop, top[r]);
        if (++n == RT) flush();
    }
    flush();
}

template <typename V, typename T, typename X>
void block_axpy(int nrows, Work<T>& w, T* wts, X xs, int64_t Dv, T* acc, int64_t ldacc) {
    T* wp[60];  // a multiple of every tile's row count
    int* ip[60];
    int cn[60];
    T* ap[60];
    int n = 0;
    for (int r = 0; r < nrows; ++r) {
        if (!w.cnt[r]) continue;
        wp[n] = wts + r * KC, ip[n] = w.idx.data() + r * KC, cn[n] = w.cnt[r], ap[n] = acc + r * ldacc;
        if (++n == 60) axpy_grouped<V>(wp, ip, cn, n, xs, Dv, ap), n = 0;
    }
    if (n) axpy_grouped<V>(wp, ip, cn, n, xs, Dv, ap);
}

int64_t query_block(const Problem& pr) { return std::max<int64_t>(1, QROWS / pr.G()); }

// ---------------------------------------------------------------- forward

// Paged keys [j0, j0 + n) of row b, kv head hk: kp[j], vp[j] point at key j0 + j (block
// table[b, (j0 + j) / bs], slot (j0 + j) % bs). Keys at or past `limit` (no row of the task sees
// them: packed, then hidden, their values never reach a result) point at key j0 instead, so the
// table is read only where the row has blocks.
template <typename T>
void paged_rows(const Problem& pr, int64_t b, int64_t hk, int64_t j0, int n, int64_t limit, const T* k, const T* v,
                const T** kp, const T** vp) {
    const int64_t* tb = pr.table + b * pr.tw;
    for (int j = 0; j < n; ++j) {
        const int64_t key = j0 + j < limit ? j0 + j : j0, blk = tb[key / pr.bs], slot = key % pr.bs;
        kp[j] = k + blk * pr.ks[0] + hk * pr.ks[1] + slot * pr.ks[2];
        vp[j] = v + blk * pr.vs[0] + hk * pr.vs[1] + slot * pr.vs[2];
    }
}

template <typename T>
void forward(const Problem& pr, const T* q, const T* k, const T* v, T sscale, T* out, T* lse, int nt) {
    using V = typename VecOf<T>::type;
    const int64_t G = pr.G(), QB = query_block(pr), nqb = (pr.Tq + QB - 1) / QB;
    const int64_t ntask = pr.B * pr.Hkv * nqb;
    const T ninf = -std::numeric_limits<T>::infinity();
    run_tasks(ntask, nt, [&](int64_t t0, int64_t t1) {
        thread_local Work<T> w;
        w.size(QB * G, pr.D, pr.Dv);
        std::vector<T> m(QB * G), l(QB * G);
        const T* kp[KC];  // a paged chunk's key and value addresses
        const T* vp[KC];
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t qb = task % nqb, bh = task / nqb, hk = bh % pr.Hkv, b = bh / pr.Hkv;
            const int64_t i0 = qb * QB, i1 = std::min(pr.Tq, i0 + QB);
            const int nrows = load_rows(pr, b, hk, i0, i1, q, sscale, w);
            int64_t kmax = 0;
            for (int r = 0; r < nrows; ++r) kmax = std::max(kmax, w.rows[r].limit);
            std::fill(m.begin(), m.begin() + nrows, ninf);
            std::fill(l.begin(), l.begin() + nrows, T(0));
            std::fill(w.acc.begin(), w.acc.begin() + nrows * pr.Dv, T(0));
            // One chunk of keys, read through `keys` / `values` (Strided: a dense k, v; Listed: a
            // paged cache): the same code, so the same operations on the same values in the same
            // order whichever addressing; a paged call's bits are the dense call's on its keys.
            auto chunk = [&](int n, int max_top, auto keys, auto values) {  // keys [0, n) present
                pack_t(keys, n, max_top, pr.D, w.kt.data());
                block_dots<V>(nrows, w.cnt.data(), w.top.data(), w.qs.data(), pr.D, w.kt.data(), pr.D, w.s.data());
                for (int r = 0; r < nrows; ++r) {  // the online-softmax update of each row
                    if (!w.cnt[r]) continue;
                    T* s = w.s.data() + r * KC;
                    const uint8_t* vis = w.vis.data() + r * KC;
                    const int top = w.top[r];
                    hide(s, vis, w.cnt[r], w.idx.data() + r * KC, top);
                    const T mc = lane_max<V>(s, top);
                    const T mn = mc > m[r] ? mc : m[r];
                    if (mn == ninf) {  // every visible score is -inf: nothing to add
                        w.cnt[r] = 0;
                        continue;
                    }
                    exp_shifted(s, top, mn);  // p; exactly 0 where hidden
                    const T lc = lane_sum<V>(s, top);
                    if (m[r] == ninf) {
                        l[r] = lc;
                    } else {
                        const T alpha = exp_b(m[r] - mn);
                        l[r] = l[r] * alpha + lc;
                        T* a = w.acc.data() + r * pr.Dv;
                        for (int64_t d = 0; d < pr.Dv; ++d) a[d] = a[d] * alpha;
                    }
                    m[r] = mn;
                }
                block_axpy<V>(nrows, w, w.s.data(), values, pr.Dv, w.acc.data(), pr.Dv);
            };
            for (int64_t j0 = 0; j0 < kmax; j0 += KC) {
                int max_top;
                if (!block_chunk_keys(pr, nrows, j0, w, &max_top)) continue;
                const int nk = (int)std::min<int64_t>(KC, pr.Tk - j0);
                const int n = std::min(nk, max_top);  // every visible key of the chunk is below n
                if (pr.table) {
                    paged_rows(pr, b, hk, j0, n, kmax, k, v, kp, vp);
                    chunk(n, max_top, Listed<T>{kp}, Listed<T>{vp});
                } else {
                    const T* kb = k + b * pr.ks[0] + hk * pr.ks[1] + j0 * pr.ks[2];
                    const T* vb = v + b * pr.vs[0] + hk * pr.vs[1] + j0 * pr.vs[2];
                    chunk(n, max_top, Strided<T>{kb, pr.ks[2]}, Strided<T>{vb, pr.vs[2]});
                }
            }
            for (int r = 0; r < nrows; ++r) {
                const Row& row = w.rows[r];
                const int64_t o = (row.b * pr.Hq + row.h) * pr.Tq + row.i;
                const T* a = w.acc.data() + r * pr.Dv;
                T* dst = out + o * pr.Dv;
                if (l[r] > T(0)) {
                    for (int64_t d = 0; d < pr.Dv; ++d) dst[d] = canon(a[d] / l[r] + T(0));
                    lse[o] = canon(lse_of(m[r], l[r]));
                } else {
                    for (int64_t d = 0; d < pr.Dv; ++d) dst[d] = T(0);
                    lse[o] = ninf;
                }
            }
        }
    });
}

// ---------------------------------------------------------------- backward

// p and ds of the active rows of a block for one chunk (s, dp computed already): in place,
// s -> p, dp -> ds; both exactly 0 at hidden keys.
template <typename T>
void probs_and_ds(int nrows, Work<T>& w, const T* lse_b, const T* delta) {
    for (int r = 0; r < nrows; ++r) {
        if (!w.cnt[r]) continue;
        T* s = w.s.data() + r * KC;
        T* dp = w.dp.data() + r * KC;
        const uint8_t* vis = w.vis.data() + r * KC;
        const int top = w.top[r];
        const T lb = lse_b[r], dl = delta[r];
        // A row whose visible scores were all -inf (infinite inputs) has lse = -inf: no p.
        const bool live = lb != -std::numeric_limits<T>::infinity();
        exp_shifted(s, top, lb);
        for (int j = 0; j < top; ++j) {
            const bool on = live && vis[j] != 0;
            dp[j] = sel(on, s[j] * (dp[j] - dl), T(0));
            s[j] = sel(on, s[j], T(0));
        }
        for (int j = top; j < KC; ++j) s[j] = T(0), dp[j] = T(0);
    }
}

template <typename T>
T row_delta(const T* g, const T* o, int64_t Dv) {
    T part[L];
    for (int t = 0; t < L; ++t) part[t] = T(0);
    for (int64_t d0 = 0; d0 < Dv; d0 += L)
        for (int t = 0; t < L && d0 + t < Dv; ++t) part[t] = std::fma(g[d0 + t], o[d0 + t], part[t]);
    return ta::tree16(part);
}

// Row meta for the backward: lse in the score base, delta; rows with lse == -inf see no key.
template <typename T>
void load_bwd_rows(const Problem& pr, int nrows, Work<T>& w, const T* lse, const T* delta, T* lse_b, T* dl) {
    for (int r = 0; r < nrows; ++r) {
        const Row& row = w.rows[r];
        const int64_t o = (row.b * pr.Hq + row.h) * pr.Tq + row.i;
        lse_b[r] = lse_to_b(lse[o]);
        dl[r] = delta[o];
    }
}

template <typename T>
void backward(const Problem& pr, const T* q, const T* k, const T* v, const T* g, const T* out, const T* lse,
              T sscale, T scale, T* dq, T* dk, T* dv, int nt) {
    using V = typename VecOf<T>::type;
    const int64_t G = pr.G(), QB = query_block(pr), nqb = (pr.Tq + QB - 1) / QB;
    const int64_t nrow_total = pr.B * pr.Hq * pr.Tq;
    std::vector<T> delta(nrow_total);
    ta::parallel_for(nrow_total, nt, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) delta[r] = row_delta(g + r * pr.Dv, out + r * pr.Dv, pr.Dv);
    });
    // dq: (b, kv head, query block) tasks, keys ascending per row.
    run_tasks(pr.B * pr.Hkv * nqb, nt, [&](int64_t t0, int64_t t1) {
        thread_local Work<T> w;
        w.size(QB * G, pr.D, pr.Dv);
        std::vector<T> lb(QB * G), dl(QB * G), gr(QB * G * pr.Dv);
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t qb = task % nqb, bh = task / nqb, hk = bh % pr.Hkv, b = bh / pr.Hkv;
            const int64_t i0 = qb * QB, i1 = std::min(pr.Tq, i0 + QB);
            const int nrows = load_rows(pr, b, hk, i0, i1, q, sscale, w);
            load_bwd_rows(pr, nrows, w, lse, delta.data(), lb.data(), dl.data());
            int64_t kmax = 0;
            for (int r = 0; r < nrows; ++r) {
                const Row& row = w.rows[r];
                const T* src = g + ((row.b * pr.Hq + row.h) * pr.Tq + row.i) * pr.Dv;
                std::copy(src, src + pr.Dv, gr.data() + r * pr.Dv);
                kmax = std::max(kmax, row.limit);
            }
            std::fill(w.acc.begin(), w.acc.begin() + nrows * pr.D, T(0));
            const T* kb = k + b * pr.ks[0] + hk * pr.ks[1];
            const T* vb = v + b * pr.vs[0] + hk * pr.vs[1];
            for (int64_t j0 = 0; j0 < kmax; j0 += KC) {
                int max_top;
                if (!block_chunk_keys(pr, nrows, j0, w, &max_top)) continue;
                const int nk = std::min((int)std::min<int64_t>(KC, pr.Tk - j0), max_top);
                pack_t(Strided<T>{kb + j0 * pr.ks[2], pr.ks[2]}, nk, max_top, pr.D, w.kt.data());
                pack_t(Strided<T>{vb + j0 * pr.vs[2], pr.vs[2]}, nk, max_top, pr.Dv, w.vt.data());
                block_dots<V>(nrows, w.cnt.data(), w.top.data(), w.qs.data(), pr.D, w.kt.data(), pr.D, w.s.data());
                block_dots<V>(nrows, w.cnt.data(), w.top.data(), gr.data(), pr.Dv, w.vt.data(), pr.Dv, w.dp.data());
                probs_and_ds(nrows, w, lb.data(), dl.data());
                block_axpy<V>(nrows, w, w.dp.data(), Strided<T>{kb + j0 * pr.ks[2], pr.ks[2]}, pr.D, w.acc.data(), pr.D);
            }
            for (int r = 0; r < nrows; ++r) {
                const Row& row = w.rows[r];
                T* dst = dq + ((row.b * pr.Hq + row.h) * pr.Tq + row.i) * pr.D;
                const T* a = w.acc.data() + r * pr.D;
                for (int64_t d = 0; d < pr.D; ++d) dst[d] = canon(a[d] * scale + T(0));
            }
        }
    });
    // dk, dv: (b, kv head, key chunk) tasks; each key's chain runs over the query rows ascending.
    const int64_t nkc = (pr.Tk + KC - 1) / KC, RMAX = QB * G;
    run_tasks(pr.B * pr.Hkv * nkc, nt, [&](int64_t t0, int64_t t1) {
        thread_local Work<T> w;
        w.size(RMAX, pr.D, pr.Dv);
        std::vector<T> lb(RMAX), dl(RMAX), gr(RMAX * pr.Dv), qr(RMAX * pr.D);
        std::vector<T> pt(KC * RMAX), st(KC * RMAX), dka(KC * pr.D), dva(KC * pr.Dv);
        std::vector<int> seq(RMAX);
        for (int64_t a = 0; a < RMAX; ++a) seq[a] = (int)a;
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t c = task % nkc, bh = task / nkc, hk = bh % pr.Hkv, b = bh / pr.Hkv;
            const int64_t j0 = c * KC;
            const int nk = (int)std::min<int64_t>(KC, pr.Tk - j0);
            const T* kb = k + b * pr.ks[0] + hk * pr.ks[1];
            const T* vb = v + b * pr.vs[0] + hk * pr.vs[1];
            bool packed = false;
            std::fill(dka.begin(), dka.end(), T(0));
            std::fill(dva.begin(), dva.end(), T(0));
            for (int64_t i0 = 0; i0 < pr.Tq; i0 += QB) {
                const int64_t i1 = std::min(pr.Tq, i0 + QB);
                const int nrows = load_rows(pr, b, hk, i0, i1, q, sscale, w);
                int max_top;
                if (!block_chunk_keys(pr, nrows, j0, w, &max_top)) continue;
                if (!packed) {  // every present key of the chunk, once per task
                    const int ntop = (nk + L - 1) / L * L;
                    pack_t(Strided<T>{kb + j0 * pr.ks[2], pr.ks[2]}, nk, ntop, pr.D, w.kt.data());
                    pack_t(Strided<T>{vb + j0 * pr.vs[2], pr.vs[2]}, nk, ntop, pr.Dv, w.vt.data());
                    packed = true;
                }
                load_bwd_rows(pr, nrows, w, lse, delta.data(), lb.data(), dl.data());
                for (int r = 0; r < nrows; ++r) {
                    if (!w.cnt[r]) continue;
                    const Row& row = w.rows[r];
                    const T* gsrc = g + ((row.b * pr.Hq + row.h) * pr.Tq + row.i) * pr.Dv;
                    std::copy(gsrc, gsrc + pr.Dv, gr.data() + r * pr.Dv);
                }
                block_dots<V>(nrows, w.cnt.data(), w.top.data(), w.qs.data(), pr.D, w.kt.data(), pr.D, w.s.data());
                block_dots<V>(nrows, w.cnt.data(), w.top.data(), gr.data(), pr.Dv, w.vt.data(), pr.Dv, w.dp.data());
                probs_and_ds(nrows, w, lb.data(), dl.data());
                // The active rows, ascending, compacted: x rows (dO, q) and the transposed
                // weights pt[j][a] = p, st[j][a] = ds. Rows that see no key of the chunk stay out.
                int na = 0;
                for (int r = 0; r < nrows; ++r) {
                    if (!w.cnt[r]) continue;
                    const Row& row = w.rows[r];
                    std::copy(gr.data() + r * pr.Dv, gr.data() + (r + 1) * pr.Dv, w.acc.data() + na * pr.Dv);
                    const T* qsrc = q + row.b * pr.qs[0] + row.h * pr.qs[1] + row.i * pr.qs[2];
                    std::copy(qsrc, qsrc + pr.D, qr.data() + na * pr.D);
                    for (int j = 0; j < nk; ++j) {
                        pt[j * RMAX + na] = w.s[r * KC + j];
                        st[j * RMAX + na] = w.dp[r * KC + j];
                    }
                    ++na;
                }
                // key j: acc_j[d] = fma(weight[a][j], x_a[d], acc_j[d]) over active rows a ascending
                // (the axpy kernel with rows in the role of keys), continuing across blocks.
                for (int j = 0; j < nk; j += 4) {
                    const int nj = std::min(4, nk - j);
                    T* wp[4];
                    T* ws[4];
                    T* dvp[4];
                    T* dkp[4];
                    for (int t = 0; t < nj; ++t) {
                        wp[t] = pt.data() + (j + t) * RMAX, ws[t] = st.data() + (j + t) * RMAX;
                        dvp[t] = dva.data() + (j + t) * pr.Dv, dkp[t] = dka.data() + (j + t) * pr.D;
                    }
                    axpy_any<V>(wp, nj, seq.data(), na, Strided<T>{w.acc.data(), pr.Dv}, pr.Dv, dvp);
                    axpy_any<V>(ws, nj, seq.data(), na, Strided<T>{qr.data(), pr.D}, pr.D, dkp);
                }
            }
            for (int j = 0; j < nk; ++j) {
                T* dkr = dk + ((b * pr.Hkv + hk) * pr.Tk + j0 + j) * pr.D;
                T* dvr = dv + ((b * pr.Hkv + hk) * pr.Tk + j0 + j) * pr.Dv;
                for (int64_t d = 0; d < pr.D; ++d) dkr[d] = canon(dka[j * pr.D + d] * scale + T(0));
                for (int64_t d = 0; d < pr.Dv; ++d) dvr[d] = canon(dva[j * pr.Dv + d] + T(0));
            }
        }
    });
}

// The paged forward: checks the table, then `forward` (see Problem for the addressing). Returns 0,
// or before any work 1 (a row's seqlen outside [0, min(Tk, tw * bs)]) or 2 (a block of a present
// key outside [0, num_blocks)).
template <typename T>
int paged_forward(const int64_t* prob, const T* q, const T* k, const T* v, const int64_t* qpos, const int64_t* table,
                  const int64_t* seqlen, T sscale, T* out, T* lse, int nt) {
    Problem pr = read_problem(prob, qpos, nullptr, nullptr);
    pr.table = table, pr.seqlen = seqlen, pr.tw = prob[21], pr.bs = prob[22];
    const int64_t num_blocks = prob[23];
    for (int64_t b = 0; b < pr.B; ++b) {
        if (seqlen[b] < 0 || seqlen[b] > std::min(pr.Tk, pr.tw * pr.bs)) return 1;
        for (int64_t n = 0; n < (seqlen[b] + pr.bs - 1) / pr.bs; ++n)
            if (table[b * pr.tw + n] < 0 || table[b * pr.tw + n] >= num_blocks) return 2;
    }
    forward<T>(pr, q, k, v, sscale, out, lse, nt);
    return 0;
}

}  // namespace

// ---------------------------------------------------------------- exports
// prob: int64[21] = B, Hq, Hkv, Tq, Tk, D, Dv, causal, q strides (b, h, t), k strides, v strides,
// mask strides (b, h, i, j). out [B, Hq, Tq, Dv], lse [B, Hq, Tq], dq [B, Hq, Tq, D],
// dk [B, Hkv, Tk, D], dv [B, Hkv, Tk, Dv], grad_out and out contiguous [B, Hq, Tq, Dv].

TA_EXPORT(int, attention_key_chunk)() { return KC; }  // cpu/attention.py KEY_CHUNK must equal it

TA_EXPORT(void, attention_fwd_f32)(const int64_t* prob, const float* q, const float* k, const float* v,
                                   const int64_t* qpos, const int64_t* doc, const uint8_t* mask, float sscale,
                                   float* out, float* lse, int nt) {
    forward<float>(read_problem(prob, qpos, doc, mask), q, k, v, sscale, out, lse, nt);
}

TA_EXPORT(void, attention_fwd_f64)(const int64_t* prob, const double* q, const double* k, const double* v,
                                   const int64_t* qpos, const int64_t* doc, const uint8_t* mask, double sscale,
                                   double* out, double* lse, int nt) {
    forward<double>(read_problem(prob, qpos, doc, mask), q, k, v, sscale, out, lse, nt);
}

// Paged forward: prob int64[24] = the first 21 as above (mask strides unused; k and v strides are
// over (block, kv head, slot) of k, v [num_blocks, Hkv, block_size, D]), then table width, block
// size, num_blocks; table [B, width], seqlen [B]. Returns 0, or an error code (paged_forward).

TA_EXPORT(int, attention_paged_fwd_f32)(const int64_t* prob, const float* q, const float* k, const float* v,
                                        const int64_t* qpos, const int64_t* table, const int64_t* seqlen,
                                        float sscale, float* out, float* lse, int nt) {
    return paged_forward<float>(prob, q, k, v, qpos, table, seqlen, sscale, out, lse, nt);
}

TA_EXPORT(int, attention_paged_fwd_f64)(const int64_t* prob, const double* q, const double* k, const double* v,
                                        const int64_t* qpos, const int64_t* table, const int64_t* seqlen,
                                        double sscale, double* out, double* lse, int nt) {
    return paged_forward<double>(prob, q, k, v, qpos, table, seqlen, sscale, out, lse, nt);
}

TA_EXPORT(void, attention_bwd_f32)(const int64_t* prob, const float* q, const float* k, const float* v,
                                   const float* grad_out, const float* out, const float* lse, const int64_t* qpos,
                                   const int64_t* doc, const uint8_t* mask, float sscale, float scale, float* dq,
                                   float* dk, float* dv, int nt) {
    backward<float>(read_problem(prob, qpos, doc, mask), q, k, v, grad_out, out, lse, sscale, scale, dq, dk, dv, nt);
}

TA_EXPORT(void, attention_bwd_f64)(const int64_t* prob, const double* q, const double* k, const double* v,
                                   const double* grad_out, const double* out, const double* lse, const int64_t* qpos,
                                   const int64_t* doc, const uint8_t* mask, double sscale, double scale, double* dq,
                                   double* dk, double* dv, int nt) {
    backward<double>(read_problem(prob, qpos, doc, mask), q, k, v, grad_out, out, lse, sscale, scale, dq, dk, dv, nt);
}
