// embedding.cpp: the embedding's weight gradient (aten::embedding_dense_backward) in a fixed order.
//
// Guarantee: grad_weight[v] = the sum of grad rows i with indices[i] == v, added one after the
// other in ascending i, starting from +0.0 (float32 accumulation; a row whose index is
// padding_idx or out of [0, V) adds nothing). Each output element is one chain of IEEE adds in
// that order, whatever the thread count or the ISA variant: threads split the vocabulary rows
// (each thread scans all indices in order and adds only the rows it owns), and along D every
// column is its own chain (vector lanes never meet). ATen's CPU version goes through
// index_put_ with accumulate, whose order is whatever its TensorIterator chooses.
#include "ta_common.h"

// out [V, D] = 0, then out[idx[i]] += grad[i] for i = 0 .. n-1 (in that order), float32.
TA_EXPORT(void, embedding_backward_f32)(const float* grad, const int64_t* idx, float* out, int64_t n, int64_t d,
                                        int64_t v, int64_t padding_idx, int threads) {
    ta::parallel_for(v, threads, [&](int64_t v0, int64_t v1) {
        for (int64_t r = v0; r < v1; ++r)
            for (int64_t j = 0; j < d; ++j) out[r * d + j] = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = idx[i];
            if (r < v0 || r >= v1 || r == padding_idx) continue;
            float* dst = out + r * d;
            const float* src = grad + i * d;
            for (int64_t j = 0; j < d; ++j) dst[j] = dst[j] + src[j];
        }
    });
}
