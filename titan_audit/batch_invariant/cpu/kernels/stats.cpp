// stats.cpp: absmax and sum of a tensor's elements in one pass over memory, for the audit log's
// informational columns (titan_audit/audit/summary.py: absmax, mean = sum / numel).
//
// Guarantee: for n contiguous elements x[0..n) the result is a fixed sequence of IEEE operations,
// the same bits on every CPU, ISA variant and architecture, and the same whether the elements
// come in one call or in several consecutive calls over pieces whose lengths (all but the last)
// are multiples of TA_STATS_BLOCK (1024), carrying `state` from call to call:
//   * sum (float32 and bfloat16; bfloat16 is widened to float32 exactly): the elements are cut
//     into blocks of 1024 (the last may be shorter). In a block, float32 lane l (of 32) adds the
//     block's elements l, l+32, l+64, ... in ascending order, starting from -0.0f; then float64
//     lane l of `state` adds that float32 lane sum (converted exactly). So every float32 partial
//     sum has at most 32 terms and the rest accumulates in float64. The AVX2 variant holds the
//     32 float32 lanes in four ymm, AVX-512 in two zmm, scalar in an array: the same adds on the
//     same values in the same order. After every call state[33] = the fixed tree over the
//     float64 lanes: s[i] = l[i] + l[i + 16] (i < 16), then `ta::tree16(s)`.
//     float64 input: float64 lane l adds elements l, l+32, ... directly (no blocks), same tree.
//   * NaN: every NaN the state holds after a call (a lane, the absmax, the sum) is the one quiet
//     NaN 0x7ff8000000000000, whatever NaN the data or an invalid add (inf - inf) made.
//   * absmax: max |x| taken on the bit patterns with the sign cleared (for IEEE floats of one
//     format that order is the order of |x|, and every NaN sorts above +inf), so it is exact
//     whatever the order: the largest |x| as float64 (+0.0 for a tensor of zeros, -0.0 counts as
//     0), or NaN when any element is NaN. state[32] carries it from call to call (0.0 for a new
//     tensor; NaN stays NaN).
// One thread: the audit calls it between its hash updates, which are single-threaded too.
#include "ta_common.h"

#include <limits>

#if defined(TA_ISA_AVX512)
// gcc 12 flags the intrinsics' internal _mm512_undefined_*() operands (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define TA_STATS_LANES 32
#define TA_STATS_BLOCK 1024

namespace {

constexpr int kLanes = TA_STATS_LANES;
constexpr int64_t kBlock = TA_STATS_BLOCK;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The fixed tree over the 32 float64 lanes (see the header).
inline double tree32(const double* l) {
    double s[16];
    for (int i = 0; i < 16; ++i) s[i] = l[i] + l[i + 16];
    return ta::tree16(s);
}

inline float f32_from_bits(uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
}

inline uint32_t bits_of(float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

// The end of every call: state[32] := max(state[32], chunk absmax) with NaN sticky (both are
// >= +0.0 or NaN); every NaN lane becomes the one quiet NaN kNaN (which NaN an add returns
// depends on the ISA and on operand order: x86 makes a negative one, arm64 a positive one), and
// state[33] := the tree over the lanes, canonical too.
inline void finish(double* state, double chunk_absmax) {
    const double a = state[32];
    state[32] = (std::isnan(a) || std::isnan(chunk_absmax)) ? kNaN : (chunk_absmax > a ? chunk_absmax : a);
    for (int l = 0; l < kLanes; ++l)
        if (std::isnan(state[l])) state[l] = kNaN;
    const double total = tree32(state);
    state[33] = std::isnan(total) ? kNaN : total;
}

// One element at block offset `off` into float32 lane off % 32 (the portable order; every
// variant's remainder of fewer than 32 elements goes through here).
inline void add_f32(float* fl, int64_t off, float v, uint32_t& m) {
    const uint32_t b = bits_of(v) & 0x7fffffffu;
    m = b > m ? b : m;
    fl[off % kLanes] = fl[off % kLanes] + v;
}

inline void add_bf16(float* fl, int64_t off, uint16_t h, uint32_t& m) {
    const uint32_t b = h & 0x7fffu;
    m = b > m ? b : m;
    fl[off % kLanes] = fl[off % kLanes] + bf16_to_f32(h);
}

// block_*(x, cnt, fl, m): the cnt <= kBlock elements of one block into the float32 lanes fl.

#if defined(TA_ISA_SCALAR)

void block_f32(const float* x, int64_t cnt, float* fl, uint32_t& m) {
    for (int64_t i = 0; i < cnt; ++i) add_f32(fl, i, x[i], m);
}

void block_bf16(const uint16_t* x, int64_t cnt, float* fl, uint32_t& m) {
    for (int64_t i = 0; i < cnt; ++i) add_bf16(fl, i, x[i], m);
}

#elif defined(TA_ISA_AVX2)

inline uint32_t hmax_epu32(__m256i v) {
    alignas(32) uint32_t t[8];
    _mm256_store_si256((__m256i*)t, v);
    uint32_t m = 0;
    for (int k = 0; k < 8; ++k) m = t[k] > m ? t[k] : m;
    return m;
}

// float32 lanes 8k .. 8k+7 in acc[k].
void block_f32(const float* x, int64_t cnt, float* fl, uint32_t& m) {
    __m256 acc[4];
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_loadu_ps(fl + 8 * k);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    __m256i mx[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // two chains (max is exact)
    int64_t i = 0;
    for (; i + kLanes <= cnt; i += kLanes) {
        for (int k = 0; k < 4; ++k) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
            mx[k & 1] = _mm256_max_epu32(mx[k & 1], _mm256_and_si256(_mm256_castps_si256(v), absmask));
            acc[k] = _mm256_add_ps(acc[k], v);
        }
    }
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(fl + 8 * k, acc[k]);
    const uint32_t vm = hmax_epu32(_mm256_max_epu32(mx[0], mx[1]));
    m = vm > m ? vm : m;
    for (; i < cnt; ++i) add_f32(fl, i, x[i], m);
}

void block_bf16(const uint16_t* x, int64_t cnt, float* fl, uint32_t& m) {
    __m256 acc[4];
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_loadu_ps(fl + 8 * k);
    const __m256i absmask = _mm256_set1_epi16(0x7fff);
    __m256i mx = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + kLanes <= cnt; i += kLanes) {
        for (int k = 0; k < 2; ++k) {  // 16 elements: float32 lanes 16k .. 16k+15
            const __m256i h = _mm256_loadu_si256((const __m256i*)(x + i + 16 * k));
            mx = _mm256_max_epu16(mx, _mm256_and_si256(h, absmask));
            const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16);
            const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16);
            acc[2 * k] = _mm256_add_ps(acc[2 * k], _mm256_castsi256_ps(lo));
            acc[2 * k + 1] = _mm256_add_ps(acc[2 * k + 1], _mm256_castsi256_ps(hi));
        }
    }
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(fl + 8 * k, acc[k]);
    alignas(32) uint16_t t[16];
    _mm256_store_si256((__m256i*)t, mx);
    for (int k = 0; k < 16; ++k) m = t[k] > m ? t[k] : m;
    for (; i < cnt; ++i) add_bf16(fl, i, x[i], m);
}

#else  // TA_ISA_AVX512

// float32 lanes 16k .. 16k+15 in acc[k].
void block_f32(const float* x, int64_t cnt, float* fl, uint32_t& m) {
    __m512 acc[2];
    for (int k = 0; k < 2; ++k) acc[k] = _mm512_loadu_ps(fl + 16 * k);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    __m512i mx = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + kLanes <= cnt; i += kLanes) {
        for (int k = 0; k < 2; ++k) {
            const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
            mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_castps_si512(v), absmask));
            acc[k] = _mm512_add_ps(acc[k], v);
        }
    }
    for (int k = 0; k < 2; ++k) _mm512_storeu_ps(fl + 16 * k, acc[k]);
    alignas(64) uint32_t t[16];
    _mm512_store_si512((void*)t, mx);
    for (int k = 0; k < 16; ++k) m = t[k] > m ? t[k] : m;
    for (; i < cnt; ++i) add_f32(fl, i, x[i], m);
}

void block_bf16(const uint16_t* x, int64_t cnt, float* fl, uint32_t& m) {
    __m512 acc[2];
    for (int k = 0; k < 2; ++k) acc[k] = _mm512_loadu_ps(fl + 16 * k);
    const __m512i absmask = _mm512_set1_epi16(0x7fff);
    __m512i mx = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + kLanes <= cnt; i += kLanes) {
        const __m512i h = _mm512_loadu_si512((const void*)(x + i));  // float32 lanes 0 .. 31
        mx = _mm512_max_epu16(mx, _mm512_and_si512(h, absmask));
        const __m512i lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16);
        const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16);
        acc[0] = _mm512_add_ps(acc[0], _mm512_castsi512_ps(lo));
        acc[1] = _mm512_add_ps(acc[1], _mm512_castsi512_ps(hi));
    }
    for (int k = 0; k < 2; ++k) _mm512_storeu_ps(fl + 16 * k, acc[k]);
    alignas(64) uint16_t t[32];
    _mm512_store_si512((void*)t, mx);
    for (int k = 0; k < 32; ++k) m = t[k] > m ? t[k] : m;
    for (; i < cnt; ++i) add_bf16(fl, i, x[i], m);
}

#endif

// Blocks of kBlock elements: float32 lanes per block, then into the float64 lanes of `state`.
template <typename T, typename Block>
void blocked(const T* x, int64_t n, double* state, Block block, uint32_t& m) {
    for (int64_t b = 0; b < n; b += kBlock) {
        float fl[kLanes];
        for (int l = 0; l < kLanes; ++l) fl[l] = -0.0f;
        block(x + b, n - b < kBlock ? n - b : kBlock, fl, m);
        for (int l = 0; l < kLanes; ++l) state[l] = state[l] + (double)fl[l];
    }
}

}  // namespace

// state: 32 float64 lane sums (in/out), [32] absmax so far (in/out), [33] the lanes' tree sum
// (out). A new tensor starts from lanes -0.0 and absmax 0.0. See the header for the order.
TA_EXPORT(void, absmax_sum_f32)(const float* x, int64_t n, double* state) {
    uint32_t m = 0;
    blocked(x, n, state, block_f32, m);
    finish(state, m > 0x7f800000u ? kNaN : (double)f32_from_bits(m));
}

TA_EXPORT(void, absmax_sum_bf16)(const uint16_t* x, int64_t n, double* state) {
    uint32_t m = 0;
    blocked(x, n, state, block_bf16, m);
    finish(state, m > 0x7f80u ? kNaN : (double)bf16_to_f32((uint16_t)m));
}

// float64: float64 lanes directly (portable code in every variant: float64 tensors are rare in a
// training step); absmax on the 63-bit patterns.
TA_EXPORT(void, absmax_sum_f64)(const double* x, int64_t n, double* state) {
    uint64_t m = 0;
    double lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = state[l];
    for (int64_t i = 0; i < n; ++i) {
        uint64_t b;
        std::memcpy(&b, x + i, sizeof b);
        b &= 0x7fffffffffffffffull;
        m = b > m ? b : m;
        lanes[i % kLanes] = lanes[i % kLanes] + x[i];
    }
    for (int l = 0; l < kLanes; ++l) state[l] = lanes[l];
    double a;
    std::memcpy(&a, &m, sizeof a);
    finish(state, m > 0x7ff0000000000000ull ? kNaN : a);
}
