/* isa_avx2.c — the AVX2 + FMA + F16C variant of every kernel (Haswell and later, Zen).
 * Built with portable base flags; called only where helm_cpu_supports("avx2"). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helm_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define HELM_TARGET "avx2,fma,f16c"
#include "target_push.h"

#define HELM_ISA avx2
#define HELM_NVREGS 16
#define VL 8
typedef __m256 vf;
static inline __attribute__((always_inline)) vf v_zero(void) { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) vf v_load_bf16(const uint16_t *p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline __attribute__((always_inline)) vf v_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline __attribute__((always_inline)) vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf v_set1(float f) { return _mm256_set1_ps(f); }
static inline __attribute__((always_inline)) void v_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline __attribute__((always_inline)) float s_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline __attribute__((always_inline)) float v_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
/* 16 bf16 → evens and odds as floats (see vec_avx512.h). */
#define v_load_bf16x2(p, even, odd)                                                        \
    do {                                                                                   \
        const __m256i v_ = _mm256_loadu_si256((const __m256i *)(p));                       \
        (even) = _mm256_castsi256_ps(_mm256_slli_epi32(v_, 16));                           \
        (odd) = _mm256_castsi256_ps(_mm256_and_si256(v_, _mm256_set1_epi32((int)0xFFFF0000))); \
    } while (0)
#include "kernels_impl.h"

#include "target_pop.h"
#else
const helm_kernel_table helm_table_avx2 = {0};
#endif
