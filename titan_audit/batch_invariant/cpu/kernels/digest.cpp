// digest.cpp: xxh3-128 of many (header, bytes) pairs in one call, on OpenMP threads: the audit's
// fingerprint of a tensor of at most C bytes (titan_audit/audit/fingerprint.py) for a whole batch
// of records.
//
// Guarantee: out[16i .. 16i+16) is XXH3_128bits(header_i || bytes_i) with seed 0 in xxHash's
// canonical (big-endian) form (xxHash 0.8, kernels/xxhash.h, vendored unmodified; XXH3's output
// is frozen since 0.8.0): the bytes whose hex is python-xxhash's
// `xxh3_128(header).update(bytes).hexdigest()`. Every ISA variant computes the same function (xxHash picks its
// vector code at compile time; the result does not depend on it), and threads take whole items
// (largest first, one at a time), so the thread count changes only the speed.
#include <algorithm>
#include <numeric>
#include <vector>

#include "ta_common.h"

#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
// GCC 12 reports its own AVX-512 intrinsics (the `__Y` of _mm512_undefined) as maybe
// uninitialised where xxHash inlines them: a known false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "xxhash.h"
#pragma GCC diagnostic pop

namespace {

constexpr int64_t kMinBytesPerThread = 1 << 18;  // below this a thread costs more than it saves

void one(const uint8_t* header, int64_t header_len, const void* data, int64_t nbytes, uint8_t* out) {
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, header, (size_t)header_len);
    if (nbytes) XXH3_128bits_update(&state, data, (size_t)nbytes);
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
    std::memcpy(out, canonical.digest, sizeof(canonical.digest));
}

}  // namespace

// For i < n: item i is the header headers[header_offsets[i] .. header_offsets[i+1]) followed by
// nbytes[i] bytes at address data[i]; out[16i .. 16i+16) = its xxh3-128, canonical (big-endian).
TA_EXPORT(void, xxh3_128_many)(int64_t n, const uint8_t* headers, const int64_t* header_offsets,
                               const uint64_t* data, const int64_t* nbytes, int32_t threads, uint8_t* out) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += nbytes[i];
    int64_t nt = total / kMinBytesPerThread;
    nt = nt < threads ? nt : threads;
    nt = nt < n ? nt : n;
    if (nt <= 1) {
        for (int64_t i = 0; i < n; ++i)
            one(headers + header_offsets[i], header_offsets[i + 1] - header_offsets[i], (const void*)data[i],
                nbytes[i], out + 16 * i);
        return;
    }
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), int64_t(0));
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return nbytes[a] > nbytes[b]; });
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t k = 0; k < n; ++k) {
        const int64_t i = order[k];
        one(headers + header_offsets[i], header_offsets[i + 1] - header_offsets[i], (const void*)data[i], nbytes[i],
            out + 16 * i);
    }
}

// The statistics kernels of this ISA variant (stats.cpp).
TA_EXPORT(void, absmax_sum_f32)(const float* x, int64_t n, double* state);
TA_EXPORT(void, absmax_sum_bf16)(const uint16_t* x, int64_t n, double* state);
TA_EXPORT(void, absmax_sum_f64)(const double* x, int64_t n, double* state);

// One record of at most C bytes with its statistics: out = xxh3-128 of (header, bytes) as in
// xxh3_128_many, and the statistics kernel `kind` (1: float32, 2: bfloat16, 3: float64) fed the
// same bytes as one piece into `state`. With `threads` >= 2 and at least a quarter of
// kMinBytesPerThread the two run at once, one thread each, each reading the bytes itself, so
// the record takes one trip through the cache hierarchy in wall time instead of two. Neither
// result depends on which thread ran it.
TA_EXPORT(void, xxh3_128_stats)(const uint8_t* header, int64_t header_len, const void* data, int64_t nbytes,
                                int32_t kind, int32_t threads, double* state, uint8_t* out) {
    auto stats = [&] {
        switch (kind) {
            case 1: TA_CAT(ta_absmax_sum_f32, TA_ISA_SUFFIX)((const float*)data, nbytes / 4, state); break;
            case 2: TA_CAT(ta_absmax_sum_bf16, TA_ISA_SUFFIX)((const uint16_t*)data, nbytes / 2, state); break;
            case 3: TA_CAT(ta_absmax_sum_f64, TA_ISA_SUFFIX)((const double*)data, nbytes / 8, state); break;
            default: break;
        }
    };
    if (threads < 2 || nbytes < kMinBytesPerThread / 4) {
        one(header, header_len, data, nbytes, out);
        stats();
        return;
    }
#pragma omp parallel sections num_threads(2)
    {
#pragma omp section
        one(header, header_len, data, nbytes, out);
#pragma omp section
        stats();
    }
}
