// lattice.cpp: the two 64-bit lanes of the audit's order-free tensor digest
// (titan_audit/audit/fingerprint.py states the digest and what it detects).
//
// Guarantee: for words x_j (1, 2 or 4 bytes, zero-extended) at global word indices j, the kernel
// adds, modulo 2^64,
//     lane 0 += F0(u_j ^ K0)    lane 1 += F1(u_j ^ K1)
//     u_j = ((j mod 2^32) << 32 | x_j) ^ (floor(j / 2^32) * KH)
// where F0 is MurmurHash3's 64-bit finaliser and F1 splitmix64's (two bijections of 64-bit
// words with independent constants). Integer addition modulo 2^64 is associative and
// commutative, so the lanes do not depend on the order the words are visited in: not on the
// ISA variant, the vector width, the thread count, nor on how a tensor is cut into pieces (the
// lanes of the pieces, added, are the lanes of the whole). Every variant computes the same
// integer function, so every CPU gives the same lanes.
//
// The words come as rows: row r is `run` consecutive words in memory from base + local[r] words
// and at consecutive global indices from global[r]. Threads split the rows' words into
// contiguous ranges, each a partial sum, and the partial sums are added: unlike the float
// kernels (ta_common.h: threads never split a reduction), this reduction is exact integer
// addition, so the split cannot change it. The loop is bound by its 64-bit multiplies (about 5
// GB/s a thread with AVX-512 on the Intel Xeon here); it prefetches the next 1024 words itself,
// which took tensors out of cache from ~2 GB/s to the in-cache speed there.
#include "ta_common.h"

namespace {

constexpr uint64_t K0 = 0x243f6a8885a308d3ull;  // pi's hexadecimal digits: nothing up the sleeve
constexpr uint64_t K1 = 0x13198a2e03707344ull;
constexpr uint64_t KH = 0xa4093822299f31d1ull;  // odd
constexpr int64_t kPrefetchWords = 1024;  // see the header
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

// n words from p at global indices g .. g+n-1, none crossing a multiple of 2^32.
template <typename W>
inline void segment(const W* p, int64_t n, uint64_t g, Lanes& acc) {
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
inline void words(const W* p, int64_t n, uint64_t g, Lanes& acc) {
    while (n > 0) {  // cut at multiples of 2^32 (the high part of the index is constant per piece)
        const uint64_t room = (((g >> 32) + 1) << 32) - g;
        const int64_t take = (uint64_t)n < room ? n : (int64_t)room;
        segment(p, take, g, acc);
        p += take;
        g += take;
        n -= take;
    }
}

// Words [begin, end) of the rows' concatenation.
template <typename W>
void range(const W* base, int64_t run, const int64_t* local, const int64_t* global, int64_t begin, int64_t end,
           Lanes& acc) {
    while (begin < end) {
        const int64_t r = begin / run, c = begin % run;
        const int64_t take = run - c < end - begin ? run - c : end - begin;
        words(base + local[r] + c, take, (uint64_t)global[r] + c, acc);
        begin += take;
    }
}

template <typename W>
void rows(const W* base, int64_t nrows, int64_t run, const int64_t* local, const int64_t* global, int threads,
          uint64_t* lanes) {
    const int64_t total = nrows * run;
    int64_t nt = total / kMinWordsPerThread;
    nt = nt < threads ? nt : threads;
    uint64_t a = 0, b = 0;
    if (nt <= 1) {
        Lanes acc;
        range(base, run, local, global, 0, total, acc);
        a = acc.a, b = acc.b;
    } else {
#pragma omp parallel for num_threads(nt) schedule(static, 1) reduction(+ : a, b)
        for (int64_t t = 0; t < nt; ++t) {
            Lanes acc;
            range(base, run, local, global, total * t / nt, total * (t + 1) / nt, acc);
            a += acc.a;
            b += acc.b;
        }
    }
    lanes[0] += a;
    lanes[1] += b;
}

}  // namespace

// lanes[0..2) += the lanes of `nrows` rows of `run` words of `width` bytes (1, 2 or 4); see the
// header. local[r], global[r]: row r's first word, as an offset from base and as a global index.
TA_EXPORT(void, lattice_rows)(const void* base, int32_t width, int64_t nrows, int64_t run, const int64_t* local,
                              const int64_t* global, int32_t threads, uint64_t* lanes) {
    if (width == 1)
        rows((const uint8_t*)base, nrows, run, local, global, threads, lanes);
    else if (width == 2)
        rows((const uint16_t*)base, nrows, run, local, global, threads, lanes);
    else
        rows((const uint32_t*)base, nrows, run, local, global, threads, lanes);
}
