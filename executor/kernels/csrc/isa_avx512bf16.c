/* isa_avx512bf16.c — the AVX-512 variant plus AVX512-BF16: bf16 weights go through VDPBF16PS
 * (gemv_bf16dp.h) instead of being upcast; every other kernel is the AVX-512 one.
 * Built with portable base flags; called only where helm_cpu_supports("avx512bf16"). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helm_kernels.h"

/* AVX512-BF16 intrinsics need GCC >= 10 or clang >= 9; older compilers build no such variant. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#include <immintrin.h>

#define HELM_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"
#include "target_push.h"

#define HELM_ISA avx512bf16
#define HELM_BF16_DP 1
#include "vec_avx512.h"
#include "kernels_impl.h"

#include "target_pop.h"
#else
const helm_kernel_table helm_table_avx512bf16 = {0};
#endif
