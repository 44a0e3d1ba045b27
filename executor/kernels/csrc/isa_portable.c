/* isa_portable.c — the portable variant of every kernel: GCC/Clang vector extensions of 4 floats
 * (SSE2 on x86-64's baseline, NEON on AArch64), no instruction set beyond the compiler's default.
 * It runs everywhere and is the fallback when no better variant is available. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helm_kernels.h"

#define HELM_ISA portable
#define HELM_NVREGS 16
#define VL 4
typedef float vf __attribute__((vector_size(16)));
typedef uint32_t helm_vu __attribute__((vector_size(16)));
typedef uint16_t helm_vh __attribute__((vector_size(8)));

static inline __attribute__((always_inline)) vf v_zero(void) { return (vf){0.0f, 0.0f, 0.0f, 0.0f}; }
static inline __attribute__((always_inline)) vf v_load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) vf v_load_bf16(const uint16_t *p) {
    helm_vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, helm_vu) << 16);
}
/* Vector form of helm_f16_f32 (kernels_impl.h). */
static inline __attribute__((always_inline)) vf v_load_f16(const uint16_t *p) {
    helm_vh h;
    memcpy(&h, p, sizeof h);
    const helm_vu w = __builtin_convertvector(h, helm_vu) << 16;
    const helm_vu sign = w & 0x80000000u;
    const helm_vu two_w = w + w;
    const vf normalized = (vf)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const vf denormalized = (vf)((two_w >> 17) | (126u << 23)) - 0.5f;
    const helm_vu is_denorm = (helm_vu)(two_w < (1u << 27));
    return (vf)(sign | (is_denorm & (helm_vu)denormalized) | (~is_denorm & (helm_vu)normalized));
}
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline __attribute__((always_inline)) vf v_add(vf a, vf b) { return a + b; }
static inline __attribute__((always_inline)) vf v_mul(vf a, vf b) { return a * b; }
static inline __attribute__((always_inline)) vf v_set1(float f) { return (vf){f, f, f, f}; }
static inline __attribute__((always_inline)) void v_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* Unfused, like v_fma here: setup.py builds with -ffp-contract=off, so neither becomes an FMA. */
static inline __attribute__((always_inline)) float s_fma(float a, float b, float c) { return a * b + c; }
static inline __attribute__((always_inline)) float v_hsum(vf v) { return (v[0] + v[1]) + (v[2] + v[3]); }

/* 8 bf16 → evens and odds as floats (see vec_avx512.h). */
#define v_load_bf16x2(p, even, odd)                \
    do {                                           \
        helm_vu v_;                                \
        memcpy(&v_, (p), sizeof v_);               \
        (even) = (vf)(v_ << 16);                   \
        (odd) = (vf)(v_ & 0xFFFF0000u);            \
    } while (0)
#include "kernels_impl.h"
