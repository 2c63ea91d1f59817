// lattice.cpp: the two 64-bit lanes of the audit's order-free tensor digest
// (titan_audit/audit/fingerprint.py states the digest and what it detects).
//
// Guarantee: for words x_j (1, 2 or 4 bytes, zero-extended to 32 bits) at global word indices j,
// the kernel adds to two lanes, modulo 2^64, one term per word that depends only on (j, x_j):
//   version 2 (blocked; the default): with block b = floor(j / 4096) and offset t = j mod 4096,
//     lane L += B_L(b) * ((x_j ^ X_L) * T_L[t])
//     the inner product exact (32 x 32 -> 64 bits), T_L[t] = low 32 bits of F_L(t ^ KT_L) | 1 and
//     B_L(b) = F_L(b ^ K_L) | 1, both odd;
//   version 1 (mixed; kept to check what was written with it):
//     lane L += F_L(u_j ^ K_L),  u_j = ((j mod 2^32) << 32 | x_j) ^ (floor(j / 2^32) * KH);
// where F_0 is MurmurHash3's 64-bit finaliser and F_1 splitmix64's (two bijections of 64-bit
// words with independent constants). Integer addition modulo 2^64 is associative and
// commutative, and multiplication by B_L(b) distributes over it, so the lanes do not depend on the
// order the words are visited in: not on the ISA variant, the vector width, the thread count, nor
// on how a tensor is cut into pieces (the lanes of the pieces, added, are the lanes of the whole).
// Every variant computes the same integer function, so every CPU gives the same lanes.
//
// Cost: version 1 spends four 64-bit multiplies a word and is bound by them (about 5.5 GB/s a
// thread); version 2 spends two 32 x 32 -> 64-bit multiplies a word on 16 words a vector, with
// the per-block factor applied once per 4096 words, and runs near memory speed. Out of cache a
// hardware prefetcher alone left it latency bound; prefetching 16 KiB ahead into L2 keeps enough
// lines in flight.
//
// The words come as rows: row r is `run` consecutive words in memory from base + local[r] words
// and at consecutive global indices from global[r]. Threads split the rows' words into
// contiguous ranges, each a partial sum, and the partial sums are added: unlike the float
// kernels (ta_common.h: threads never split a reduction), this reduction is exact integer
// addition, so the split cannot change it.
#include "ta_common.h"

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_epi32(), which
// -Wmaybe-uninitialized reports once inlined here; the value is never read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

constexpr uint64_t K0 = 0x243f6a8885a308d3ull;  // pi's hexadecimal digits: nothing up the sleeve
constexpr uint64_t K1 = 0x13198a2e03707344ull;
constexpr uint64_t KH = 0xa4093822299f31d1ull;  // odd
constexpr uint64_t KT0 = 0x082efa98ec4e6c89ull;
constexpr uint64_t KT1 = 0x452821e638d01377ull;
constexpr uint32_t X0 = 0xbe5466cfu;
constexpr uint32_t X1 = 0x34e90c6cu;
constexpr int64_t kBlock = 4096;
constexpr int64_t kPrefetchWords = 1024;  // version 1: into L1, the next 1024 words
constexpr int64_t kPrefetchBytes = 16384;  // version 2: into L2, 16 KiB ahead
constexpr int64_t kMinWordsPerThread = 1 << 18;

// x ^= x >> S1; x *= M1; x ^= x >> S2; x *= M2; x ^= x >> S3: a bijection of 64-bit words.
template <int S1, uint64_t M1, int S2, uint64_t M2, int S3>
inline uint64_t finalise(uint64_t x) {
    x ^= x >> S1;
    x *= M1;
    x ^= x >> S2;
    x *= M2;
    return x ^ (x >> S3);
}

inline uint64_t f0(uint64_t x) { return finalise<33, 0xff51afd7ed558ccdull, 33, 0xc4ceb9fe1a85ec53ull, 33>(x); }  // MurmurHash3 fmix64
inline uint64_t f1(uint64_t x) { return finalise<30, 0xbf58476d1ce4e5b9ull, 27, 0x94d049bb133111ebull, 31>(x); }  // splitmix64's

struct Lanes {
    uint64_t a = 0, b = 0;
};

// ------------------------------------------------------------------ version 1 (mixed)

// n words from p at global indices g .. g+n-1, none crossing a multiple of 2^32.
template <typename W>
inline void mixed_segment(const W* p, int64_t n, uint64_t g, Lanes& acc) {
    const uint64_t high = (g >> 32) * KH;
    const uint32_t low = (uint32_t)g;
    uint64_t a = 0, b = 0;
    for (int64_t s = 0; s < n; s += kPrefetchWords) {
        const int64_t e = s + kPrefetchWords < n ? s + kPrefetchWords : n;
        for (int64_t q = e; q < e + kPrefetchWords && q < n; q += 64 / (int64_t)sizeof(W)) __builtin_prefetch(p + q);
#pragma omp simd reduction(+ : a, b)
        for (int64_t i = s; i < e; ++i) {
            const uint64_t u = (((uint64_t)(uint32_t)(low + (uint32_t)i) << 32) | (uint64_t)p[i]) ^ high;
            a += f0(u ^ K0);
            b += f1(u ^ K1);
        }
    }
    acc.a += a;
    acc.b += b;
}

template <typename W>
inline void mixed_words(const W* p, int64_t n, uint64_t g, Lanes& acc) {
    while (n > 0) {  // cut at multiples of 2^32 (the high part of the index is constant per piece)
        const uint64_t room = (((g >> 32) + 1) << 32) - g;
        const int64_t take = (uint64_t)n < room ? n : (int64_t)room;
        mixed_segment(p, take, g, acc);
        p += take;
        g += take;
        n -= take;
    }
}

// ------------------------------------------------------------------ version 2 (blocked)

// T_0, T_1, padded so that a vector load at any offset below kBlock stays inside.
struct Tables {
    alignas(64) uint32_t t0[kBlock + 32];
    alignas(64) uint32_t t1[kBlock + 32];
    Tables() {
        for (int64_t t = 0; t < kBlock + 32; ++t) {
            t0[t] = t < kBlock ? (uint32_t)f0((uint64_t)t ^ KT0) | 1u : 0u;
            t1[t] = t < kBlock ? (uint32_t)f1((uint64_t)t ^ KT1) | 1u : 0u;
        }
    }
};

const Tables& tables() {
    static const Tables t;  // built once (thread-safe initialisation)
    return t;
}

// One vector of words for the blocked loop below: `kWords` words zero-extended to 32 bits
// (`load`), and `madd`: s += the products (x ^ X) * T of those words and their keys k (even
// positions, then the odd ones shifted down; the odd keys come from the table one word on).
#if defined(TA_ISA_AVX512)
struct Vec {
    using T = __m512i;
    static constexpr int64_t kWords = 16;
    static T zero() { return _mm512_setzero_si512(); }
    static T splat(uint32_t x) { return _mm512_set1_epi32((int)x); }
    static T load(const uint32_t* p) { return _mm512_loadu_si512(p); }
    static T load(const uint16_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
    static T load(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
    static T madd(T s, T x, T xkey, const uint32_t* k) {
        const T y = _mm512_xor_si512(x, xkey);
        s = _mm512_add_epi64(s, _mm512_mul_epu32(y, _mm512_loadu_si512(k)));
        return _mm512_add_epi64(s, _mm512_mul_epu32(_mm512_srli_epi64(y, 32), _mm512_loadu_si512(k + 1)));
    }
    static uint64_t sum(T s) { return _mm512_reduce_add_epi64(s); }
};
#elif defined(TA_ISA_AVX2)
struct Vec {
    using T = __m256i;
    static constexpr int64_t kWords = 8;
    static T zero() { return _mm256_setzero_si256(); }
    static T splat(uint32_t x) { return _mm256_set1_epi32((int)x); }
    static T load(const uint32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
    static T load(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)); }
    static T load(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    static T madd(T s, T x, T xkey, const uint32_t* k) {
        const T y = _mm256_xor_si256(x, xkey);
        s = _mm256_add_epi64(s, _mm256_mul_epu32(y, _mm256_loadu_si256((const __m256i*)k)));
        return _mm256_add_epi64(s, _mm256_mul_epu32(_mm256_srli_epi64(y, 32), _mm256_loadu_si256((const __m256i*)(k + 1))));
    }
    static uint64_t sum(T s) {
        alignas(32) uint64_t l[4];
        _mm256_store_si256((__m256i*)l, s);
        return l[0] + l[1] + l[2] + l[3];
    }
};
#endif

// The whole vectors of n words (keys k0, k1 from the same offset) into s0, s1; returns how many
// words it took (0 on the scalar variant, whose loop below takes them all).
template <typename W>
inline int64_t blocked_vector(const W* p, int64_t n, const uint32_t* k0, const uint32_t* k1, uint64_t& s0, uint64_t& s1) {
#if defined(TA_ISA_AVX512) || defined(TA_ISA_AVX2)
    const Vec::T x0 = Vec::splat(X0), x1 = Vec::splat(X1);
    Vec::T a = Vec::zero(), b = Vec::zero();
    int64_t i = 0;
    for (; i + Vec::kWords <= n; i += Vec::kWords) {
        __builtin_prefetch((const char*)(p + i) + kPrefetchBytes, 0, 1);
        const Vec::T x = Vec::load(p + i);
        a = Vec::madd(a, x, x0, k0 + i);
        b = Vec::madd(b, x, x1, k1 + i);
    }
    s0 += Vec::sum(a);
    s1 += Vec::sum(b);
    return i;
#else
    return 0;
#endif
}

// n words from p at global indices g .. g+n-1 (any n, any g).
template <typename W>
inline void blocked_words(const W* p, int64_t n, uint64_t g, Lanes& acc) {
    const Tables& tab = tables();
    while (n > 0) {  // block by block: B_L(b) multiplies the block's inner sum once
        const uint64_t block = g / kBlock;
        const int64_t offset = (int64_t)(g % kBlock);
        const int64_t take = n < kBlock - offset ? n : kBlock - offset;
        const uint32_t *k0 = tab.t0 + offset, *k1 = tab.t1 + offset;
        uint64_t s0 = 0, s1 = 0;
        for (int64_t i = blocked_vector(p, take, k0, k1, s0, s1); i < take; ++i) {
            s0 += (uint64_t)((uint32_t)p[i] ^ X0) * k0[i];
            s1 += (uint64_t)((uint32_t)p[i] ^ X1) * k1[i];
        }
        acc.a += s0 * (f0(block ^ K0) | 1);
        acc.b += s1 * (f1(block ^ K1) | 1);
        p += take;
        g += take;
        n -= take;
    }
}

// ------------------------------------------------------------------ rows, threads

template <typename W>
inline void words(int version, const W* p, int64_t n, uint64_t g, Lanes& acc) {
    if (version == 1)
        mixed_words(p, n, g, acc);
    else
        blocked_words(p, n, g, acc);
}

// Words [begin, end) of the rows' concatenation.
template <typename W>
void range(int version, const W* base, int64_t run, const int64_t* local, const int64_t* global, int64_t begin,
           int64_t end, Lanes& acc) {
    while (begin < end) {
        const int64_t r = begin / run, c = begin % run;
        const int64_t take = run - c < end - begin ? run - c : end - begin;
        words(version, base + local[r] + c, take, (uint64_t)global[r] + c, acc);
        begin += take;
    }
}

template <typename W>
void rows(int version, const W* base, int64_t nrows, int64_t run, const int64_t* local, const int64_t* global,
          int threads, uint64_t* lanes) {
    const int64_t total = nrows * run;
    int64_t nt = total / kMinWordsPerThread;
    nt = nt < threads ? nt : threads;
    uint64_t a = 0, b = 0;
    if (nt <= 1) {
        Lanes acc;
        range(version, base, run, local, global, 0, total, acc);
        a = acc.a, b = acc.b;
    } else {
        tables();  // built before the threads start
#pragma omp parallel for num_threads(nt) schedule(static, 1) reduction(+ : a, b)
        for (int64_t t = 0; t < nt; ++t) {
            Lanes acc;
            range(version, base, run, local, global, total * t / nt, total * (t + 1) / nt, acc);
            a += acc.a;
            b += acc.b;
        }
    }
    lanes[0] += a;
    lanes[1] += b;
}

}  // namespace

// lanes[0..2) += the `version` (1 or 2) lanes of `nrows` rows of `run` words of `width` bytes
// (1, 2 or 4); see the header. local[r], global[r]: row r's first word, as an offset from base and
// as a global index.
TA_EXPORT(void, lattice_rows)(int32_t version, const void* base, int32_t width, int64_t nrows, int64_t run,
                              const int64_t* local, const int64_t* global, int32_t threads, uint64_t* lanes) {
    if (width == 1)
        rows(version, (const uint8_t*)base, nrows, run, local, global, threads, lanes);
    else if (width == 2)
        rows(version, (const uint16_t*)base, nrows, run, local, global, threads, lanes);
    else
        rows(version, (const uint32_t*)base, nrows, run, local, global, threads, lanes);
}
