// gemm.cpp: the batch-invariant gemm (mm, bmm, linear and their backward), fp32 and fp64.
//
// Order: with `blocks` = 1 (v1), C[b, i, j] = one sequential fma chain over k = 0..K-1 ascending,
// starting from +0.0; with `blocks` = P > 1 (a power of two dividing K; v2 uses P(K)) the blocked
// halving tree of ta_gemm.h (P chains over K / P each, combined left + right). Either way whatever
// M, the batch, the thread count, the B layout or the ISA (the building blocks and why are in
// ta_gemm.h). Threads split output tiles (batch x row blocks x panel groups), never k.
//
// Paths (all with that order; which one runs is a speed choice, tested to give the same bits):
//   * B packed in 32-column panels by the caller (a packed-weight cache, ta_gemm_pack_*);
//   * else, with <= 2 rows and a row-major B (column stride 1): B streamed row by row (rows_axpy);
//   * else, with <= 4 * MR rows and a row-major B: full panels read in place, the partial last
//     panel packed; otherwise B packed here per call.
// A is copied per k-block into row tiles (pack_a) from any strides (transposed A needs no copy).
// NaN: every NaN output is stored as the one quiet NaN (ta::canon_nan_f32 / f64), by a pass over
// each task's outputs right after they are computed: which NaN an fma propagates depends on the
// operand order the compiler picks per variant, and an invalid operation (inf * 0) makes a
// negative NaN on x86 and a positive one on arm64 (the kernel battery found both).
#include <cstdlib>
#include <memory>

#include "ta_gemm.h"
#include "ta_math.h"

namespace {

using ta::gemm::num_panels;
using ta::gemm::PANEL;

template <typename T>
struct AlignedBuffer {
    T* ptr = nullptr;
    explicit AlignedBuffer(int64_t n) {
        if (n > 0) ptr = static_cast<T*>(std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64));
    }
    ~AlignedBuffer() { std::free(ptr); }
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

template <typename T>
void pack(const T* b, int64_t batch, int64_t K, int64_t N, int64_t sbb, int64_t sbk, int64_t sbn, T* packed,
          int nthreads) {
    const int64_t np = num_panels(N), per_batch = ta::gemm::packed_elems(K, N);
    ta::parallel_for(batch * np, nthreads, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t bi = t / np, p = t % np;
            ta::gemm::pack_panels<T>(b + bi * sbb, K, N, sbk, sbn, packed + bi * per_batch, p, p + 1);
        }
    });
}

inline float canon(float y) { return ta::canon_nan_f32(y); }
inline double canon(double y) { return ta::canon_nan_f64(y); }

// The canonical NaN over the outputs rows [m0, m1) x columns [n0, n1) of one C (a select per
// element: other values are unchanged).
template <typename T>
void canon_outputs(T* c, int64_t scm, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t i = m0; i < m1; ++i) {
        T* row = c + i * scm;
        for (int64_t j = n0; j < n1; ++j) row[j] = canon(row[j]);
    }
}

#ifndef TA_GEMM_AXPY_ROWS
#define TA_GEMM_AXPY_ROWS 2
#endif
constexpr int64_t AXPY_MAX_ROWS = TA_GEMM_AXPY_ROWS;  // rows_axpy up to this many rows

// Whether to read a row-major B in place rather than pack it: packing pays for itself once the
// panel is reused by enough row tiles (a heuristic; the bits are the same either way).
bool read_in_place(int64_t M, int64_t sbn) { return sbn == 1 && M <= 4 * ta::gemm::MR; }

template <typename T>
void gemm(int64_t batch, int64_t M, int64_t N, int64_t K, const T* a, int64_t sab, int64_t sam, int64_t sak,
          const T* b, int64_t sbb, int64_t sbk, int64_t sbn, const T* packed, T* c, int64_t scb, int64_t scm,
          int nthreads, int64_t blocks) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    // blocks: a power of two dividing K (the Python wrapper checks; anything else means v1)
    if (blocks < 1 || K <= 0 || K % blocks != 0 || (blocks & (blocks - 1)) != 0) blocks = 1;
    if (K <= 0) {
        for (int64_t bi = 0; bi < batch; ++bi)
            for (int64_t i = 0; i < M; ++i)
                for (int64_t j = 0; j < N; ++j) c[bi * scb + i * scm + j] = T(0);
        return;
    }
    if (packed == nullptr && sbn == 1 && M <= AXPY_MAX_ROWS) {
        // few rows, row-major B: stream B row by row (ta::gemm::rows_axpy), column chunks per task
        // one contiguous column range per thread (whole rows of B stream best), at least 256 wide
        const int64_t per_entry = std::max<int64_t>(1, std::min<int64_t>(nthreads / std::max<int64_t>(batch, 1), N / 256));
        const int64_t cols = (((N + per_entry - 1) / per_entry) + 15) / 16 * 16;
        const int64_t chunks = (N + cols - 1) / cols;
        ta::parallel_for(batch * chunks, nthreads, [&](int64_t begin, int64_t end) {
            AlignedBuffer<T> tree(ta::gemm::rows_tree_elems(blocks, M, cols));
            for (int64_t t = begin; t < end; ++t) {
                const int64_t bi = t / chunks, n0 = (t % chunks) * cols;
                ta::gemm::rows_axpy<T>(a + bi * sab, sam, sak, b + bi * sbb, sbk, K, c + bi * scb, scm, M, n0,
                                       std::min<int64_t>(N, n0 + cols), blocks, tree.ptr);
                canon_outputs<T>(c + bi * scb, scm, 0, M, n0, std::min<int64_t>(N, n0 + cols));
            }
        });
        return;
    }
    const int64_t np = num_panels(N), per_batch = ta::gemm::packed_elems(K, N);
    const bool in_place = packed == nullptr && read_in_place(M, sbn);
    const bool tail = N % PANEL != 0;
    AlignedBuffer<T> buffer(packed != nullptr ? 0 : (in_place ? (tail ? batch * K * PANEL : 0) : batch * per_batch));
    if (packed == nullptr && !in_place) {
        pack<T>(b, batch, K, N, sbb, sbk, sbn, buffer.ptr, nthreads);
        packed = buffer.ptr;
    } else if (in_place && tail) {
        ta::parallel_for(batch, nthreads, [&](int64_t begin, int64_t end) {
            for (int64_t bi = begin; bi < end; ++bi) {
                // the last panel alone: a K x N' B starting at column 32 (np - 1), packed as panel 0
                const int64_t n0 = (np - 1) * PANEL;
                ta::gemm::pack_panels<T>(b + bi * sbb + n0 * sbn, K, N - n0, sbk, sbn, buffer.ptr + bi * K * PANEL, 0, 1);
            }
        });
    }
    // Tasks: batch x row blocks x panel groups, with enough tasks to balance the threads.
    const int64_t mb = (M + ta::gemm::MC - 1) / ta::gemm::MC;
    const int64_t rows = (M + mb - 1) / mb;  // balanced row blocks, rounded up to whole tiles
    const int64_t mc = ((rows + ta::gemm::MR - 1) / ta::gemm::MR) * ta::gemm::MR;
    const int64_t m_blocks = (M + mc - 1) / mc;
    int64_t groups = 1;
    if (nthreads > 1) {
        const int64_t want = 8 * int64_t(nthreads);
        const int64_t have = batch * m_blocks;
        if (have < want) groups = std::min<int64_t>(np, (want + have - 1) / have);
    }
    const int64_t tasks = batch * m_blocks * groups;
    ta::parallel_for(tasks, nthreads, [&](int64_t begin, int64_t end) {
        AlignedBuffer<T> abuf(ta::gemm::a_buffer_elems(mc, K, blocks));
        AlignedBuffer<T> tree(ta::gemm::tree_block_elems(mc, K, blocks, (np + groups - 1) / groups));
        for (int64_t t = begin; t < end; ++t) {
            const int64_t g = t % groups, rest = t / groups;
            const int64_t blk = rest % m_blocks, bi = rest / m_blocks;
            const int64_t p0 = np * g / groups, p1 = np * (g + 1) / groups;
            const int64_t m0 = blk * mc, m1 = std::min<int64_t>(M, m0 + mc);
            ta::gemm::Panels<T> src{};
            src.K = K;
            src.N = N;
            if (packed != nullptr) {
                src.packed = packed + bi * per_batch;
            } else {
                src.direct = b + bi * sbb;
                src.ldb = sbk;
                src.packed_tail = tail ? buffer.ptr + bi * K * PANEL : nullptr;
            }
            ta::gemm::block<T>(a + bi * sab, sam, sak, src, c + bi * scb, scm, m0, m1, p0, p1, abuf.ptr, blocks,
                               tree.ptr);
            canon_outputs<T>(c + bi * scb, scm, m0, m1, p0 * PANEL, std::min<int64_t>(N, p1 * PANEL));
        }
    });
}

}  // namespace

// The packed size (elements per batch entry) of a K x N B: ceil(N / 32) * 32 * K.
TA_EXPORT(int64_t, gemm_packed_elems)(int64_t K, int64_t N) { return ta::gemm::packed_elems(K, N); }

// Pack `batch` B matrices (element (k, n) of entry e at b[e * sbb + k * sbk + n * sbn]) into
// `packed` (batch * gemm_packed_elems(K, N) elements).
TA_EXPORT(void, gemm_pack_f32)(const float* b, int64_t batch, int64_t K, int64_t N, int64_t sbb, int64_t sbk,
                               int64_t sbn, float* packed, int nthreads) {
    pack<float>(b, batch, K, N, sbb, sbk, sbn, packed, nthreads);
}
TA_EXPORT(void, gemm_pack_f64)(const double* b, int64_t batch, int64_t K, int64_t N, int64_t sbb, int64_t sbk,
                               int64_t sbn, double* packed, int nthreads) {
    pack<double>(b, batch, K, N, sbb, sbk, sbn, packed, nthreads);
}

// The arguments of one product, as 18 int64 (pointers as integers) so that Python passes one
// pointer: C[e] = A[e] @ B[e] for e < batch, A element (i, k) at a[e * sab + i * sam + k * sak],
// B element (k, n) at b[e * sbb + k * sbk + n * sbn] or, when `packed` is non-zero, B packed by
// gemm_pack_* (batch * gemm_packed_elems(K, N) elements; b is then unused), C element (i, n) at
// c[e * scb + i * scm + n]; `blocks`: the tree's block count P (1 = v1; see ta_gemm.h).
struct GemmArgs {
    int64_t batch, M, N, K;
    int64_t a, sab, sam, sak;
    int64_t b, sbb, sbk, sbn;
    int64_t packed;
    int64_t c, scb, scm;
    int64_t nthreads;
    int64_t blocks;
};
static_assert(sizeof(GemmArgs) == 18 * sizeof(int64_t), "GemmArgs is 18 int64 (cpu/matmul.py packs it so)");

template <typename T>
static void gemm_call(const GemmArgs& g) {
    gemm<T>(g.batch, g.M, g.N, g.K, reinterpret_cast<const T*>(g.a), g.sab, g.sam, g.sak,
            reinterpret_cast<const T*>(g.b), g.sbb, g.sbk, g.sbn, reinterpret_cast<const T*>(g.packed),
            reinterpret_cast<T*>(g.c), g.scb, g.scm, int(g.nthreads), g.blocks);
}

TA_EXPORT(void, gemm_f32)(const GemmArgs* args) { gemm_call<float>(*args); }
TA_EXPORT(void, gemm_f64)(const GemmArgs* args) { gemm_call<double>(*args); }
