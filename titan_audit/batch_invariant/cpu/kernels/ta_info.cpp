// ta_info.cpp: what the library is (its version, the variant compiled into this object), and
// which ISA variants the running CPU can execute. No numerics here.
#include "ta_common.h"

TA_EXPORT(int, kernels_version)() { return TA_KERNELS_VERSION; }

TA_EXPORT(int, variant_lanes)() {
#if defined(TA_ISA_AVX512)
    return 16;
#elif defined(TA_ISA_AVX2)
    return 8;
#else
    return 1;
#endif
}

#if defined(TA_ISA_SCALAR)
// Compiled once (in the scalar object): CPU feature tests for the loader (and the battery).
// Another architecture (the arm64 battery) has only the scalar variant: both say 0.
extern "C" __attribute__((visibility("default"))) int ta_cpu_supports_avx2() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}
extern "C" __attribute__((visibility("default"))) int ta_cpu_supports_avx512() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}
#endif
