/* kernels_impl.h — every kernel of helm_kernels.h, written once over a small vector vocabulary
 * and compiled once per instruction set by the isa_*.c files, which define that vocabulary:
 *   HELM_ISA (bare name), vf (vector of VL floats), HELM_NVREGS (vector registers),
 *   v_zero(), v_load(const float *), v_load_bf16(const uint16_t *), v_load_f16(const uint16_t *),
 *   v_fma(a, b, c) = a*b + c, v_add(a, b), v_mul(a, b), v_set1(float), v_store(float *, v),
 *   v_hsum(v) → float, s_fma(a, b, c), the scalar
 *   a*b + c rounded the way v_fma rounds (so a row's result does not depend on its tile), and
 *   v_load_bf16x2(p, even, odd): 2·VL bf16 → the even-index and odd-index elements as floats.
 * Element-wise kernels are plain C loops that the compiler vectorises for the unit's target. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helm_kernels.h"

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define STR_(a) #a
#define STR(a) STR_(a)
#define HELM_INLINE static inline __attribute__((always_inline))

/* Weight bytes per block when a batch above HELM_MAX_TILE_B is processed chunk by chunk: the
 * block is re-read from L2 (2 MiB per core here) for every chunk after the first. */
#ifndef HELM_L2_BLOCK_BYTES
#define HELM_L2_BLOCK_BYTES (512 * 1024)
#endif

/* Register tile per batch size: R weight rows (independent memory streams) × B batch rows, U
 * unrolls of k. R·B·U accumulators must leave room for the weight vectors and x. */
#if HELM_NVREGS >= 32
#define TILE_R(B) ((B) <= 6 ? 4 : 3)
#else
#define TILE_R(B) ((B) <= 2 ? 4 : (B) <= 4 ? 3 : (B) <= 6 ? 2 : 1)
#endif
#define TILE_U(B) ((B) == 1 ? 2 : 1)

/* Batches up to which bf16 weights take the pair load (gemv_tile.h): 1.2-1.4x faster from cache
 * for B <= 5 with 32 registers (B <= 2 with 16); above that its two x vectors per batch row no
 * longer fit in registers beside the accumulators and the widening loads win. */
#ifndef HELM_PAIR_MAX_B
#if HELM_NVREGS >= 32
#define HELM_PAIR_MAX_B 5
#else
#define HELM_PAIR_MAX_B 2
#endif
#endif

/* ---- scalar conversions (also the portable reference for the vector loads) ---- */

HELM_INLINE float helm_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
HELM_INLINE uint32_t helm_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
HELM_INLINE float helm_bf16_f32(uint16_t h) { return helm_bits_f32((uint32_t)h << 16); }

/* float → bf16, round to nearest even; NaN → the quiet NaN 0x7FC0 (as PyTorch converts). */
HELM_INLINE uint16_t helm_f32_bf16(float f) {
    const uint32_t u = helm_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float → IEEE half, round to nearest even, overflow to inf, NaN → quiet NaN, without F16C; the
 * float unit does the rounding (Maratyszcza's FP16 method, like helm_f16_f32 below): |f| scaled by
 * 2^112 then 2^-110 saturates to inf past the half range; adding a power of two placed 13 bits above
 * the half's last mantissa bit (2^-24 for subnormals) rounds the mantissa in one float addition,
 * which leaves the half's exponent and mantissa in the low bits of the sum. */
HELM_INLINE uint16_t helm_f32_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = helm_f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = helm_bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = helm_f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* IEEE half → float without F16C, exact for normals, subnormals, inf and NaN (the method of
 * Maratyszcza's FP16 library: rebias the exponent with one multiply, subnormals via a magic add). */
HELM_INLINE float helm_f16_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = helm_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = helm_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t bits = two_w < (1u << 27) ? helm_f32_bits(denormalized) : helm_f32_bits(normalized);
    return helm_bits_f32(sign | bits);
}

/* exp(x) to ~1 ulp on the float range (Cody–Waite reduction, degree-6 Taylor on |r| <= ln2/2);
 * 0 below -87.3 (exp(-87.3) is 1.2e-38, at the smallest normal float), exp(88.7) above 88.7, NaN
 * for NaN. Branch-free (selects) so that loops over it vectorise; the reduction runs on a
 * clamped, non-NaN argument, so the float → int conversion is always defined. */
HELM_INLINE float helm_expf(float x) {
    float c = x < -87.3f ? -87.3f : x;
    c = c > 88.7f ? 88.7f : c;
    c = c == c ? c : 0.0f;
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rint(c / ln2) */
    float r = c - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* p * 2^n in two halves so that n = 128 (c near 88.7) does not overflow the exponent. */
    const int32_t ni = (int32_t)n;
    const int32_t n1 = ni >> 1, n2 = ni - n1;
    const float y = p * helm_bits_f32((uint32_t)(n1 + 127) << 23) * helm_bits_f32((uint32_t)(n2 + 127) << 23);
    return x == x ? (x < -87.3f ? 0.0f : y) : x;
}

/* max(init, x[0..n)) and sum(x[0..n)) in 16 independent lanes, so the loops vectorise without
 * -ffast-math (the sum's order is fixed: lane j sums x[j], x[j+16], ...; then lanes in order). */
HELM_INLINE float helm_max(const float *x, int n, float init) {
    float part[16];
    for (int j = 0; j < 16; j++) part[j] = init;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] = x[i + j] > part[j] ? x[i + j] : part[j];
    float m = init;
    for (int j = 0; j < 16; j++) m = part[j] > m ? part[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

HELM_INLINE float helm_sum(const float *x, int n) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += x[i + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += part[j];
    for (; i < n; i++) s += x[i];
    return s;
}

/* ---- GEMV / small-batch GEMM and paged attention, one instantiation per weight dtype ---- */

/* Tile claims (helm_claim in helm_kernels.h). A thread's share holds `seg` tiles; back starts as
 * the sentinel 0x7fffffff, read as seg, so the caller only has to store HELM_CLAIM_INIT. */
#define HELM_CLAIM_SENTINEL 0x7fffffff

HELM_INLINE int64_t helm_claim_pack(int32_t front, int32_t back) {
    return (int64_t)(((uint64_t)(uint32_t)back << 32) | (uint32_t)front);
}

/* Claims up to `want` tiles from the front (owner) or the back (helper) of c's unclaimed range
 * [front, min(back, seg)); returns how many, the first in *j0. */
static int helm_claim_tiles(helm_claim *c, int seg, int want, int from_back, int *j0) {
    int64_t old = __atomic_load_n(&c->word, __ATOMIC_RELAXED);
    for (;;) {
        const int32_t front = (int32_t)(uint32_t)old;
        int32_t back = (int32_t)(old >> 32);
        if (back == HELM_CLAIM_SENTINEL || back > seg) back = seg;
        if (front >= back) return 0;
        const int n = back - front < want ? back - front : want;
        const int64_t neu = from_back ? helm_claim_pack(front, back - n) : helm_claim_pack(front + n, back);
        if (__atomic_compare_exchange_n(&c->word, &old, neu, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *j0 = from_back ? back - n : front;
            return n;
        }
    }
}

/* Tiles an owner claims at a time: a few µs of streaming, so claims cost nothing measurable. */
#define HELM_CLAIM_OWNER_TILES 8

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "v_load_bf16x2 assumes little-endian bf16 pairs"
#endif

/* Per-thread scratch for x in the column order of a pair load, grown on demand and kept for the
 * thread's lifetime (OpenMP threads are pooled): a few KiB per batch row. */
static __thread float *helm_xs_buf = NULL;
static __thread size_t helm_xs_cap = 0;

/* xs[b*K2 + c + i] = x[b*K + c + 2i], xs[b*K2 + c + vl + i] = x[b*K + c + 2i + 1]
 *   for each chunk c of 2·vl columns below K2. NULL if K2 is 0 or memory is short. */
static const float *helm_deinterleave_x(const float *x, int B, int K, int K2, const int vl) {
    const size_t need = (size_t)B * (size_t)K2;
    if (need == 0) return NULL;
    if (need > helm_xs_cap) {
        free(helm_xs_buf);
        helm_xs_buf = (float *)malloc(need * sizeof(float));
        helm_xs_cap = helm_xs_buf ? need : 0;
        if (!helm_xs_buf) return NULL;
    }
    for (int b = 0; b < B; b++) {
        const float *src = x + (size_t)b * K;
        float *dst = helm_xs_buf + (size_t)b * K2;
        for (int c = 0; c < K2; c += 2 * vl)
            for (int i = 0; i < vl; i++) {
                dst[c + i] = src[c + 2 * i];
                dst[c + vl + i] = src[c + 2 * i + 1];
            }
    }
    return helm_xs_buf;
}

#include "gemm_core.h"

/* One instantiation of the GEMV (gemv_tile.h), the packed GEMM (gemm_tile.h) and of the KV write
 * and paged attention (attention.h) per weight / KV dtype; STORE_W rounds a float to the dtype
 * (nearest even). */
#define WT float
#define WNAME f32
#define WDTYPE HELM_F32
#define LOAD_W(p) v_load(p)
#define SCALAR_W(v) (v)
#define STORE_W(f) (f)
#include "gemv_tile.h"
#include "gemm_tile.h"
#include "attention.h"
#undef WT
#undef WNAME
#undef WDTYPE
#undef LOAD_W
#undef SCALAR_W
#undef STORE_W

#define WT uint16_t
#define WNAME bf16
#define WDTYPE HELM_BF16
#define LOAD_W(p) v_load_bf16(p)
#define LOAD_W_PAIR(p, even, odd) v_load_bf16x2(p, even, odd)
#define SCALAR_W(v) helm_bf16_f32(v)
#define STORE_W(f) helm_f32_bf16(f)
#include "gemv_tile.h"
#include "gemm_tile.h"
#include "attention.h"
#undef WT
#undef WNAME
#undef WDTYPE
#undef LOAD_W
#undef LOAD_W_PAIR
#undef SCALAR_W
#undef STORE_W

#define WT uint16_t
#define WNAME f16
#define WDTYPE HELM_F16
#define LOAD_W(p) v_load_f16(p)
#define SCALAR_W(v) helm_f16_f32(v)
#define STORE_W(f) helm_f32_f16(f)
#include "gemv_tile.h"
#include "gemm_tile.h"
#include "attention.h"
#undef WT
#undef WNAME
#undef WDTYPE
#undef LOAD_W
#undef SCALAR_W
#undef STORE_W

#ifdef HELM_BF16_DP
#include "gemv_bf16dp.h"
#define HELM_GEMV_BF16 gemv_bf16dp
#else
#define HELM_GEMV_BF16 gemv_bf16
#endif

/* ---- RMSNorm ---- */

#define HELM_DEFINE_RMS_NORM(WNAME_, WT_, SCALAR_W_)                                          \
    static void CAT(rms_norm_, WNAME_)(float *out, const float *x, const void *wv, float eps,   \
                                       int H, long b0, long b1) {                              \
        const WT_ *w = (const WT_ *)wv;                                                         \
        for (long b = b0; b < b1; b++) {                                                        \
            const float *xb = x + (size_t)b * H;                                                \
            float *ob = out + (size_t)b * H;                                                    \
            float part[16] = {0};                                                               \
            int i = 0;                                                                          \
            for (; i + 16 <= H; i += 16)                                                        \
                for (int j = 0; j < 16; j++) part[j] += xb[i + j] * xb[i + j];                  \
            float ss = 0.0f;                                                                    \
            for (int j = 0; j < 16; j++) ss += part[j];                                         \
            for (; i < H; i++) ss += xb[i] * xb[i];                                             \
            const float scale = 1.0f / sqrtf(ss / (float)H + eps);                              \
            for (i = 0; i < H; i++) ob[i] = (xb[i] * scale) * SCALAR_W_(w[i]);                  \
        }                                                                                       \
    }
HELM_DEFINE_RMS_NORM(f32, float, )
HELM_DEFINE_RMS_NORM(bf16, uint16_t, helm_bf16_f32)
HELM_DEFINE_RMS_NORM(f16, uint16_t, helm_f16_f32)

/* ---- q/k RMSNorm + rotary embedding ---- */

static void rope_qk(float *qkv, long ld, int Hq, int Hkv, int D, const float *qn, const float *kn,
                    float eps, const float *cos, const float *sin, long t0, long t1) {
    const int half = D / 2;
    for (long t = t0; t < t1; t++) {
        const float *restrict c = cos + t * half, *restrict s = sin + t * half;
        for (int hd = 0; hd < Hq + Hkv; hd++) {
            float *restrict x = qkv + t * ld + (long)hd * D;
            const float *w = hd < Hq ? qn : kn;
            if (w) rms_norm_f32(x, x, w, eps, D, 0, 1); /* in place: one row of D */
            /* The products are rounded separately, as in PyTorch's x1*c - x2*s (no FMA contraction). */
            for (int i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

/* ---- SiLU·mul ---- */

static void silu_mul(float *out, long ldo, const float *gate, long ldg, const float *up, long ldu,
                     long n, long b0, long b1) {
    for (long b = b0; b < b1; b++) {
        float *o = out + b * ldo;
        const float *g = gate + b * ldg, *u = up + b * ldu;
        for (long i = 0; i < n; i++) { /* g·sigmoid(g), with exp of -|g| only: no overflow */
            const float e = helm_expf(g[i] < 0.0f ? g[i] : -g[i]);
            o[i] = g[i] * ((g[i] < 0.0f ? e : 1.0f) / (1.0f + e)) * u[i];
        }
    }
}

static void to_bf16(uint16_t *dst, const float *src, long i0, long i1) {
    for (long i = i0; i < i1; i++) dst[i] = helm_f32_bf16(src[i]);
}

static void from_bf16(float *dst, const uint16_t *src, long i0, long i1) {
    for (long i = i0; i < i1; i++) dst[i] = helm_bf16_f32(src[i]);
}

static void from_f16(float *dst, const uint16_t *src, long i0, long i1) {
    long i = i0;
    for (; i + VL <= i1; i += VL) v_store(dst + i, v_load_f16(src + i));
    for (; i < i1; i++) dst[i] = helm_f16_f32(src[i]);
}

/* ---- read-bandwidth probe: the best streaming read this unit can issue ---- */

/* Sums nbytes as 64-bit words, reading 4 distant sequential streams (the four quarters of the
 * range) in lock-step with software prefetch, the access pattern the GEMV uses: one plain stream
 * per thread reaches well below the machine's bandwidth here. */
typedef uint64_t helm_line_t __attribute__((vector_size(64))); /* one cache line */

static uint64_t read_probe(const void *p, size_t nbytes) {
    enum { S = 4 };
    const char *base = (const char *)p;
    const size_t lines = nbytes / 64, per = lines / S; /* lines per stream */
    const long pf = helm_prefetch_bytes[HELM_F32];
    helm_line_t acc[S];
    memset(acc, 0, sizeof acc);
    for (size_t i = 0; i < per; i++)
        for (int s = 0; s < S; s++) {
            const char *line = base + ((size_t)s * per + i) * 64;
            if (pf) __builtin_prefetch(line + pf, 0, 3);
            helm_line_t v;
            memcpy(&v, line, 64);
            acc[s] += v;
        }
    for (size_t i = (size_t)S * per; i < lines; i++) {
        helm_line_t v;
        memcpy(&v, base + i * 64, 64);
        acc[0] += v;
    }
    uint64_t t = 0;
    for (int s = 0; s < S; s++)
        for (int j = 0; j < 8; j++) t += acc[s][j];
    return t;
}

/* ---- FMA-peak probe: 12 independent chains of vector FMAs, nothing else; returns a checksum
 * so that the loop is not optimised away. iters x 12 x VL FMAs. */
static float fma_peak(long iters) {
    vf a[12];
    const vf b = v_set1(0.999999f), c = v_set1(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = v_set1((float)i);
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) a[i] = v_fma(a[i], b, c);
    vf s = a[0];
    for (int i = 1; i < 12; i++) s = v_add(s, a[i]);
    return v_hsum(s);
}

const helm_kernel_table CAT(helm_table_, HELM_ISA) = {
    STR(HELM_ISA),
    {gemv_f32, HELM_GEMV_BF16, gemv_f16},
    {rms_norm_f32, rms_norm_bf16, rms_norm_f16},
    silu_mul,
    read_probe,
    rope_qk,
    {kv_write_f32, kv_write_bf16, kv_write_f16},
    {attention_f32, attention_bf16, attention_f16},
    to_bf16,
    from_bf16,
    from_f16,
    {gemm_f32, gemm_bf16, gemm_f16},
    fma_peak,
};
