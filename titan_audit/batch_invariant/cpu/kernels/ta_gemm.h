// ta_gemm.h: the gemm building blocks (B panel packing, A row-tile packing, register-tile
// microkernels, the blocked driver `block`, the few-row `rows_axpy`), header-only so that other
// kernels (e.g. attention) can reuse them: include it, do not copy it (edits here change
// gemm.cpp's bits and speed; ask its owner). Everything is `static inline` in ta::gemm.
//
// Order (every variant, every caller), with `blocks` = P (a power of two dividing K; 1 = "v1"):
//   * K is cut into P blocks of bs = K / P; block b (k in [b*bs, (b+1)*bs)) is one sequential fma
//     chain from +0.0 over its k ascending: acc = fma(A[i,k], B[k,j], acc) (nothing else touches acc);
//   * the P block sums are combined by the halving tree: node [lo, hi) = node [lo, mid) +
//     node [mid, hi), mid = (lo + hi) / 2 (left + right, one IEEE add each).
// P = 1 is order "v1" (one chain over k = 0..K-1: what every caller here uses today). Order "v2"
// = the tree with P = P(K) = the largest power of two P with K % P == 0 and K / P >= 64 (1 when no
// such P > 1). P(K/2) == P(K)/2 whenever P(K) >= 2, so for t | P(K) the t contiguous K-shards are
// the subtrees at depth log2(t): v2 of each shard alone, combined by the same halving tree over
// the shard index, is v2 of the whole K bit for bit (tensor parallelism over K).
// Implementation: block j's sums (a register tile's accumulators, restarted from +0.0 per block,
// or rows_axpy's scratch slot) merge into a stack: carry = block j; for level l while bit l of j
// is 1: carry = stack[l] + carry; then stack[l] = carry (after the last block carry is the result).
// With P > 1 a k-block is 2^q whole tree blocks (a complete subtree): stack levels < q are empty at
// its end and shared by all tiles, levels >= q are kept per (row tile, panel) across k-blocks.
// Why it cannot depend on M, threads or the ISA: a lane of a register tile holds exactly one
// output (lanes run along N), the chain for that output is the same fma sequence whatever tile,
// row count or thread computes it, K-blocking stores and reloads the fp32/fp64 partial (exact),
// and an IEEE fma rounds once on every ISA (std::fma in the scalar variant).
//
// Layouts: A element (i, k) at a[i * sam + k * sak] (any strides: A is copied into row tiles,
// pack_a, per k-block, so a transposed A needs no separate copy). B is read either packed (ceil(N/32) panels,
// panel p holds B[k, 32p + c] at packed[(p * K + k) * 32 + c], zero-padded past N) or directly
// from a row-major B (element (k, n) at b[k * ldb + n], full 32-column panels only).
#pragma once

#include <algorithm>
#include <type_traits>

#include "ta_common.h"

#ifndef TA_GEMM_MR_AVX512
#define TA_GEMM_MR_AVX512 12
#endif
#ifndef TA_GEMM_MR_AVX2
#define TA_GEMM_MR_AVX2 6
#endif
#ifndef TA_GEMM_PF
#define TA_GEMM_PF 16
#endif

namespace ta {
namespace gemm {

constexpr int64_t PANEL = 32;  // packed panel width (the same for every variant and dtype)
#if defined(TA_ISA_AVX512)
constexpr int MR = TA_GEMM_MR_AVX512;  // rows per register tile (12 x 32: 24 zmm accumulators)
#elif defined(TA_ISA_AVX2)
constexpr int MR = TA_GEMM_MR_AVX2;  // rows per register tile (6 x 32 as two 6 x 16 halves: 12 ymm accumulators)
#else
constexpr int MR = 6;
#endif
#ifndef TA_GEMM_KC
#if defined(TA_ISA_AVX512)
#define TA_GEMM_KC 512
#else
#define TA_GEMM_KC 256
#endif
#endif
constexpr int64_t KC = TA_GEMM_KC;  // k-block: the KC x 32 B sub-panel stays in L1/L2 across row tiles
constexpr int64_t MC = 96;   // rows per M-block (an MC x KC packed A block stays in L2)
constexpr int64_t PREFETCH_ROWS = TA_GEMM_PF;  // B rows ahead the microkernel prefetches

inline int64_t num_panels(int64_t n) { return (n + PANEL - 1) / PANEL; }
inline int64_t packed_elems(int64_t k, int64_t n) { return num_panels(n) * PANEL * k; }

#if defined(TA_ISA_AVX512)
// gcc 12 flags the intrinsics' internal _mm512_undefined_ps() operands (a false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// In-register transpose of 16 x 16 floats (r[i] = row i in, column i out).
static inline void transpose16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

// A full panel (32 columns) of B = W.t(), 16 k at a time: 32 row loads, two transposes, 32 stores.
static inline bool pack_panel_transposed_fast(const float* b, int64_t K, int64_t sbn, float* dst, int64_t n0) {
    const int64_t kfull = K - K % 16;
    for (int64_t k0 = 0; k0 < kfull; k0 += 16) {
        for (int half = 0; half < 2; ++half) {
            __m512 r[16];
            for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_ps(b + (n0 + 16 * half + c) * sbn + k0);
            transpose16x16(r);
            for (int kk = 0; kk < 16; ++kk) _mm512_storeu_ps(dst + (k0 + kk) * PANEL + 16 * half, r[kk]);
        }
    }
    for (int64_t k = kfull; k < K; ++k)
        for (int64_t c = 0; c < PANEL; ++c) dst[k * PANEL + c] = b[(n0 + c) * sbn + k];
    return true;
}
#pragma GCC diagnostic pop
#endif

// Pack panels [p0, p1) of B (element (k, n) at b[k * sbk + n * sbn]) into `packed` (the full
// packed buffer of K x N). A copy: no arithmetic, so no order to state.
template <typename T>
static inline void pack_panels(const T* b, int64_t K, int64_t N, int64_t sbk, int64_t sbn, T* packed,
                               int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
        T* dst = packed + p * K * PANEL;
        const int64_t n0 = p * PANEL;
        const int64_t nv = std::min<int64_t>(PANEL, N - n0);
        if (sbn == 1) {
            for (int64_t k = 0; k < K; ++k) {
                const T* src = b + k * sbk + n0;
                T* d = dst + k * PANEL;
                for (int64_t c = 0; c < nv; ++c) d[c] = src[c];
                for (int64_t c = nv; c < PANEL; ++c) d[c] = T(0);
            }
        } else if (sbk == 1) {
            // B = W.t() for W [N, K] row-major: a 32 x K block of W, transposed in 16-k chunks.
#if defined(TA_ISA_AVX512)
            if constexpr (std::is_same<T, float>::value) {
                if (nv == PANEL) {
                    pack_panel_transposed_fast(b, K, sbn, dst, n0);
                    continue;
                }
            }
#endif
            constexpr int64_t KB = 16;
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t kb = std::min<int64_t>(KB, K - k0);
                for (int64_t c = 0; c < nv; ++c) {
                    const T* src = b + (n0 + c) * sbn + k0;
                    T* d = dst + k0 * PANEL + c;
                    for (int64_t kk = 0; kk < kb; ++kk) d[kk * PANEL] = src[kk];
                }
                for (int64_t c = nv; c < PANEL; ++c)
                    for (int64_t kk = 0; kk < kb; ++kk) dst[(k0 + kk) * PANEL + c] = T(0);
            }
        } else {
            for (int64_t k = 0; k < K; ++k)
                for (int64_t c = 0; c < PANEL; ++c)
                    dst[k * PANEL + c] = c < nv ? b[k * sbk + (n0 + c) * sbn] : T(0);
        }
    }
}

// ---------------------------------------------------------------- microkernels
// micro<T, R>(a, b, ldb, kc, c, ldc, first): c[R x 32] (+)= A[R x kc] B[kc x 32] with the
// chain order above; first: the chain starts from +0.0, else it continues from c's stored partial.
// A is a packed row tile (pack_a): A[i, k] at a[k * MR + i]. Register tiles: avx512 12 x 32 (24 zmm accumulators), avx2 6 x 32 as two 6 x 16 halves (12 ymm), scalar 6 x 32.

// Portable: the reference order in plain C++ (std::fma). fp64 uses it on every variant (the
// compiler may vectorise the loop over columns; each element stays one std::fma chain).
template <typename T, int R>
static inline void micro_generic(const T* a, const T* b, int64_t ldb, int64_t kc, T* c,
                                 int64_t ldc, bool first) {
    constexpr int64_t W = PANEL;
    T acc[R][W];
    for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < W; ++j) acc[i][j] = first ? T(0) : c[i * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
        const T* bk = b + k * ldb;
        for (int i = 0; i < R; ++i) {
            const T av = a[k * MR + i];
            for (int64_t j = 0; j < W; ++j) acc[i][j] = std::fma(av, bk[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < W; ++j) c[i * ldc + j] = acc[i][j];
}

#if defined(TA_ISA_AVX512)
template <int R>
static inline void micro_f32(const float* a, const float* b, int64_t ldb, int64_t kc,
                             float* c, int64_t ldc, bool first) {
    __m512 acc0[R], acc1[R];
    for (int i = 0; i < R; ++i) {
        acc0[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
        acc1[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + 16);
    }
    for (int64_t k = 0; k < kc; ++k) {
        const float* bk = b + k * ldb;
        _mm_prefetch(reinterpret_cast<const char*>(bk + PREFETCH_ROWS * ldb), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(bk + PREFETCH_ROWS * ldb + 16), _MM_HINT_T0);
        const __m512 b0 = _mm512_loadu_ps(bk);
        const __m512 b1 = _mm512_loadu_ps(bk + 16);
        for (int i = 0; i < R; ++i) {
            const __m512 av = _mm512_set1_ps(a[k * MR + i]);
            acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
            acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
        }
    }
    for (int i = 0; i < R; ++i) {
        _mm512_storeu_ps(c + i * ldc, acc0[i]);
        _mm512_storeu_ps(c + i * ldc + 16, acc1[i]);
    }
}
#elif defined(TA_ISA_AVX2)
// The fma chains of an R-row tile over k in [0, kc) (A packed: A[i, k] at a[k * MR + i]; B row k
// at b + k * ldb): acc[i][v] = fma(A[i, k], B[k, 8v .. 8v + 7], acc[i][v]) for k ascending, over
// V ymm vectors (V = 4: a whole 32-column panel; V = 2: a 16-column half).
template <int R, int V>
static inline __attribute__((always_inline)) void chains(const float* a, const float* b, int64_t ldb, int64_t kc,
                                                         __m256 (&acc)[R][V]) {
    for (int64_t k = 0; k < kc; ++k) {
        const float* bk = b + k * ldb;
        _mm_prefetch(reinterpret_cast<const char*>(bk + PREFETCH_ROWS * ldb), _MM_HINT_T0);
        if constexpr (V > 2) _mm_prefetch(reinterpret_cast<const char*>(bk + PREFETCH_ROWS * ldb + 16), _MM_HINT_T0);
        __m256 bv[V];
        for (int v = 0; v < V; ++v) bv[v] = _mm256_loadu_ps(bk + 8 * v);
        for (int i = 0; i < R; ++i) {
            const __m256 av = _mm256_broadcast_ss(a + k * MR + i);
            for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
        }
    }
}

// One R x 8V tile: the chains from +0.0 (first) or from c's stored partials, stored back to c.
template <int R, int V>
static inline void tile_chains(const float* a, const float* b, int64_t ldb, int64_t kc, float* c, int64_t ldc,
                               bool first) {
    __m256 acc[R][V];
    for (int i = 0; i < R; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8 * v);
    chains<R, V>(a, b, ldb, kc, acc);
    for (int i = 0; i < R; ++i)
        for (int v = 0; v < V; ++v) _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
}

// Blocks [j0, j1) of the tree order for one R x 8V tile (see micro_tree below): each block's
// chains from +0.0, merged with the stack in registers, parked at slots[l] or stored to c.
template <int R, int V>
static inline void tile_tree_chains(const float* a, const float* b, int64_t ldb, int64_t bs, int64_t j0, int64_t j1,
                                    int64_t last, float* const* slots, int64_t col, float* c, int64_t ldc) {
    for (int64_t j = j0; j < j1; ++j) {
        __m256 acc[R][V];
        for (int i = 0; i < R; ++i)
            for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_ps();
        chains<R, V>(a + (j - j0) * bs * MR, b + (j - j0) * bs * ldb, ldb, bs, acc);
        int l = 0;
        for (; (j >> l) & 1; ++l) {
            const float* left = slots[l] + col;
            for (int i = 0; i < R; ++i)
                for (int v = 0; v < V; ++v)
                    acc[i][v] = _mm256_add_ps(_mm256_loadu_ps(left + i * PANEL + 8 * v), acc[i][v]);
        }
        float* dst = (j == last ? c : slots[l] + col);
        const int64_t ld = j == last ? ldc : PANEL;
        for (int i = 0; i < R; ++i)
            for (int v = 0; v < V; ++v) _mm256_storeu_ps(dst + i * ld + 8 * v, acc[i][v]);
    }
}

// AVX2 has 16 ymm registers: a tile of R <= 6 rows x 16 columns takes 2R accumulators, 2 B vectors
// and 1 broadcast (15 for R = 6), so from 3 rows on a 32-column panel is done as two 16-column
// halves, each its own pass over k (a full-panel tile of 3 x 32 needs 17 registers and spills in
// the loop). One or two rows (4R accumulators + 4 B vectors fit) stream B in one pass, as the
// halves' stride-128-byte reads of a memory-bound few-row product are slower. The halves touch
// disjoint columns; each lane is still one output's fma chain over k ascending.
template <int R>
static inline void micro_f32(const float* a, const float* b, int64_t ldb, int64_t kc,
                             float* c, int64_t ldc, bool first) {
    if constexpr (R <= 2) {
        tile_chains<R, 4>(a, b, ldb, kc, c, ldc, first);
    } else {
        tile_chains<R, 2>(a, b, ldb, kc, c, ldc, first);
        tile_chains<R, 2>(a, b + 16, ldb, kc, c + 16, ldc, first);
    }
}
#else
template <int R>
static inline void micro_f32(const float* a, const float* b, int64_t ldb, int64_t kc,
                             float* c, int64_t ldc, bool first) {
    micro_generic<float, R>(a, b, ldb, kc, c, ldc, first);
}
#endif

template <typename T, int R>
static inline void micro(const T* a, const T* b, int64_t ldb, int64_t kc, T* c,
                         int64_t ldc, bool first) {
    if constexpr (std::is_same<T, float>::value)
        micro_f32<R>(a, b, ldb, kc, c, ldc, first);
    else
        micro_generic<T, R>(a, b, ldb, kc, c, ldc, first);
}


// ---------------------------------------------------------------- tree microkernels
// micro_tree<T, R>(a, b, ldb, bs, j0, j1, last, slots, c, ldc): blocks j0 <= j < j1 of the tree
// order for an R x 32 tile, with a at block j0's A (packed row tile) and b at block j0's B rows.
// Each block: the accumulators restart from +0.0 and run one fma chain over its bs k ascending
// (the same chain as micro), then merge in registers: for level l while bit l of j is 1:
// acc = slots[l] + acc (left + right); then acc is parked at slots[l] (R x 32, row stride 32), or,
// for j == last (the final block), stored to c as the result.

template <typename T, int R>
static inline void micro_tree_generic(const T* a, const T* b, int64_t ldb, int64_t bs, int64_t j0, int64_t j1,
                                      int64_t last, T* const* slots, T* c, int64_t ldc) {
    constexpr int64_t W = PANEL;
    for (int64_t j = j0; j < j1; ++j) {
        const T* aj = a + (j - j0) * bs * MR;
        const T* bj = b + (j - j0) * bs * ldb;
        T acc[R][W];
        for (int i = 0; i < R; ++i)
            for (int64_t e = 0; e < W; ++e) acc[i][e] = T(0);
        for (int64_t k = 0; k < bs; ++k) {
            const T* bk = bj + k * ldb;
            for (int i = 0; i < R; ++i) {
                const T av = aj[k * MR + i];
                for (int64_t e = 0; e < W; ++e) acc[i][e] = std::fma(av, bk[e], acc[i][e]);
            }
        }
        int l = 0;
        for (; (j >> l) & 1; ++l) {
            const T* left = slots[l];
            for (int i = 0; i < R; ++i)
                for (int64_t e = 0; e < W; ++e) acc[i][e] = left[i * W + e] + acc[i][e];
        }
        T* dst = j == last ? c : slots[l];
        const int64_t ld = j == last ? ldc : W;
        for (int i = 0; i < R; ++i)
            for (int64_t e = 0; e < W; ++e) dst[i * ld + e] = acc[i][e];
    }
}

#if defined(TA_ISA_AVX512)
template <int R>
static inline void micro_tree_f32(const float* a, const float* b, int64_t ldb, int64_t bs, int64_t j0, int64_t j1,
                                  int64_t last, float* const* slots, float* c, int64_t ldc) {
    for (int64_t j = j0; j < j1; ++j) {
        const float* aj = a + (j - j0) * bs * MR;
        const float* bj = b + (j - j0) * bs * ldb;
        __m512 acc0[R], acc1[R];
        for (int i = 0; i < R; ++i) {
            acc0[i] = _mm512_setzero_ps();
            acc1[i] = _mm512_setzero_ps();
        }
#pragma GCC unroll 4
        for (int64_t k = 0; k < bs; ++k) {
            const float* bk = bj + k * ldb;
            _mm_prefetch(reinterpret_cast<const char*>(bk + PREFETCH_ROWS * ldb), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(bk + PREFETCH_ROWS * ldb + 16), _MM_HINT_T0);
            const __m512 b0 = _mm512_loadu_ps(bk);
            const __m512 b1 = _mm512_loadu_ps(bk + 16);
            for (int i = 0; i < R; ++i) {
                const __m512 av = _mm512_set1_ps(aj[k * MR + i]);
                acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
                acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
            }
        }
        int l = 0;
        for (; (j >> l) & 1; ++l) {
            const float* left = slots[l];
            for (int i = 0; i < R; ++i) {
                acc0[i] = _mm512_add_ps(_mm512_loadu_ps(left + i * PANEL), acc0[i]);
                acc1[i] = _mm512_add_ps(_mm512_loadu_ps(left + i * PANEL + 16), acc1[i]);
            }
        }
        float* dst = j == last ? c : slots[l];
        const int64_t ld = j == last ? ldc : PANEL;
        for (int i = 0; i < R; ++i) {
            _mm512_storeu_ps(dst + i * ld, acc0[i]);
            _mm512_storeu_ps(dst + i * ld + 16, acc1[i]);
        }
    }
}
#elif defined(TA_ISA_AVX2)
// As micro_f32: one full-panel pass for one or two rows, else two 16-column halves, each running
// every block of [j0, j1) and merging in its own columns of the slots (the halves never read each
// other's sums).
template <int R>
static inline void micro_tree_f32(const float* a, const float* b, int64_t ldb, int64_t bs, int64_t j0, int64_t j1,
                                  int64_t last, float* const* slots, float* c, int64_t ldc) {
    if constexpr (R <= 2) {
        tile_tree_chains<R, 4>(a, b, ldb, bs, j0, j1, last, slots, 0, c, ldc);
    } else {
        tile_tree_chains<R, 2>(a, b, ldb, bs, j0, j1, last, slots, 0, c, ldc);
        tile_tree_chains<R, 2>(a, b + 16, ldb, bs, j0, j1, last, slots, 16, c + 16, ldc);
    }
}
#else
template <int R>
static inline void micro_tree_f32(const float* a, const float* b, int64_t ldb, int64_t bs, int64_t j0, int64_t j1,
                                  int64_t last, float* const* slots, float* c, int64_t ldc) {
    micro_tree_generic<float, R>(a, b, ldb, bs, j0, j1, last, slots, c, ldc);
}
#endif

template <typename T, int R>
static inline void micro_tree(const T* a, const T* b, int64_t ldb, int64_t bs, int64_t j0, int64_t j1, int64_t last,
                              T* const* slots, T* c, int64_t ldc) {
    if constexpr (std::is_same<T, float>::value)
        micro_tree_f32<R>(a, b, ldb, bs, j0, j1, last, slots, c, ldc);
    else
        micro_tree_generic<T, R>(a, b, ldb, bs, j0, j1, last, slots, c, ldc);
}

// log2 of a power of two.
inline int tree_levels(int64_t blocks) {
    int l = 0;
    while ((int64_t(1) << l) < blocks) ++l;
    return l;
}
// The merge step after block j (its sums in *cur, n elements): carry = stack[l] + carry for each
// set low bit l of j, then the carry is parked at stack[l] (pointer swap: no copy). Returns the
// slot holding the carry. slots[l] for l < levels are the stack, *cur a free slot. (rows_axpy's
// tree; the register tiles merge in registers, micro_tree.)
template <typename T>
static inline T* tree_merge(int64_t j, T** slots, T** cur, int64_t n) {
    T* carry = *cur;
    int l = 0;
    for (; (j >> l) & 1; ++l) {
        const T* __restrict left = slots[l];
        T* __restrict right = carry;
        for (int64_t e = 0; e < n; ++e) right[e] = left[e] + right[e];
    }
    // park the carry at level l; the slot that was there (free) becomes the next scratch slot
    T* freed = slots[l];
    slots[l] = carry;
    *cur = freed;
    return carry;
}

// Blocks [j0, j1) of one tile in the tree order (r <= MR rows, w <= 32 valid columns; a, b at
// block j0); `last` = P - 1, the block whose carry is the result (written to c). Edge tiles
// (w < 32) write the result through a 32-wide scratch tile (only the valid columns are kept).
template <typename T>
static inline void tile_tree(int r, int64_t w, const T* a, const T* b, int64_t ldb, int64_t bs, int64_t j0,
                             int64_t j1, int64_t last, T* const* slots, T* c, int64_t ldc) {
    constexpr int64_t W = PANEL;
    alignas(64) T scratch[MR * W];
    const bool edge = w < W && j1 > last;
    T* cc = edge ? scratch : c;
    const int64_t lc = edge ? W : ldc;
    switch (r) {
#if defined(TA_ISA_AVX512)
        case 12: micro_tree<T, 12>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 11: micro_tree<T, 11>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 10: micro_tree<T, 10>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 9: micro_tree<T, 9>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 8: micro_tree<T, 8>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 7: micro_tree<T, 7>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
#endif
        case 6: micro_tree<T, 6>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 5: micro_tree<T, 5>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 4: micro_tree<T, 4>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 3: micro_tree<T, 3>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        case 2: micro_tree<T, 2>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
        default: micro_tree<T, 1>(a, b, ldb, bs, j0, j1, last, slots, cc, lc); break;
    }
    if (edge)
        for (int i = 0; i < r; ++i)
            for (int64_t jj = 0; jj < w; ++jj) c[i * ldc + jj] = scratch[i * W + jj];
}

// One tile of r <= MR rows and w <= 32 valid columns: full tiles write C directly, edge tiles
// go through a 32-wide scratch tile (the same chains; only the valid columns are kept).
template <typename T>
static inline void tile(int r, int64_t w, const T* a, const T* b, int64_t ldb,
                        int64_t kc, T* c, int64_t ldc, bool first) {
    constexpr int64_t W = PANEL;
    alignas(64) T scratch[MR * W];
    T* cc = c;
    int64_t lc = ldc;
    if (w < W) {
        cc = scratch;
        lc = W;
        if (!first)
            for (int i = 0; i < r; ++i)
                for (int64_t j = 0; j < W; ++j) scratch[i * W + j] = j < w ? c[i * ldc + j] : T(0);
    }
    switch (r) {
#if defined(TA_ISA_AVX512)
        case 12: micro<T, 12>(a, b, ldb, kc, cc, lc, first); break;
        case 11: micro<T, 11>(a, b, ldb, kc, cc, lc, first); break;
        case 10: micro<T, 10>(a, b, ldb, kc, cc, lc, first); break;
        case 9: micro<T, 9>(a, b, ldb, kc, cc, lc, first); break;
        case 8: micro<T, 8>(a, b, ldb, kc, cc, lc, first); break;
        case 7: micro<T, 7>(a, b, ldb, kc, cc, lc, first); break;
#endif
        case 6: micro<T, 6>(a, b, ldb, kc, cc, lc, first); break;
        case 5: micro<T, 5>(a, b, ldb, kc, cc, lc, first); break;
        case 4: micro<T, 4>(a, b, ldb, kc, cc, lc, first); break;
        case 3: micro<T, 3>(a, b, ldb, kc, cc, lc, first); break;
        case 2: micro<T, 2>(a, b, ldb, kc, cc, lc, first); break;
        default: micro<T, 1>(a, b, ldb, kc, cc, lc, first); break;
    }
    if (w < W)
        for (int i = 0; i < r; ++i)
            for (int64_t j = 0; j < w; ++j) c[i * ldc + j] = scratch[i * W + j];
}

// Panel source: panel p's B[k, 32p + c] at base(p)[k * ldb + c].
template <typename T>
struct Panels {
    const T* packed;  // non-null: packed panels (ldb = 32)
    const T* direct;  // else row-major B with row stride ldb (full panels), packed_tail for the last
    int64_t ldb;
    const T* packed_tail;  // the last (partial) panel packed alone, or null when N % 32 == 0
    int64_t K, N;
    const T* base(int64_t p, int64_t* ld) const {
        if (packed) {
            *ld = PANEL;
            return packed + p * K * PANEL;
        }
        if (packed_tail && p == num_panels(N) - 1) {
            *ld = PANEL;
            return packed_tail;
        }
        *ld = ldb;
        return direct + p * PANEL;
    }
};

// Few rows times a row-major B (element (k, n) at b[k * ldb + n]), columns [n0, n1): the same
// chains as the tiles (c[i, j] = +0.0, then c[i, j] = fma(A[i, k], B[k, j], c[i, j]) for k
// ascending), with the partials in C (L1) instead of registers, so B streams row by row. The
// loop over j is one std::fma per element: the compiler vectorises it along N on every variant.
// With blocks > 1 (the tree order): each block's chains go to a scratch slot of M x (n1 - n0) and are
// merged by tree_merge; `tree` >= rows_tree_elems(blocks, M, n1 - n0) elements.
inline int64_t rows_tree_elems(int64_t blocks, int64_t M, int64_t cols) {
    return blocks > 1 ? (tree_levels(blocks) + 2) * M * cols : 0;
}

template <typename T>
static inline void rows_axpy(const T* a, int64_t sam, int64_t sak, const T* b, int64_t ldb, int64_t K, T* c,
                             int64_t ldc, int64_t M, int64_t n0, int64_t n1, int64_t blocks = 1,
                             T* tree = nullptr);

template <typename T>
static inline void rows_axpy_tree(const T* a, int64_t sam, int64_t sak, const T* b, int64_t ldb, int64_t K,
                                  T* c, int64_t ldc, int64_t M, int64_t n0, int64_t n1, int64_t blocks, T* tree) {
    const int levels = tree_levels(blocks);
    const int64_t bs = K / blocks, cols = n1 - n0, n = M * cols;
    T* slots[64];
    for (int l = 0; l <= levels; ++l) slots[l] = tree + l * n;
    T* cur = tree + (levels + 1) * n;
    T* carry = nullptr;
    for (int64_t j = 0; j < blocks; ++j) {
        // block j's chains: rows_axpy over k [j bs, (j + 1) bs) into cur (row stride cols, columns from 0)
        rows_axpy<T>(a + j * bs * sak, sam, sak, b + j * bs * ldb + n0, ldb, bs, cur, cols, M, 0, cols);
        carry = tree_merge<T>(j, slots, &cur, n);
    }
    for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < cols; ++j) c[i * ldc + n0 + j] = carry[i * cols + j];
}

template <typename T>
static inline void rows_axpy(const T* a, int64_t sam, int64_t sak, const T* b, int64_t ldb, int64_t K, T* c,
                             int64_t ldc, int64_t M, int64_t n0, int64_t n1, int64_t blocks, T* tree) {
    if (blocks > 1) {
        rows_axpy_tree<T>(a, sam, sak, b, ldb, K, c, ldc, M, n0, n1, blocks, tree);
        return;
    }
    for (int64_t i = 0; i < M; ++i)
        for (int64_t j = n0; j < n1; ++j) c[i * ldc + j] = T(0);
    for (int64_t k = 0; k < K; ++k) {
        const T* __restrict bk = b + k * ldb;
        for (int64_t i = 0; i < M; ++i) {
            const T av = a[i * sam + k * sak];
            T* __restrict ci = c + i * ldc;
            for (int64_t j = n0; j < n1; ++j) ci[j] = std::fma(av, bk[j], ci[j]);
        }
    }
}

// Pack rows [m0, m1) x k [k0, k0 + kc) of A into row tiles: tile t's A[m0 + MR t + r, k0 + k] at
// abuf[t * kc * MR + k * MR + r] (a copy; contiguous broadcasts and no cache-set aliasing).
template <typename T>
static inline void pack_a(const T* a, int64_t sam, int64_t sak, int64_t m0, int64_t m1, int64_t k0, int64_t kc,
                          T* abuf) {
    for (int64_t i0 = m0; i0 < m1; i0 += MR) {
        const int64_t r = std::min<int64_t>(MR, m1 - i0);
        T* dst = abuf + ((i0 - m0) / MR) * kc * MR;
#if defined(TA_ISA_AVX512)
        if constexpr (std::is_same<T, float>::value) {
            if (sak == 1 && r == MR && MR <= 16) {  // 16 k at a time: one 16 x 16 transpose
                int64_t k = 0;
                for (; k + 16 <= kc; k += 16) {
                    __m512 v[16];
                    for (int rr = 0; rr < 16; ++rr)
                        v[rr] = rr < MR ? _mm512_loadu_ps(a + (i0 + rr) * sam + k0 + k) : _mm512_setzero_ps();
                    transpose16x16(v);
                    for (int kk = 0; kk < 16; ++kk)
                        _mm512_mask_storeu_ps(dst + (k + kk) * MR, __mmask16((1u << MR) - 1), v[kk]);
                }
                for (; k < kc; ++k)
                    for (int64_t rr = 0; rr < r; ++rr) dst[k * MR + rr] = a[(i0 + rr) * sam + k0 + k];
                continue;
            }
        }
#endif
        if (sak == 1) {
            for (int64_t rr = 0; rr < r; ++rr) {
                const T* src = a + (i0 + rr) * sam + k0;
                for (int64_t k = 0; k < kc; ++k) dst[k * MR + rr] = src[k];
            }
        } else if (sam == 1) {  // A stored transposed (e.g. x.t() in a weight gradient): r in a row
            for (int64_t k = 0; k < kc; ++k) {
                const T* src = a + i0 + (k0 + k) * sak;
                for (int64_t rr = 0; rr < r; ++rr) dst[k * MR + rr] = src[rr];
            }
        } else {
            for (int64_t k = 0; k < kc; ++k)
                for (int64_t rr = 0; rr < r; ++rr) dst[k * MR + rr] = a[(i0 + rr) * sam + (k0 + k) * sak];
        }
    }
}

// The k-block for a block of `rows` rows: with a single row tile the B sub-panel is not reused,
// so whole panels are streamed (kc = K). In the tree order (blocks = P > 1) a k-block is a whole
// number of tree blocks: bs * 2^q with 2^q the most (a power of two, <= P) that fits in KC, at
// least one block; k-blocks start at multiples of 2^q blocks, so each is a complete subtree.
inline int64_t k_block(int64_t rows, int64_t K, int64_t blocks = 1) {
    if (rows <= MR) return K;
    if (blocks <= 1) return KC;
    const int64_t bs = K / blocks;
    int64_t nb = 1;
    while (nb * 2 <= blocks && bs * nb * 2 <= KC) nb *= 2;
    return bs * nb;
}

// Elements of the A buffer `block` needs for any row block of at most `rows` rows.
inline int64_t a_buffer_elems(int64_t rows, int64_t K, int64_t blocks = 1) {
    const int64_t kb = std::min<int64_t>(K, std::max<int64_t>(KC, blocks > 1 ? K / blocks : 0));
    return std::max<int64_t>(((rows + MR - 1) / MR) * MR * kb, MR * K);
}

// The tree stack of `block` (blocks = P > 1, levels = log2 P, 2^q blocks per k-block): levels < q
// are empty at every k-block's end, so one set of q slots (MR x 32) serves every tile; levels >= q
// live across k-blocks, levels - q slots per (row tile, panel) of the block.
inline int64_t tree_block_elems(int64_t rows, int64_t K, int64_t blocks, int64_t panels) {
    if (blocks <= 1) return 0;
    const int levels = tree_levels(blocks), q = tree_levels(k_block(rows, K, blocks) / (K / blocks));
    const int64_t tiles = (rows + MR - 1) / MR;
    return (int64_t(q) + int64_t(levels - q) * tiles * panels) * MR * PANEL;
}

// Rows [m0, m1) x panels [p0, p1) of one product: k-blocks outermost (the packed A block and the
// B sub-panel stay in cache), then panels, then row tiles. Each output still sees k ascending.
// With blocks > 1, `tree` >= tree_block_elems(m1 - m0, K, blocks, p1 - p0) elements.
template <typename T>
static inline void block(const T* a, int64_t sam, int64_t sak, const Panels<T>& bp, T* c, int64_t ldc,
                         int64_t m0, int64_t m1, int64_t p0, int64_t p1, T* abuf, int64_t blocks = 1,
                         T* tree = nullptr) {
    const int64_t K = bp.K, N = bp.N;
    const int64_t kb = k_block(m1 - m0, K, blocks);
    const int64_t bs = K / blocks, tiles = (m1 - m0 + MR - 1) / MR;
    const int levels = tree_levels(blocks), q = blocks > 1 ? tree_levels(kb / bs) : 0;
    T* slots[64];
    for (int l = 0; l < q; ++l) slots[l] = tree + l * MR * PANEL;
    T* persistent = tree + q * MR * PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t kc = std::min<int64_t>(kb, K - k0);
        const bool first = k0 == 0;
        pack_a<T>(a, sam, sak, m0, m1, k0, kc, abuf);
        for (int64_t p = p0; p < p1; ++p) {
            int64_t ldb;
            const T* bpan = bp.base(p, &ldb) + k0 * ldb;
            const int64_t n0 = p * PANEL;
            const int64_t w = std::min<int64_t>(PANEL, N - n0);
            for (int64_t i = m0; i < m1; i += MR) {
                const int r = int(std::min<int64_t>(MR, m1 - i));
                const T* at = abuf + ((i - m0) / MR) * kc * MR;
                if (blocks > 1) {
                    T* mine = persistent + ((p - p0) * tiles + (i - m0) / MR) * (levels - q) * MR * PANEL;
                    for (int l = q; l < levels; ++l) slots[l] = mine + (l - q) * MR * PANEL;
                    tile_tree<T>(r, w, at, bpan, ldb, bs, k0 / bs, (k0 + kc) / bs, blocks - 1, slots,
                                 c + i * ldc + n0, ldc);
                } else {
                    tile<T>(r, w, at, bpan, ldb, kc, c + i * ldc + n0, ldc, first);
                }
            }
        }
    }
}

}  // namespace gemm
}  // namespace ta
