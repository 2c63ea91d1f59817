// battery.cpp: the kernel battery. Runs every exported kernel of every ISA variant linked into
// this program on a fixed set of inputs and writes the raw output bytes; titan_audit.portability
// hashes them (xxh3-128) and compares with tests/golden/kernels.json. No torch, no Python.
//
// Guarantee: the inputs are a function of the case name alone, made by integer arithmetic
// (splitmix64 seeded by the FNV-1a hash of the case name, turned into float bit patterns or into
// floats by exact integer-to-float conversions and one IEEE multiply-add, compiled with
// -ffp-contract=off), so every CPU, ISA and architecture runs the kernels on the same bytes.
// What a kernel writes is then what the golden pins: one hash per (kernel, case) that every
// variant and thread count must reproduce.
//
// Output (stdout, or the file of -o): the line "TABATTERY 1", then per record a line
//   "R <kernel> <case> <variant> <threads> <dtype> <count>"  (dtype: f32, f64, i64; threads 0 =
//   the kernel takes no thread count), then count * sizeof(dtype) raw little-endian bytes; at the
//   end "END <records>". Records of one case come together (every variant, then threads 1, 2).
// Options: --variants (print the variants this CPU can run and exit), --isa a,b (a subset),
//   --threads 1,2, --only PREFIX (cases whose "kernel/case" starts with PREFIX), --list, -o FILE.
// The x86 build links the scalar, avx2 and avx512 objects and runs those the CPU supports; any
// other architecture (arm64: make battery-aarch64) links the scalar objects only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && !defined(TA_BATTERY_SCALAR_ONLY)
#define TA_BATTERY_X86 1
#endif

// ---------------------------------------------------------------- the kernels (ta_<name>__<isa>)

#define TA_DECLARE(isa)                                                                                          \
    extern "C" {                                                                                                 \
    int ta_kernels_version__##isa();                                                                             \
    int64_t ta_gemm_packed_elems__##isa(int64_t, int64_t);                                                       \
    void ta_gemm_f32__##isa(const int64_t*);                                                                     \
    void ta_gemm_f64__##isa(const int64_t*);                                                                     \
    void ta_gemm_pack_f32__##isa(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*, int); \
    void ta_gemm_pack_f64__##isa(const double*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double*,   \
                                 int);                                                                           \
    int ta_attention_key_chunk__##isa();                                                                         \
    void ta_attention_fwd_f32__##isa(const int64_t*, const float*, const float*, const float*, const int64_t*,   \
                                     const int64_t*, const uint8_t*, float, float*, float*, int);                \
    void ta_attention_fwd_f64__##isa(const int64_t*, const double*, const double*, const double*,                \
                                     const int64_t*, const int64_t*, const uint8_t*, double, double*, double*,   \
                                     int);                                                                       \
    void ta_attention_bwd_f32__##isa(const int64_t*, const float*, const float*, const float*, const float*,     \
                                     const float*, const float*, const int64_t*, const int64_t*, const uint8_t*, \
                                     float, float, float*, float*, float*, int);                                 \
    void ta_attention_bwd_f64__##isa(const int64_t*, const double*, const double*, const double*, const double*, \
                                     const double*, const double*, const int64_t*, const int64_t*,               \
                                     const uint8_t*, double, double, double*, double*, double*, int);            \
    TA_DECLARE_ROWOPS(isa, float, f32)                                                                           \
    TA_DECLARE_ROWOPS(isa, double, f64)                                                                          \
    void ta_exp_f32__##isa(const float*, float*, int64_t, int);                                                  \
    void ta_exp2_f32__##isa(const float*, float*, int64_t, int);                                                 \
    void ta_log_f32__##isa(const float*, float*, int64_t, int);                                                  \
    void ta_sqrt_f32__##isa(const float*, float*, int64_t, int);                                                 \
    void ta_sigmoid_f32__##isa(const float*, float*, int64_t, int);                                              \
    void ta_silu_f32__##isa(const float*, float*, int64_t, int);                                                 \
    void ta_sigmoid_backward_f32__##isa(const float*, const float*, float*, int64_t, int);                       \
    void ta_silu_backward_f32__##isa(const float*, const float*, float*, int64_t, int);                          \
    void ta_silu_mul_f32__##isa(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int);    \
    void ta_silu_mul_backward_f32__##isa(const float*, const float*, const float*, float*, float*, int64_t,     \
                                         int64_t, int64_t, int64_t, int);                                    \
    void ta_exp_f64__##isa(const double*, double*, int64_t, int);                                                \
    void ta_log_f64__##isa(const double*, double*, int64_t, int);                                                \
    void ta_sqrt_f64__##isa(const double*, double*, int64_t, int);                                               \
    void ta_normal_from_bits__##isa(const uint32_t*, float*, int64_t, float, float);                             \
    void ta_cos_sin_f32__##isa(const float*, float*, float*, int64_t, int);                                      \
    void ta_rope_inv_freq_f32__##isa(double, int64_t, float*);                                                   \
    void ta_embedding_backward_f32__##isa(const float*, const int64_t*, float*, int64_t, int64_t, int64_t, int64_t, \
                                          int);                                                                  \
    void ta_adamw_step_f32__##isa(float*, const float*, float*, float*, int64_t, double, double, double, double,   \
                                  double, double, double, double, int);                                          \
    void ta_absmax_sum_f32__##isa(const float*, int64_t, double*);                                               \
    void ta_absmax_sum_bf16__##isa(const uint16_t*, int64_t, double*);                                           \
    void ta_absmax_sum_f64__##isa(const double*, int64_t, double*);                                              \
    }

#define TA_DECLARE_ROWOPS(isa, T, sfx)                                                                           \
    void ta_row_sum_##sfx##__##isa(const T*, T*, int64_t, int64_t, int);                                         \
    void ta_row_sum_sq_##sfx##__##isa(const T*, T*, int64_t, int64_t, int);                                      \
    void ta_col_sum_##sfx##__##isa(const T*, T*, int64_t, int64_t, int);                                         \
    void ta_col_sum_sq_##sfx##__##isa(const T*, T*, int64_t, int64_t, int);                                      \
    void ta_rms_norm_scaled_backward_##sfx##__##isa(const T*, const T*, const T*, const T*, T*, T*, int64_t,       \
                                                    int64_t, int);                                               \
    void ta_softmax_##sfx##__##isa(const T*, T*, int64_t, int64_t, int);                                         \
    void ta_log_softmax_##sfx##__##isa(const T*, T*, int64_t, int64_t, int);                                     \
    void ta_softmax_backward_##sfx##__##isa(const T*, const T*, T*, int64_t, int64_t, int);                      \
    void ta_log_softmax_backward_##sfx##__##isa(const T*, const T*, T*, int64_t, int64_t, int);                  \
    void ta_rms_norm_##sfx##__##isa(const T*, const T*, T*, T*, int64_t, int64_t, double, int);                  \
    void ta_rms_norm_backward_##sfx##__##isa(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t, int); \
    void ta_add_rms_norm_##sfx##__##isa(const T*, const T*, const T*, T*, T*, int64_t, int64_t, double, int);     \
    void ta_rms_norm_rope_##sfx##__##isa(const T*, const T*, const T*, const T*, T*, int64_t, int64_t, int64_t,   \
                                         int64_t, int64_t, double, int);

template <typename T>
struct RowOps {
    void (*row_sum)(const T*, T*, int64_t, int64_t, int);
    void (*row_sum_sq)(const T*, T*, int64_t, int64_t, int);
    void (*col_sum)(const T*, T*, int64_t, int64_t, int);
    void (*col_sum_sq)(const T*, T*, int64_t, int64_t, int);
    void (*rms_norm_scaled_backward)(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t, int);
    void (*softmax)(const T*, T*, int64_t, int64_t, int);
    void (*log_softmax)(const T*, T*, int64_t, int64_t, int);
    void (*softmax_backward)(const T*, const T*, T*, int64_t, int64_t, int);
    void (*log_softmax_backward)(const T*, const T*, T*, int64_t, int64_t, int);
    void (*rms_norm)(const T*, const T*, T*, T*, int64_t, int64_t, double, int);
    void (*rms_norm_backward)(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t, int);
    void (*add_rms_norm)(const T*, const T*, const T*, T*, T*, int64_t, int64_t, double, int);
    void (*rms_norm_rope)(const T*, const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          double, int);
};

template <typename T>
struct Gemm {
    void (*gemm)(const int64_t*);
    void (*pack)(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, T*, int);
};

template <typename T>
struct Attention {
    void (*fwd)(const int64_t*, const T*, const T*, const T*, const int64_t*, const int64_t*, const uint8_t*, T, T*,
                T*, int);
    void (*bwd)(const int64_t*, const T*, const T*, const T*, const T*, const T*, const T*, const int64_t*,
                const int64_t*, const uint8_t*, T, T, T*, T*, T*, int);
};

using Unary32 = void (*)(const float*, float*, int64_t, int);
using Binary32 = void (*)(const float*, const float*, float*, int64_t, int);
using Unary64 = void (*)(const double*, double*, int64_t, int);

struct Variant {
    const char* name;
    int (*version)();
    int64_t (*packed_elems)(int64_t, int64_t);
    int (*key_chunk)();
    Gemm<float> gemm32;
    Gemm<double> gemm64;
    Attention<float> att32;
    Attention<double> att64;
    RowOps<float> row32;
    RowOps<double> row64;
    Unary32 exp32, exp2_32, log32, sqrt32, sigmoid32, silu32;
    Binary32 sigmoid_backward32, silu_backward32;
    Unary64 exp64, log64, sqrt64;
    void (*normal_from_bits)(const uint32_t*, float*, int64_t, float, float);
    void (*cos_sin)(const float*, float*, float*, int64_t, int);
    void (*rope_inv_freq)(double, int64_t, float*);
    void (*embedding_backward)(const float*, const int64_t*, float*, int64_t, int64_t, int64_t, int64_t, int);
    void (*adamw_step)(float*, const float*, float*, float*, int64_t, double, double, double, double, double, double,
                       double, double, int);
    void (*absmax_sum_f32)(const float*, int64_t, double*);
    void (*absmax_sum_bf16)(const uint16_t*, int64_t, double*);
    void (*absmax_sum_f64)(const double*, int64_t, double*);
    void (*silu_mul32)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int);
    void (*silu_mul_backward32)(const float*, const float*, const float*, float*, float*, int64_t, int64_t, int64_t,
                                int64_t, int);
};

#define TA_ROWOPS_OF(isa, sfx)                                                                                   \
    {ta_row_sum_##sfx##__##isa, ta_row_sum_sq_##sfx##__##isa, ta_col_sum_##sfx##__##isa,                          \
     ta_col_sum_sq_##sfx##__##isa, ta_rms_norm_scaled_backward_##sfx##__##isa, ta_softmax_##sfx##__##isa, ta_log_softmax_##sfx##__##isa,                        \
     ta_softmax_backward_##sfx##__##isa, ta_log_softmax_backward_##sfx##__##isa, ta_rms_norm_##sfx##__##isa,      \
     ta_rms_norm_backward_##sfx##__##isa, ta_add_rms_norm_##sfx##__##isa,                  \
     ta_rms_norm_rope_##sfx##__##isa}

#define TA_VARIANT(isa)                                                                                          \
    Variant{#isa, ta_kernels_version__##isa, ta_gemm_packed_elems__##isa, ta_attention_key_chunk__##isa,          \
            {ta_gemm_f32__##isa, ta_gemm_pack_f32__##isa}, {ta_gemm_f64__##isa, ta_gemm_pack_f64__##isa},         \
            {ta_attention_fwd_f32__##isa, ta_attention_bwd_f32__##isa},                                          \
            {ta_attention_fwd_f64__##isa, ta_attention_bwd_f64__##isa}, TA_ROWOPS_OF(isa, f32),                   \
            TA_ROWOPS_OF(isa, f64), ta_exp_f32__##isa, ta_exp2_f32__##isa, ta_log_f32__##isa, ta_sqrt_f32__##isa,  \
            ta_sigmoid_f32__##isa, ta_silu_f32__##isa, ta_sigmoid_backward_f32__##isa, ta_silu_backward_f32__##isa, \
            ta_exp_f64__##isa, ta_log_f64__##isa, ta_sqrt_f64__##isa, ta_normal_from_bits__##isa,                \
            ta_cos_sin_f32__##isa, ta_rope_inv_freq_f32__##isa, ta_embedding_backward_f32__##isa,                \
            ta_adamw_step_f32__##isa, ta_absmax_sum_f32__##isa, ta_absmax_sum_bf16__##isa,                        \
            ta_absmax_sum_f64__##isa, ta_silu_mul_f32__##isa, ta_silu_mul_backward_f32__##isa}

TA_DECLARE(scalar)
#if defined(TA_BATTERY_X86)
TA_DECLARE(avx2)
TA_DECLARE(avx512)
extern "C" int ta_cpu_supports_avx2();
extern "C" int ta_cpu_supports_avx512();
#endif

static std::vector<Variant> all_variants() {
    std::vector<Variant> v{TA_VARIANT(scalar)};
#if defined(TA_BATTERY_X86)
    if (ta_cpu_supports_avx2()) v.push_back(TA_VARIANT(avx2));
    if (ta_cpu_supports_avx512()) v.push_back(TA_VARIANT(avx512));
#endif
    return v;
}

// ---------------------------------------------------------------- inputs from integers

namespace {

struct Rng {  // splitmix64
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    uint32_t next32() { return (uint32_t)(next() >> 32); }
    uint64_t below(uint64_t n) { return next() % n; }
};

uint64_t fnv1a(const std::string& s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

float f32_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
double f64_of(uint64_t u) { double f; std::memcpy(&f, &u, 8); return f; }

// Bit patterns every floating case may meet: zeros, infinities, quiet / signalling NaNs with
// payloads and both signs, the subnormal and normal extremes, and the edges of exp / log / sqrt.
const uint32_t kSpecial32[] = {
    0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7fa00001u, 0xffc12345u,
    0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu, 0x00800000u, 0x80800000u, 0x7f7fffffu, 0xff7fffffu,
    0x3f800000u, 0xbf800000u, 0x3f800001u, 0x3f7fffffu, 0x42b17218u, 0x42b17217u, 0xc2aeac50u, 0xc2cff1b5u,
    0xc2dc0000u, 0x43000000u, 0xc3160000u, 0x4b000000u, 0x5f000000u, 0x1e3ce508u, 0x7e967699u, 0x3fb504f3u,
    0x3f3504f3u, 0x40490fdbu, 0xc0490fdbu, 0x47800000u, 0x4f000000u, 0x00400000u, 0x34000000u, 0x33800000u,
};
const uint64_t kSpecial64[] = {
    0x0000000000000000ull, 0x8000000000000000ull, 0x7ff0000000000000ull, 0xfff0000000000000ull,
    0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff4000000000001ull, 0xfff8000000012345ull,
    0x0000000000000001ull, 0x8000000000000001ull, 0x000fffffffffffffull, 0x0010000000000000ull,
    0x7fefffffffffffffull, 0xffefffffffffffffull, 0x3ff0000000000000ull, 0xbff0000000000000ull,
    0x3ff0000000000001ull, 0x3fefffffffffffffull, 0x40862e42fefa39efull, 0x40862e42fefa39f0ull,
    0x4086300000000000ull, 0xc086232bdd7abcd2ull, 0xc0874910d52d3051ull, 0xc0874910d52d3052ull,
    0xc087500000000000ull, 0x3ff6a09e667f3bcdull, 0x3fe6a09e667f3bcdull, 0x4330000000000000ull,
    0x43e0000000000000ull, 0x01a56e1fc2f8f359ull, 0x7e37e43c8800759cull, 0x3ee4f8b588e368f1ull,
    0x400921fb54442d18ull, 0x3cb0000000000000ull,
};
constexpr int kNumSpecial32 = sizeof(kSpecial32) / sizeof(kSpecial32[0]);
constexpr int kNumSpecial64 = sizeof(kSpecial64) / sizeof(kSpecial64[0]);

template <typename T> T from_bits(Rng& r);
template <> float from_bits<float>(Rng& r) { return f32_of(r.next32()); }
template <> double from_bits<double>(Rng& r) { return f64_of(r.next()); }
template <typename T> T special(int i);
template <> float special<float>(int i) { return f32_of(kSpecial32[i % kNumSpecial32]); }
template <> double special<double>(int i) { return f64_of(kSpecial64[i % kNumSpecial64]); }
template <typename T> int num_special() { return std::is_same<T, float>::value ? kNumSpecial32 : kNumSpecial64; }

// Uniform in [lo, hi): 24 (float) or 53 (double) random bits, exactly converted and scaled by a
// power of two, then lo + u * (hi - lo): two correctly rounded IEEE operations.
template <typename T>
T uniform(Rng& r, T lo, T hi) {
    const int bits = std::is_same<T, float>::value ? 24 : 53;
    const T u = (T)(int64_t)(r.next() >> (64 - bits)) * (T)std::ldexp(1.0, -bits);
    return lo + u * (hi - lo);
}

enum Kind {
    kUniform,   // uniform in [lo, hi)
    kSpecials,  // uniform, with about one element in 8 replaced by a special pattern
    kBits,      // every bit pattern (all exponents, subnormals, infinities, NaNs)
};

template <typename T>
std::vector<T> values(Rng& r, int64_t n, Kind kind, T lo = T(-1), T hi = T(1)) {
    std::vector<T> v(n);
    for (int64_t i = 0; i < n; ++i) {
        if (kind == kBits) {
            v[i] = from_bits<T>(r);
        } else {
            v[i] = uniform<T>(r, lo, hi);
            if (kind == kSpecials && r.below(8) == 0) v[i] = special<T>((int)r.below(num_special<T>()));
        }
    }
    return v;
}

// The specials in order, then the rest of n from `kind`.
template <typename T>
std::vector<T> with_specials(Rng& r, int64_t n, Kind kind, T lo, T hi) {
    std::vector<T> v = values<T>(r, n, kind, lo, hi);
    for (int i = 0; i < num_special<T>() && i < n; ++i) v[i] = special<T>(i);
    return v;
}

// ---------------------------------------------------------------- output records

FILE* g_out = nullptr;
int64_t g_records = 0;

template <typename T> const char* dtype_name();
template <> const char* dtype_name<float>() { return "f32"; }
template <> const char* dtype_name<double>() { return "f64"; }
template <> const char* dtype_name<int64_t>() { return "i64"; }

struct Sink {
    std::string kernel, kase;
    const char* variant;
    int threads;
    template <typename T>
    void emit(const std::string& part, const T* data, int64_t count) const {
        std::string name = part.empty() ? kase : kase + "." + part;
        std::fprintf(g_out, "R %s %s %s %d %s %lld\n", kernel.c_str(), name.c_str(), variant, threads, dtype_name<T>(),
                     (long long)count);
        if (count) std::fwrite(data, sizeof(T), (size_t)count, g_out);
        ++g_records;
    }
    template <typename T>
    void emit(const std::string& part, const std::vector<T>& v) const { emit(part, v.data(), (int64_t)v.size()); }
};

struct Case {
    std::string kernel, name;
    bool threaded;  // the kernel takes a thread count: run at threads 1 and 2
    std::function<void(const Variant&, int, const Sink&)> run;
};

std::vector<Case> g_cases;
const Variant* g_scalar = nullptr;  // for inputs that are a kernel's output (backward passes)

Rng rng_for(const std::string& kernel, const std::string& name) { return Rng{fnv1a(kernel + "/" + name)}; }

void add(const std::string& kernel, const std::string& name, bool threaded,
         std::function<void(const Variant&, int, const Sink&)> run) {
    g_cases.push_back(Case{kernel, name, threaded, std::move(run)});
}

// ---------------------------------------------------------------- gemm

template <typename T> const Gemm<T>& gemm_of(const Variant& v);
template <> const Gemm<float>& gemm_of<float>(const Variant& v) { return v.gemm32; }
template <> const Gemm<double>& gemm_of<double>(const Variant& v) { return v.gemm64; }

enum BLayout { kRowMajor, kTransposed, kPacked };

// C[batch, M, N] = A[batch, M, K] @ B[batch, K, N]; B row-major, as W.t() of a row-major [N, K]
// (nn.Linear), or packed first by gemm_pack (the packed-weight cache's path; the packed
// buffer is a record of its own).
// blocks > 1: the tree order (v2) with that many blocks; the case name says `_treeP`.
template <typename T>
void gemm_case(const std::string& sfx, int64_t batch, int64_t M, int64_t K, int64_t N, BLayout layout, Kind kind,
               int64_t blocks = 1) {
    const char* lay = layout == kRowMajor ? "rowmajor" : (layout == kTransposed ? "wt" : "packed");
    const std::string name = "b" + std::to_string(batch) + "_m" + std::to_string(M) + "_k" + std::to_string(K) +
                             "_n" + std::to_string(N) + "_" + lay + (kind == kSpecials ? "_special" : "") +
                             (blocks > 1 ? "_tree" + std::to_string(blocks) : "");
    const std::string kernel = "gemm_" + sfx;
    add(kernel, name, true, [=](const Variant& v, int threads, const Sink& out) {
        Rng r = rng_for(kernel, name);
        const std::vector<T> a = values<T>(r, batch * M * K, kind);
        const std::vector<T> b = values<T>(r, batch * K * N, kind);
        std::vector<T> c(batch * M * N, T(7));
        std::vector<T> packed;
        int64_t sbk = N, sbn = 1;
        if (layout == kTransposed) sbk = 1, sbn = K;  // element (k, n) of W.t() at n * K + k
        int64_t packed_ptr = 0;
        if (layout == kPacked) {
            const int64_t per = v.packed_elems(K, N);
            packed.assign(batch * per, T(7));
            gemm_of<T>(v).pack(b.data(), batch, K, N, K * N, sbk, sbn, packed.data(), threads);
            packed_ptr = (int64_t)(intptr_t)packed.data();
        }
        const int64_t args[18] = {batch, M, N, K, (int64_t)(intptr_t)a.data(), M * K, K, 1,
                                  (int64_t)(intptr_t)b.data(), K * N, sbk, sbn, packed_ptr,
                                  (int64_t)(intptr_t)c.data(), M * N, N, threads, blocks};
        gemm_of<T>(v).gemm(args);
        out.emit("", c);
        if (layout == kPacked) out.emit("pack", packed);
    });
}

// ---------------------------------------------------------------- attention

template <typename T> const Attention<T>& att_of(const Variant& v);
template <> const Attention<float>& att_of<float>(const Variant& v) { return v.att32; }
template <> const Attention<double>& att_of<double>(const Variant& v) { return v.att64; }

struct AttShape {
    const char* name;
    int64_t B, Hq, Hkv, Tq, Tk, D, Dv;
    bool causal;
    int64_t first_pos;  // query i is at position first_pos + i
    bool docs, mask;
    Kind kind;
};

template <typename T>
void attention_case(const std::string& sfx, const AttShape s) {
    struct Inputs {
        std::vector<T> q, k, v, g;
        std::vector<int64_t> prob, pos, doc;
        std::vector<uint8_t> mask;
        T sscale, scale;
    };
    const std::string name = s.name;
    auto make = [s](const std::string& kernel) {
        Rng r = rng_for(kernel, s.name);
        Inputs in;
        in.q = values<T>(r, s.B * s.Hq * s.Tq * s.D, s.kind);
        in.k = values<T>(r, s.B * s.Hkv * s.Tk * s.D, s.kind);
        in.v = values<T>(r, s.B * s.Hkv * s.Tk * s.Dv, s.kind);
        in.g = values<T>(r, s.B * s.Hq * s.Tq * s.Dv, kUniform);
        for (int64_t b = 0; b < s.B; ++b)
            for (int64_t i = 0; i < s.Tq; ++i) in.pos.push_back(s.first_pos + i);
        if (s.docs) {  // a padding prefix (doc -1), then documents of 1 to 40 tokens
            for (int64_t b = 0; b < s.B; ++b) {
                int64_t t = 0, doc = 0;
                for (; t < (b == 0 ? 0 : 3) && t < s.Tk; ++t) in.doc.push_back(-1);
                while (t < s.Tk) {
                    const int64_t len = 1 + (int64_t)r.below(40);
                    for (int64_t j = 0; j < len && t < s.Tk; ++j, ++t) in.doc.push_back(doc);
                    ++doc;
                }
            }
        }
        if (s.mask) {  // [B, 1, Tq, Tk] "may attend", about 3 in 4 true; query row 1 sees no key
            for (int64_t b = 0; b < s.B; ++b)
                for (int64_t i = 0; i < s.Tq; ++i)
                    for (int64_t j = 0; j < s.Tk; ++j) in.mask.push_back(i == 1 ? 0 : (r.below(4) != 0));
        }
        const int64_t ms[4] = {s.mask ? s.Tq * s.Tk : 0, 0, s.mask ? s.Tk : 0, s.mask ? 1 : 0};
        in.prob = {s.B, s.Hq, s.Hkv, s.Tq, s.Tk, s.D, s.Dv, s.causal ? 1 : 0,
                   s.Hq * s.Tq * s.D, s.Tq * s.D, s.D, s.Hkv * s.Tk * s.D, s.Tk * s.D, s.D,
                   s.Hkv * s.Tk * s.Dv, s.Tk * s.Dv, s.Dv, ms[0], ms[1], ms[2], ms[3]};
        in.scale = T(1) / std::sqrt(T(s.D));
        in.sscale = std::is_same<T, float>::value ? in.scale * T(1.4426950408889634) : in.scale;
        return in;
    };
    auto fwd = [s](const Variant& v, const Inputs& in, int threads, std::vector<T>& out, std::vector<T>& lse) {
        out.assign(s.B * s.Hq * s.Tq * s.Dv, T(7));
        lse.assign(s.B * s.Hq * s.Tq, T(7));
        att_of<T>(v).fwd(in.prob.data(), in.q.data(), in.k.data(), in.v.data(), in.pos.data(),
                         s.docs ? in.doc.data() : nullptr, s.mask ? in.mask.data() : nullptr, in.sscale, out.data(),
                         lse.data(), threads);
    };
    const std::string kf = "attention_fwd_" + sfx, kb = "attention_bwd_" + sfx;
    add(kf, name, true, [=](const Variant& v, int threads, const Sink& sink) {
        const Inputs in = make(kf);
        std::vector<T> out, lse;
        fwd(v, in, threads, out, lse);
        sink.emit("out", out);
        sink.emit("lse", lse);
    });
    add(kb, name, true, [=](const Variant& v, int threads, const Sink& sink) {
        const Inputs in = make(kf);  // the forward's inputs; out and lse from the scalar forward
        std::vector<T> out, lse;
        fwd(*g_scalar, in, 1, out, lse);
        std::vector<T> dq(s.B * s.Hq * s.Tq * s.D, T(7)), dk(s.B * s.Hkv * s.Tk * s.D, T(7)),
            dv(s.B * s.Hkv * s.Tk * s.Dv, T(7));
        att_of<T>(v).bwd(in.prob.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), out.data(), lse.data(),
                         in.pos.data(), s.docs ? in.doc.data() : nullptr, s.mask ? in.mask.data() : nullptr,
                         in.sscale, in.scale, dq.data(), dk.data(), dv.data(), threads);
        sink.emit("dq", dq);
        sink.emit("dk", dk);
        sink.emit("dv", dv);
    });
}

// ---------------------------------------------------------------- row ops

template <typename T> const RowOps<T>& row_of(const Variant& v);
template <> const RowOps<float>& row_of<float>(const Variant& v) { return v.row32; }
template <> const RowOps<double>& row_of<double>(const Variant& v) { return v.row64; }

// Each row op on an m x n matrix; a `_special` matrix also holds rows of -inf, of +inf and -inf,
// with a NaN, of subnormals and of huge values (x^2 overflows), and a row of +-0.
template <typename T>
void rowops_case(const std::string& sfx, int64_t m, int64_t n, Kind kind, T lo, T hi) {
    const std::string name = "m" + std::to_string(m) + "_n" + std::to_string(n) +
                             (kind == kSpecials ? "_special" : (kind == kBits ? "_bits" : ""));
    auto make = [=](const std::string& kernel) {
        Rng r = rng_for("rowops_" + sfx, name);
        std::vector<T> x = values<T>(r, m * n, kind, lo, hi), g = values<T>(r, m * n, kUniform),
                       w = values<T>(r, n, kUniform, T(0.5), T(1.5));
        if (kind == kSpecials) {
            const T inf = std::numeric_limits<T>::infinity(), rows[6][3] = {
                {-inf, -inf, -inf}, {inf, -inf, T(1)}, {std::numeric_limits<T>::quiet_NaN(), T(0), T(1)},
                {std::numeric_limits<T>::denorm_min(), -std::numeric_limits<T>::denorm_min() * T(5), T(0)},
                {std::numeric_limits<T>::max(), T(-1e30), std::numeric_limits<T>::max() / T(3)},
                {T(0), T(-0.0), T(-0.0)}};
            for (int64_t i = 0; i < m && i < 6; ++i)
                for (int64_t j = 0; j < n; ++j) x[i * n + j] = rows[i][j % 3];
        }
        (void)kernel;
        return std::vector<std::vector<T>>{x, g, w};
    };
    auto reg = [&](const std::string& op, std::function<void(const Variant&, int, const Sink&, const std::vector<std::vector<T>>&)> f) {
        const std::string kernel = op + "_" + sfx;
        add(kernel, name, true, [=](const Variant& v, int threads, const Sink& sink) { f(v, threads, sink, make(kernel)); });
    };
    reg("row_sum", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m, T(7));
        row_of<T>(v).row_sum(in[0].data(), y.data(), m, n, t);
        sink.emit("", y);
    });
    reg("row_sum_sq", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m, T(7));
        row_of<T>(v).row_sum_sq(in[0].data(), y.data(), m, n, t);
        sink.emit("", y);
    });
    reg("col_sum", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(n, T(7)), y2(n, T(7));
        row_of<T>(v).col_sum(in[0].data(), y.data(), m, n, t);
        row_of<T>(v).col_sum_sq(in[0].data(), y2.data(), m, n, t);
        sink.emit("sum", y);
        sink.emit("sum_sq", y2);
    });
    reg("softmax", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n, T(7));
        row_of<T>(v).softmax(in[0].data(), y.data(), m, n, t);
        sink.emit("", y);
    });
    reg("log_softmax", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n, T(7));
        row_of<T>(v).log_softmax(in[0].data(), y.data(), m, n, t);
        sink.emit("", y);
    });
    reg("softmax_backward", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n), out(m * n, T(7));
        row_of<T>(*g_scalar).softmax(in[0].data(), y.data(), m, n, 1);
        row_of<T>(v).softmax_backward(in[1].data(), y.data(), out.data(), m, n, t);
        sink.emit("", out);
    });
    reg("log_softmax_backward", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n), out(m * n, T(7));
        row_of<T>(*g_scalar).log_softmax(in[0].data(), y.data(), m, n, 1);
        row_of<T>(v).log_softmax_backward(in[1].data(), y.data(), out.data(), m, n, t);
        sink.emit("", out);
    });
    reg("rms_norm", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n, T(7)), rstd(m, T(7)), y0(m * n, T(7)), rstd0(m, T(7));
        row_of<T>(v).rms_norm(in[0].data(), in[2].data(), y.data(), rstd.data(), m, n, 1e-6, t);
        row_of<T>(v).rms_norm(in[0].data(), nullptr, y0.data(), rstd0.data(), m, n, 1e-5, t);
        sink.emit("y", y);
        sink.emit("rstd", rstd);
        sink.emit("y_noweight", y0);
        sink.emit("rstd_noweight", rstd0);
    });
    reg("add_rms_norm", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> s(m * n, T(7)), y(m * n, T(7));
        row_of<T>(v).add_rms_norm(in[0].data(), in[1].data(), in[2].data(), s.data(), y.data(), m, n, 1e-6, t);
        sink.emit("sum", s);
        sink.emit("y", y);
    });
    if (n % 2 == 0) {  // q/k-norm + RoPE: the m x n matrix as m / 2 tokens x 2 heads (m even) or m tokens x 1
        reg("rms_norm_rope", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
            const int64_t heads = m % 2 == 0 ? 2 : 1, tokens = m / heads;
            std::vector<T> cs(tokens * n), sn(tokens * n), wt(heads * n), y(m * n, T(7));
            for (int64_t i = 0; i < tokens * n; ++i) cs[i] = in[1][i] * T(0.5), sn[i] = in[1][m * n - 1 - i] * T(0.5);
            for (int64_t i = 0; i < heads * n; ++i) wt[i] = in[2][i % n] + T(i / n);
            row_of<T>(v).rms_norm_rope(in[0].data(), wt.data(), cs.data(), sn.data(), y.data(), tokens, heads, n,
                                       heads * n, n, 1e-6, t);
            sink.emit("", y);
        });
    }
    reg("rms_norm_backward", [=](const Variant& v, int t, const Sink& sink, const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n), rstd(m), gx(m * n, T(7)), gw(n, T(7)), gx0(m * n, T(7));
        row_of<T>(*g_scalar).rms_norm(in[0].data(), in[2].data(), y.data(), rstd.data(), m, n, 1e-6, 1);
        row_of<T>(v).rms_norm_backward(in[1].data(), in[0].data(), in[2].data(), rstd.data(), gx.data(), gw.data(), m,
                                       n, t);
        row_of<T>(v).rms_norm_backward(in[1].data(), in[0].data(), nullptr, rstd.data(), gx0.data(), nullptr, m, n, t);
        sink.emit("gx", gx);
        sink.emit("gw", gw);
        sink.emit("gx_noweight", gx0);
    });
    reg("rms_norm_scaled_backward", [=](const Variant& v, int t, const Sink& sink,
                                        const std::vector<std::vector<T>>& in) {
        std::vector<T> y(m * n), rstd(m), gx(m * n, T(7)), gw(n, T(7));
        row_of<T>(*g_scalar).rms_norm(in[0].data(), in[2].data(), y.data(), rstd.data(), m, n, 1e-6, 1);
        row_of<T>(v).rms_norm_scaled_backward(in[1].data(), in[0].data(), in[2].data(), rstd.data(), gx.data(),
                                              gw.data(), m, n, t);
        sink.emit("gx", gx);
        sink.emit("gw", gw);
    });
}

// ---------------------------------------------------------------- element-wise

// The inputs of a unary case: "special" (the specials, then every bit pattern), "bits_<n>"
// (random bit patterns, the odd lengths that hit every vector tail), "range_<n>" (the
// function's working range), "sweep" (sqrt: 2^17 inputs, two per 16-bit mantissa prefix over
// both exponent parities, the hard inputs of an approximate sqrt) and "long" (long enough that
// two threads split it).
template <typename T>
std::vector<T> unary_inputs(const std::string& fn, const std::string& kase, Rng& r, int64_t n) {
    if (kase == "special") return with_specials<T>(r, n, kBits, T(0), T(0));
    if (kase.rfind("bits", 0) == 0 || kase == "long") return values<T>(r, n, kBits);
    if (kase == "sweep") {
        std::vector<T> v(n);
        for (int64_t i = 0; i < n; ++i) {
            if (std::is_same<T, float>::value) {
                const uint32_t e = 126u + (uint32_t)(i & 1);                      // [0.5, 1) and [1, 2)
                const uint32_t mant = ((uint32_t)(i >> 1) << 7) | (r.next32() & 0x7fu);  // 16-bit prefix + 7 random
                const uint32_t u = (e << 23) | (mant & 0x7fffffu);
                std::memcpy(&v[i], &u, 4);
            } else {
                const uint64_t e = 1022ull + (uint64_t)(i & 1);
                const uint64_t mant = ((uint64_t)(i >> 1) << 36) | (r.next() & 0xfffffffffull);
                const uint64_t u = (e << 52) | (mant & 0xfffffffffffffull);
                std::memcpy(&v[i], &u, 8);
            }
        }
        return v;
    }
    // range: the function's working range
    if (fn == "exp") return std::is_same<T, float>::value ? values<T>(r, n, kUniform, T(-104), T(89))
                                                          : values<T>(r, n, kUniform, T(-746), T(710));
    if (fn == "exp2") return values<T>(r, n, kUniform, T(-150), T(128.5));
    if (fn == "log" || fn == "sqrt") {
        std::vector<T> v = values<T>(r, n, kUniform, T(0), T(4));
        for (int64_t i = 0; i < n; i += 3) v[i] = std::fabs(from_bits<T>(r));  // every exponent
        return v;
    }
    return values<T>(r, n, kUniform, T(-120), T(120));  // sigmoid, silu and the backward
}

const std::pair<const char*, int64_t> kUnaryCases[] = {
    {"special", 4099}, {"bits_1", 1}, {"bits_7", 7}, {"bits_15", 15}, {"bits_17", 17},
    {"bits_33", 33},   {"bits_1023", 1023}, {"range_4097", 4097}, {"long", 100003},
};

void unary32_case(const std::string& fn, Unary32 Variant::*f) {
    for (const auto& c : kUnaryCases) {
        const std::string kase = c.first, kernel = fn + "_f32";
        const int64_t n = c.second;
        add(kernel, kase, true, [=](const Variant& v, int t, const Sink& sink) {
            Rng r = rng_for(kernel, kase);
            const std::vector<float> x = unary_inputs<float>(fn, kase, r, n);
            std::vector<float> y(n, 7.0f);
            (v.*f)(x.data(), y.data(), n, t);
            sink.emit("", y);
        });
    }
}

void unary64_case(const std::string& fn, Unary64 Variant::*f) {
    for (const auto& c : kUnaryCases) {
        const std::string kase = c.first, kernel = fn + "_f64";
        const int64_t n = c.second;
        add(kernel, kase, true, [=](const Variant& v, int t, const Sink& sink) {
            Rng r = rng_for(kernel, kase);
            const std::vector<double> x = unary_inputs<double>(fn, kase, r, n);
            std::vector<double> y(n, 7.0);
            (v.*f)(x.data(), y.data(), n, t);
            sink.emit("", y);
        });
    }
}

template <typename T, typename F>
void sweep_case(const std::string& kernel, F f) {
    add(kernel, "sweep", true, [=](const Variant& v, int t, const Sink& sink) {
        Rng r = rng_for(kernel, "sweep");
        const int64_t n = 1 << 17;
        const std::vector<T> x = unary_inputs<T>("sqrt", "sweep", r, n);
        std::vector<T> y(n, T(7));
        f(v, x.data(), y.data(), n, t);
        sink.emit("", y);
    });
}

void binary32_case(const std::string& fn, Binary32 Variant::*f) {
    for (const auto& c : kUnaryCases) {
        const std::string kase = c.first, kernel = fn + "_f32";
        const int64_t n = c.second;
        add(kernel, kase, true, [=](const Variant& v, int t, const Sink& sink) {
            Rng r = rng_for(kernel, kase);
            std::vector<float> x = unary_inputs<float>(fn, kase, r, n);
            const std::vector<float> g = values<float>(r, n, kase == "special" ? kSpecials : kUniform, -2.0f, 2.0f);
            if (fn == "sigmoid_backward") {  // the saved input is sigmoid's output y, in [0, 1]
                std::vector<float> y(n);
                g_scalar->sigmoid32(x.data(), y.data(), n, 1);
                x = y;
            }
            std::vector<float> out(n, 7.0f);
            (v.*f)(g.data(), x.data(), out.data(), n, t);
            sink.emit("", out);
        });
    }
}

// silu_mul and its backward: m rows of n gate values then n up values (one fused gate/up matrix, ld 2n), gate in
// silu's range or (special) silu's special inputs, up in [-2, 2].
void silu_mul_case(int64_t m, int64_t n, bool special) {
    const std::string kase = "m" + std::to_string(m) + "_n" + std::to_string(n) + (special ? "_special" : "");
    add("silu_mul_f32", kase, true, [=](const Variant& v, int t, const Sink& sink) {
        Rng r = rng_for("silu_mul_f32", kase);
        const std::vector<float> g = unary_inputs<float>("silu", special ? "special" : "range", r, m * n),
                                 u = values<float>(r, m * n, kUniform, -2.0f, 2.0f);
        std::vector<float> a(2 * m * n), y(m * n, 7.0f);
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) a[i * 2 * n + j] = g[i * n + j], a[i * 2 * n + n + j] = u[i * n + j];
        v.silu_mul32(a.data(), a.data() + n, y.data(), m, n, 2 * n, 2 * n, t);
        sink.emit("", y);
    });
    add("silu_mul_backward_f32", kase, true, [=](const Variant& v, int t, const Sink& sink) {
        Rng r = rng_for("silu_mul_backward_f32", kase);
        const std::vector<float> g = unary_inputs<float>("silu", special ? "special" : "range", r, m * n),
                                 u = values<float>(r, m * n, kUniform, -2.0f, 2.0f),
                                 dy = values<float>(r, m * n, kUniform, -1.0f, 1.0f);
        std::vector<float> a(2 * m * n), dg(m * n, 7.0f), du(m * n, 7.0f);
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) a[i * 2 * n + j] = g[i * n + j], a[i * 2 * n + n + j] = u[i * n + j];
        v.silu_mul_backward32(dy.data(), a.data(), a.data() + n, dg.data(), du.data(), m, n, 2 * n, 2 * n, t);
        sink.emit("grad_gate", dg);
        sink.emit("grad_up", du);
    });
}

// ---------------------------------------------------------------- the battery

void build_cases() {
    // gemm: odd shapes on every path (rows_axpy for <= 2 rows, B read in place, packed per call,
    // packed by the caller, W.t()), K = 0, special values, the model's shapes (tiny-dense: hidden
    // 256, q 256, kv 128, MLP 768, vocab 2048, seq 128), and bmm batches.
    const int64_t shapes[][4] = {
        {1, 1, 1, 1},   {1, 1, 7, 15},   {1, 2, 33, 17},  {1, 7, 15, 17},  {1, 3, 1023, 7}, {1, 13, 17, 33},
        {1, 33, 64, 65}, {1, 50, 31, 97}, {1, 5, 0, 9},    {3, 17, 64, 33}, {2, 1, 33, 15},
    };
    for (const auto& s : shapes)
        for (BLayout lay : {kRowMajor, kTransposed, kPacked}) {
            gemm_case<float>("f32", s[0], s[1], s[2], s[3], lay, kUniform);
            gemm_case<double>("f64", s[0], s[1], s[2], s[3], lay, kUniform);
        }
    for (BLayout lay : {kRowMajor, kTransposed}) {
        gemm_case<float>("f32", 1, 7, 33, 17, lay, kSpecials);
        gemm_case<double>("f64", 1, 7, 33, 17, lay, kSpecials);
    }
    const int64_t model[][4] = {{1, 128, 256, 256}, {1, 128, 256, 128}, {1, 128, 256, 768}, {1, 128, 768, 256},
                                {1, 32, 256, 2048}, {1, 1, 256, 2048},  {8, 128, 64, 128}};
    for (const auto& s : model) {
        gemm_case<float>("f32", s[0], s[1], s[2], s[3], s[0] > 1 ? kRowMajor : kTransposed, kUniform);
        if (s[0] == 1 && s[1] == 128 && s[3] == 256) gemm_case<float>("f32", s[0], s[1], s[2], s[3], kPacked, kUniform);
    }
    gemm_case<double>("f64", 1, 128, 256, 256, kTransposed, kUniform);
    // the tree order (v2, P(K) blocks): K = 768 (P = 8) on the tile path with edge tiles and on the
    // rows_axpy path (M <= 2), and fp64
    gemm_case<float>("f32", 1, 13, 768, 97, kTransposed, kUniform, 8);
    gemm_case<float>("f32", 1, 2, 768, 97, kRowMajor, kUniform, 8);
    gemm_case<double>("f64", 1, 13, 768, 97, kRowMajor, kUniform, 8);

    // attention: causal prefill across the 128-key chunk boundary, decode from a cache, a chunked
    // prefill, GQA, odd head dims, documents with padding, an extra mask with a row that sees
    // nothing, special values, non-causal.
    const AttShape att[] = {
        {"prefill_b1_h4x2_t130_d64", 1, 4, 2, 130, 130, 64, 64, true, 0, false, false, kUniform},
        {"decode_b2_h4x2_t1_k130_d64", 2, 4, 2, 1, 130, 64, 64, true, 129, false, false, kUniform},
        {"chunk_b1_h4x2_q7_k107_d64", 1, 4, 2, 7, 107, 64, 64, true, 100, false, false, kUniform},
        {"noncausal_b2_h3x1_q17_k33_d7_dv15", 2, 3, 1, 17, 33, 7, 15, false, 0, false, false, kUniform},
        {"docs_b2_h2x2_t33_d16", 2, 2, 2, 33, 33, 16, 16, true, 0, true, false, kUniform},
        {"mask_b2_h2x1_q15_k17_d8", 2, 2, 1, 15, 17, 8, 8, false, 0, false, true, kUniform},
        {"special_b1_h2x1_t17_d15", 1, 2, 1, 17, 17, 15, 15, true, 0, false, false, kSpecials},
        {"long_b1_h1x1_t300_d1", 1, 1, 1, 300, 300, 1, 1, true, 0, false, false, kUniform},
    };
    for (const auto& s : att) {
        attention_case<float>("f32", s);
        attention_case<double>("f64", s);
    }

    // row ops: odd lengths (every lane and vector tail), the model's rows (hidden 256, vocab
    // 2048, MLP 768), special rows, every bit pattern.
    const int64_t rows[][2] = {{1, 1}, {3, 7}, {2, 15}, {5, 17}, {4, 33}, {2, 1023}, {8, 256}, {4, 2048}, {3, 768}};
    for (const auto& s : rows) {
        rowops_case<float>("f32", s[0], s[1], kUniform, -8.0f, 8.0f);
        rowops_case<double>("f64", s[0], s[1], kUniform, -8.0, 8.0);
    }
    rowops_case<float>("f32", 6, 37, kSpecials, -8.0f, 8.0f);
    rowops_case<double>("f64", 6, 37, kSpecials, -8.0, 8.0);
    rowops_case<float>("f32", 6, 64, kSpecials, -8.0f, 8.0f);  // an even row: rms_norm_rope's specials
    rowops_case<double>("f64", 6, 64, kSpecials, -8.0, 8.0);
    rowops_case<float>("f32", 3, 129, kBits, 0.0f, 0.0f);
    rowops_case<double>("f64", 3, 129, kBits, 0.0, 0.0);
    rowops_case<float>("f32", 40, 1000, kUniform, -30.0f, 30.0f);  // enough elements for 2 threads

    // element-wise, float32 and float64
    unary32_case("exp", &Variant::exp32);
    unary32_case("exp2", &Variant::exp2_32);
    unary32_case("log", &Variant::log32);
    unary32_case("sqrt", &Variant::sqrt32);
    unary32_case("sigmoid", &Variant::sigmoid32);
    unary32_case("silu", &Variant::silu32);
    binary32_case("sigmoid_backward", &Variant::sigmoid_backward32);
    binary32_case("silu_backward", &Variant::silu_backward32);
    for (const auto& c : {std::make_pair(1, 1), std::make_pair(3, 7), std::make_pair(2, 17), std::make_pair(5, 33),
                          std::make_pair(8, 768), std::make_pair(2, 1023)})
        silu_mul_case(c.first, c.second, false);
    silu_mul_case(3, 1367, true);
    unary64_case("exp", &Variant::exp64);
    unary64_case("log", &Variant::log64);
    unary64_case("sqrt", &Variant::sqrt64);
    sweep_case<float>("sqrt_f32", [](const Variant& v, const float* x, float* y, int64_t n, int t) { v.sqrt32(x, y, n, t); });
    sweep_case<double>("sqrt_f64", [](const Variant& v, const double* x, double* y, int64_t n, int t) { v.sqrt64(x, y, n, t); });

    // random: Box-Muller from given bits (odd pair counts, the extreme words)
    for (int64_t pairs : {1, 7, 1024, 4099}) {
        const std::string kase = "pairs_" + std::to_string(pairs);
        add("normal_from_bits", kase, false, [=](const Variant& v, int, const Sink& sink) {
            Rng r = rng_for("normal_from_bits", kase);
            std::vector<uint32_t> bits(2 * pairs);
            for (auto& b : bits) b = r.next32();
            const uint32_t edge[] = {0u, 0u, 0xffffffffu, 0xffffffffu, 0u, 0xffffffffu, 0xffffffffu, 0u};
            for (int i = 0; i < 8 && i < 2 * pairs; ++i) bits[i] = edge[i];
            std::vector<float> out(2 * pairs, 7.0f);
            v.normal_from_bits(bits.data(), out.data(), pairs, 0.0f, 1.0f);
            sink.emit("", out);
            v.normal_from_bits(bits.data(), out.data(), pairs, 0.5f, 0.02f);
            sink.emit("mean0.5_std0.02", out);
        });
    }

    // trig: cos/sin of special angles, every bit pattern, the working range, the RoPE table of
    // tiny-dense (2048 positions x 32 frequencies, two threads split it); RoPE frequencies.
    for (const char* kase : {"special", "bits_33", "range_4097", "rope_2048x32"}) {
        const std::string k = kase;
        add("cos_sin_f32", k, true, [=](const Variant& v, int t, const Sink& sink) {
            Rng r = rng_for("cos_sin_f32", k);
            std::vector<float> a;
            if (k == "special") a = with_specials<float>(r, 1000, kUniform, -100.0f, 100.0f);
            else if (k == "bits_33") a = values<float>(r, 33, kBits);
            else if (k == "range_4097") a = values<float>(r, 4097, kUniform, -65536.0f, 65536.0f);
            else {
                std::vector<float> inv(32);
                g_scalar->rope_inv_freq(10000.0, 64, inv.data());
                for (int p = 0; p < 2048; ++p)
                    for (int i = 0; i < 32; ++i) a.push_back((float)p * inv[i]);
            }
            std::vector<float> c(a.size(), 7.0f), s(a.size(), 7.0f);
            v.cos_sin(a.data(), c.data(), s.data(), (int64_t)a.size(), t);
            sink.emit("cos", c);
            sink.emit("sin", s);
        });
    }
    const std::pair<double, int64_t> ropes[] = {{10000.0, 64}, {500000.0, 64}, {1000000.0, 128}, {10000.0, 2}, {3.5, 6}};
    for (const auto& p : ropes) {
        char kase[64];
        std::snprintf(kase, sizeof kase, "theta%.0f_d%lld", p.first * 10, (long long)p.second);  // theta x 10
        add("rope_inv_freq_f32", kase, false, [=](const Variant& v, int, const Sink& sink) {
            std::vector<float> out(p.second / 2, 7.0f);
            v.rope_inv_freq(p.first, p.second, out.data());
            sink.emit("", out);
        });
    }

    // embedding backward: repeated indices (their rows add in ascending order), padding_idx, indices
    // out of [0, V) (they add nothing), odd sizes and the model's (vocab 2048, hidden 256).
    const int64_t emb[][4] = {{33, 7, 17, 3}, {1, 1, 1, -1}, {128, 256, 2048, 0}, {300, 15, 5, -1}};
    for (const auto& e : emb) {
        const int64_t n = e[0], d = e[1], vocab = e[2], pad = e[3];
        const std::string kase = "n" + std::to_string(n) + "_d" + std::to_string(d) + "_v" + std::to_string(vocab) +
                                 "_pad" + std::to_string(pad);
        add("embedding_backward_f32", kase, true, [=](const Variant& v, int t, const Sink& sink) {
            Rng r = rng_for("embedding_backward_f32", kase);
            const std::vector<float> g = values<float>(r, n * d, n == 33 ? kSpecials : kUniform);
            std::vector<int64_t> idx(n);
            for (auto& i : idx) i = (int64_t)r.below((uint64_t)vocab + 4) - 2;  // [-2, V + 2)
            std::vector<float> out(vocab * d, 7.0f);
            v.embedding_backward(g.data(), idx.data(), out.data(), n, d, vocab, pad, t);
            sink.emit("", out);
        });
    }

    // AdamW (PortableAdamW's fused step): three steps in place on the lengths around every vector
    // width and one the threads split, with and without weight decay. The values are finite bit
    // patterns of exponents 0 (zeros, subnormals) to 2^63 (so nothing overflows and no NaN is
    // made: an invalid operation's NaN is negative on x86, positive on arm64); the moments start
    // from such patterns too (exp_avg_sq >= 0) or, for "zeros", from 0 as a fresh optimizer does.
    // The scalars are PortableAdamW's, in double: b^t by repeated multiplication, IEEE sqrt.
    for (const char* kase : {"bits_1", "bits_7", "bits_17", "bits_33", "bits_1023", "nowd_bits_33", "zeros_100003"}) {
        const std::string k = kase;
        add("adamw_step_f32", k, true, [=](const Variant& v, int t, const Sink& sink) {
            Rng r = rng_for("adamw_step_f32", k);
            const int64_t n = std::atoll(k.substr(k.rfind('_') + 1).c_str());
            const bool zeros = k.rfind("zeros", 0) == 0;
            auto finite = [&](bool nonneg) {
                std::vector<float> x(n);
                for (auto& e : x) {
                    const uint32_t sign = nonneg ? 0u : (r.next32() & 1u) << 31;
                    const uint32_t exponent = (uint32_t)r.below(191), mantissa = r.next32() & 0x7fffffu;
                    e = r.below(16) == 0 ? 0.0f : f32_of(sign | exponent << 23 | mantissa);
                }
                return x;
            };
            std::vector<float> p = zeros ? values<float>(r, n, kUniform) : finite(false);
            std::vector<float> m = zeros ? std::vector<float>(n, 0.0f) : finite(false);
            std::vector<float> sq = zeros ? std::vector<float>(n, 0.0f) : finite(true);
            const double lr = 3e-3, wd = k.rfind("nowd", 0) == 0 ? 0.0 : 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8;
            double b1t = 1.0, b2t = 1.0;
            for (int step = 1; step <= 3; ++step) {
                const std::vector<float> g = zeros ? values<float>(r, n, kUniform, -1e-3f, 1e-3f) : finite(false);
                b1t = b1t * b1;
                b2t = b2t * b2;
                v.adamw_step(p.data(), g.data(), m.data(), sq.data(), n, 1.0 - lr * wd, b1, 1.0 - b1, b2, 1.0 - b2,
                             std::sqrt(1.0 - b2t), eps, -lr / (1.0 - b1t), t);
            }
            sink.emit("param", p);
            sink.emit("exp_avg", m);
            sink.emit("exp_avg_sq", sq);
        });
    }

    // absmax + sum (the audit's statistics, kernels/stats.cpp): lengths around the 32 lanes and
    // the 1024-element blocks, every bit pattern (NaNs: the state must hold the one quiet NaN),
    // specials, both infinities (inf - inf), negative zeros, finite patterns of every exponent
    // (float32 lanes may overflow to inf: that is the order's result too), and a long uniform
    // run. Each case's output is the whole state (32 float64 lanes, absmax, sum) after one call,
    // and again ("pieces") after feeding the same input in pieces of 1024, 2048 and the rest:
    // both records must be the same bits.
    for (const char* dt : {"f32", "bf16", "f64"}) {
        for (const char* kase : {"uniform_1", "uniform_31", "uniform_33", "uniform_1023", "uniform_1024", "uniform_1025",
                                 "uniform_100003", "bits_33", "bits_3001", "special_4099", "finite_3000", "infs_100",
                                 "negzeros_2049"}) {
            const std::string d = dt, k = kase, kernel = "absmax_sum_" + d;
            add(kernel, k, false, [=](const Variant& v, int, const Sink& sink) {
                Rng r = rng_for(kernel, k);
                const int64_t n = std::atoll(k.substr(k.rfind('_') + 1).c_str());
                const std::string what = k.substr(0, k.rfind('_'));
                std::vector<double> x(n);  // the values, as float64 (float32 / bfloat16 ones are exact)
                std::vector<uint64_t> bits(n);  // or raw bit patterns, for "bits"
                if (what == "uniform") for (auto& e : x) e = uniform<double>(r, -8.0, 8.0);
                if (what == "special") {
                    if (d == "f64") x = with_specials<double>(r, n, kUniform, -8.0, 8.0);
                    else for (int64_t i = 0; i < n; ++i) x[i] = i < kNumSpecial32 ? special<float>((int)i) : uniform<float>(r, -8.0f, 8.0f);
                }
                if (what == "finite") {
                    for (auto& e : x) {
                        const uint64_t sign = r.next() & 1u;
                        if (d == "f64") e = f64_of(sign << 63 | r.below(2047) << 52 | (r.next() & 0xfffffffffffffull));
                        else e = f32_of((uint32_t)(sign << 31 | r.below(255) << 23 | (r.next32() & 0x7fffffu)));
                    }
                }
                if (what == "infs") for (int64_t i = 0; i < n; ++i) x[i] = (i % 3 == 1) ? -INFINITY : (i % 3 == 2 ? INFINITY : 1.0);
                if (what == "negzeros") for (auto& e : x) e = -0.0;
                for (auto& b : bits) b = r.next();
                const bool raw = what == "bits";
                std::vector<float> x32(n);
                std::vector<uint16_t> x16(n);
                for (int64_t i = 0; i < n; ++i) {
                    uint32_t b32;
                    const float f = (float)x[i];
                    std::memcpy(&b32, &f, 4);
                    x32[i] = raw ? f32_of((uint32_t)bits[i]) : f;
                    // bfloat16: the top half of the float32 (what/"finite" values keep their exponent range)
                    x16[i] = raw ? (uint16_t)bits[i] : (uint16_t)(b32 >> 16);
                    if (raw) x[i] = f64_of(bits[i]);
                }
                auto feed = [&](double* state, int64_t begin, int64_t count) {
                    if (d == "f32") v.absmax_sum_f32(x32.data() + begin, count, state);
                    else if (d == "bf16") v.absmax_sum_bf16(x16.data() + begin, count, state);
                    else v.absmax_sum_f64(x.data() + begin, count, state);
                };
                auto fresh = [] {
                    std::vector<double> st(34, -0.0);
                    st[32] = 0.0;
                    return st;
                };
                std::vector<double> one = fresh();
                feed(one.data(), 0, n);
                sink.emit("", one);
                std::vector<double> pieces = fresh();
                int64_t at = 0;
                for (int64_t len : {int64_t(1024), int64_t(2048)}) {
                    if (at + len >= n) break;
                    feed(pieces.data(), at, len);
                    at += len;
                }
                feed(pieces.data(), at, n - at);
                sink.emit("pieces", pieces);
            });
        }
    }

    // the constants the Python side relies on
    add("info", "constants", false, [](const Variant& v, int, const Sink& sink) {
        const int64_t c[] = {v.version(), v.key_chunk(), v.packed_elems(1, 1), v.packed_elems(7, 33), v.packed_elems(256, 2048)};
        sink.emit("", c, 5);
    });
}

std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    size_t b = 0;
    while (b <= s.size()) {
        size_t e = s.find(',', b);
        if (e == std::string::npos) e = s.size();
        if (e > b) out.push_back(s.substr(b, e - b));
        b = e + 1;
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    static const std::vector<Variant> all = all_variants();
    g_scalar = &all[0];
    std::vector<Variant> variants = all;
    std::vector<int> threads{1, 2};
    std::string only, out_path;
    bool list = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) { std::fprintf(stderr, "battery: %s needs a value\n", a.c_str()); std::exit(2); }
            return argv[++i];
        };
        if (a == "--variants") {
            for (const auto& v : variants) std::printf("%s\n", v.name);
            return 0;
        } else if (a == "--isa") {
            std::vector<Variant> keep;
            for (const std::string& name : split(value())) {
                auto it = std::find_if(all.begin(), all.end(), [&](const Variant& v) { return name == v.name; });
                if (it == all.end()) { std::fprintf(stderr, "battery: this CPU cannot run variant %s\n", name.c_str()); return 2; }
                keep.push_back(*it);
            }
            variants = keep;
        } else if (a == "--threads") {
            threads.clear();
            for (const std::string& t : split(value())) threads.push_back(std::atoi(t.c_str()));
        } else if (a == "--only") {
            only = value();
        } else if (a == "-o") {
            out_path = value();
        } else if (a == "--list") {
            list = true;
        } else {
            std::fprintf(stderr, "battery: unknown argument %s (see the head of battery.cpp)\n", a.c_str());
            return 2;
        }
    }
    build_cases();
    if (list) {
        for (const Case& c : g_cases) std::printf("%s/%s%s\n", c.kernel.c_str(), c.name.c_str(), c.threaded ? " threads" : "");
        return 0;
    }
    g_out = out_path.empty() ? stdout : std::fopen(out_path.c_str(), "wb");
    if (!g_out) { std::perror(out_path.c_str()); return 2; }
    std::fprintf(g_out, "TABATTERY 1\n");
    for (const Case& c : g_cases) {
        if (!only.empty() && (c.kernel + "/" + c.name).rfind(only, 0) != 0) continue;
        for (const Variant& v : variants) {
            for (int t : (c.threaded ? threads : std::vector<int>{0})) {
                Sink sink{c.kernel, c.name, v.name, t};
                c.run(v, t == 0 ? 1 : t, sink);
            }
        }
    }
    std::fprintf(g_out, "END %lld\n", (long long)g_records);
    if (std::fflush(g_out) != 0 || (g_out != stdout && std::fclose(g_out) != 0)) { std::perror("battery: write"); return 2; }
    return 0;
}
