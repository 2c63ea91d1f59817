/* mkl_intel_path.c: make the MKL inside torch take its Intel code paths on any x86-64 CPU.
 *
 * A measuring aid for `titan-audit bench` (issue 26: the native baseline's speed depends on the CPU
 * vendor). MKL asks these two functions whether the CPU is an Intel one and, on an AMD CPU, runs
 * its generic AVX2 sgemm ("Intel(R) Architecture processors" in its banner) instead of the
 * AVX-512 kernels an Intel Xeon gets. torch's libtorch_cpu.so exports both and calls them through
 * the PLT, so a library loaded first with LD_PRELOAD answers instead. The kernel choice follows
 * the first, MKL's banner the second: answering only one makes the banner and the kernels
 * disagree (checked on a Zen 4 EPYC with `perf record`: with both, mkl_blas_avx512_sgemm_kernel_*
 * run and the banner names AVX-512; 64 x 256 x 256 sgemm 103 -> 76 us).
 *
 *     make mkl-intel-path
 *     LD_PRELOAD=$PWD/build/mkl_intel_path.so titan-audit bench train
 *
 * The bench's JSON then records `machine.mkl_code_path` (MKL's own banner: "Intel(R) Advanced
 * Vector Extensions 512 ...") and `LD_PRELOAD`. It changes only what native torch ops run (their
 * speed and bits); batch-invariant mode's results come from our kernels and do not move. It is
 * not an Intel CPU: caches, clocks and every other library's choice stay the AMD machine's.
 */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }
