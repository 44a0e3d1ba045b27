/* vec_avx512.h — the vector vocabulary of kernels_impl.h on AVX-512 (16 floats per vector). */
#define HELM_NVREGS 32
#define VL 16
typedef __m512 vf;
static inline __attribute__((always_inline)) vf v_zero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) vf v_load_bf16(const uint16_t *p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
static inline __attribute__((always_inline)) vf v_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf v_set1(float f) { return _mm512_set1_ps(f); }
static inline __attribute__((always_inline)) void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) float v_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline __attribute__((always_inline)) float s_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
/* 32 bf16 → evens and odds as floats: a bf16 is the top half of its float, so a shift (even,
 * low halves of each 32-bit lane) and a mask (odd, high halves) widen without a shuffle. */
#define v_load_bf16x2(p, even, odd)                                                       \
    do {                                                                                  \
        const __m512i v_ = _mm512_loadu_si512((const void *)(p));                         \
        (even) = _mm512_castsi512_ps(_mm512_slli_epi32(v_, 16));                          \
        (odd) = _mm512_castsi512_ps(_mm512_and_si512(v_, _mm512_set1_epi32((int)0xFFFF0000))); \
    } while (0)
