/* isa_avx512.c — the AVX-512 (F/BW/DQ/VL) + FMA + F16C variant of every kernel.
 * Built with the project's portable base flags: only this unit's functions carry the target, and
 * the dispatcher calls them only where helm_cpu_supports("avx512") says the CPU and OS can. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helm_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define HELM_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#include "target_push.h"

#define HELM_ISA avx512
#include "vec_avx512.h"
#include "kernels_impl.h"

#include "target_pop.h"
#else
const helm_kernel_table helm_table_avx512 = {0};
#endif
