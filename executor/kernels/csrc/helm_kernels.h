/* helm_kernels.h — the C contract between the per-ISA kernel variants and the Cython layer.
 * Every variant (one translation unit per instruction set) exports one `helm_kernel_table` of
 * plain, single-threaded kernels over a range of rows; the caller owns threading and dispatch. */
#ifndef HELM_KERNELS_H
#define HELM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Weight element types, in the order of the `gemv` / `rms_norm` arrays of a table. */
enum { HELM_F32 = 0, HELM_BF16 = 1, HELM_F16 = 2, HELM_NUM_DTYPES = 3 };

/* Largest batch a GEMV register tile covers; bigger batches run in chunks of this many rows of x
 * over each L2-sized block of weight rows, so the weights are read from DRAM once. */
#define HELM_MAX_TILE_B 8

/* The unclaimed tiles [front, back) of one thread's share of a GEMV call, packed in one 64-bit
 * word (front in the low half); one per cache line. Each thread owns rows N*t/nt .. N*(t+1)/nt and
 * claims its tiles from the front; a thread done with its own share claims tiles of the others'
 * from the back, so neither waits at the end for the other. HELM_CLAIM_INIT: nothing claimed. */
typedef struct helm_claim {
    int64_t word;
    char pad[56];
} __attribute__((aligned(64))) helm_claim;
#define HELM_CLAIM_INIT ((int64_t)0x7fffffff << 32)

static inline void helm_claims_init(helm_claim *claims, int n) {
    for (int i = 0; i < n; i++) claims[i].word = HELM_CLAIM_INIT;
}

/* y = bias[n] + sum_k x[b*K + k] * w[n*K + k];  out[b*ldo + n] = accum ? out[b*ldo + n] + y : y
 *   for 0 <= b < B, 0 <= n < N (accum: the residual add fused into the projection), called once by
 * each of the nt threads t of a parallel region, with claims[nt] set to HELM_CLAIM_INIT before it
 * (or claims NULL: each thread does exactly its own share).
 *   out: [B, ldo] fp32, x: [B, K] fp32, w: [N, K] of the table slot's dtype, bias: [N] fp32 or NULL.
 * fp32 accumulation; any B >= 1, N, K >= 1. Every row is computed by one thread in a fixed order,
 * so the result does not depend on nt or on who claimed what. */
typedef void (*helm_gemv_fn)(float *out, long ldo, const float *x, const void *w, const float *bias,
                             int accum, int B, int N, int K, int t, int nt, helm_claim *claims);

/* out[b, :] = x[b, :] * rsqrt(mean(x[b, :]^2) + eps) * w   for b0 <= b < b1;  x, out: [*, H] fp32,
 * w: [H] of the slot's dtype. */
typedef void (*helm_rms_norm_fn)(float *out, const float *x, const void *w, float eps, int H,
                                 long b0, long b1);

/* out[b, i] = silu(gate[b, i]) * up[b, i] for b0 <= b < b1, i < n; rows `ld*` floats apart. */
typedef void (*helm_silu_mul_fn)(float *out, long ldo, const float *gate, long ldg, const float *up,
                                 long ldu, long n, long b0, long b1);

/* Keys the attention kernel scores per step of its online softmax (their G scores each stay in
 * L1); callers bound the query heads per KV head to G * (D + HELM_ATT_BLOCK) <= 8192 floats:
 * an item keeps G * D floats per extra lane on its (OpenMP thread's) stack. */
#define HELM_ATT_BLOCK 64

/* Where one layer of a sequence's paged KV cache lives (executor/kv_cache.py): page i of the
 * sequence holds positions i*P .. i*P + P-1 and is one buffer [L, 2 (K, V), Hkv, P, D] of the
 * table slot's dtype; the layer's K of KV head h is the [P, D] slab at
 * pages[i] + layer_off + h*head_stride (elements), its V v_off elements further on. */
typedef struct helm_kv_pages {
    const void *const *pages; /* base address of each page, oldest first */
    long layer_off;           /* layer * 2 * Hkv * P * D */
    long head_stride;         /* P * D */
    long v_off;               /* Hkv * P * D */
    int Hkv, P, D;
} helm_kv_pages;

/* For query rows t0 <= t < t1 of qkv ([T, ld] fp32; q heads at column 0, k heads at Hq*D, each D
 * wide): RMSNorm of each q head with weight qn and each k head with kn ([D] fp32; NULL: none), then
 * the rotary rotation of every q and k head in half-split pairs (i, i + D/2):
 *   x_i' = x_i*cos[t, i] - x_{i+D/2}*sin[t, i],  x_{i+D/2}' = x_{i+D/2}*cos[t, i] + x_i*sin[t, i]
 * in place; cos, sin: [T, D/2] fp32. */
typedef void (*helm_rope_qk_fn)(float *qkv, long ld, int Hq, int Hkv, int D, const float *qn,
                                const float *kn, float eps, const float *cos, const float *sin,
                                long t0, long t1);

/* Stores the K and V of qkv rows t0 <= t < t1 (K at column Hq*D, V at (Hq + Hkv)*D) as the KV of
 * positions start + t, converted to the slot's dtype (round to nearest even). */
typedef void (*helm_kv_write_fn)(const helm_kv_pages *kv, const float *qkv, long ld, int Hq,
                                 long start, long t0, long t1);

/* A sequence with few (KV head, query row) pairs splits its keys into segments, each its own work
 * item, so that every thread still streams KV (batch 1 of a model with 8 KV heads on a 16-core
 * machine, or one KV head on two cores): up to HELM_ATT_MIN_ITEMS items per sequence, segments
 * of at least HELM_ATT_SEG_KEYS keys. The count depends on the sequence alone (its pairs and the
 * keys of its last query), never on the threads or the other sequences of the step, so neither
 * changes its result. Each extra segment restarts the memory streams: on 2 threads with enough
 * pairs, 4 segments per pair cost 5-8% of a cold attention pass, hence the bound. */
#define HELM_ATT_SEG_KEYS 1024
#define HELM_ATT_MAX_SEGS 16
#define HELM_ATT_MIN_ITEMS 16
static inline int helm_att_segments(long keys, long pairs) {
    long s = keys / HELM_ATT_SEG_KEYS;
    const long want = (HELM_ATT_MIN_ITEMS + pairs - 1) / pairs;
    s = s < want ? s : want;
    return s < 1 ? 1 : s > HELM_ATT_MAX_SEGS ? HELM_ATT_MAX_SEGS : (int)s;
}

/* Where the segments of a sequence's items meet: partial [T*Hkv][segs][G*(D + 2)] floats (each
 * segment's running max m[G], sum l[G] and unnormalised output o[G*D]) and done [T*Hkv] zeros
 * (segments finished per (KV head, query row); the last one to finish merges them all, in
 * segment order). */
typedef struct helm_att_split {
    int segs;
    float *partial;
    int *done;
} helm_att_split;

/* Causal attention of one work item = (KV head h, query row t, segment s) with item = (h*T + t)*S
 * + s (S = split->segs, 1 when split is NULL): the Hq/Hkv query heads of h in qkv row t (position
 * start + t) over the keys at positions <= start + t (segment s of them), streamed page by page
 * with an online softmax; writes out[t*ldo + (h*G + g)*D + d], fp32, once every segment of
 * (h, t) is done. */
typedef void (*helm_attention_fn)(float *out, long ldo, const float *qkv, long ld, int Hq,
                                  const helm_kv_pages *kv, long start, long T, float scale,
                                  long item, const helm_att_split *split);

/* dst[i] = bf16(src[i]) (round to nearest even) / dst[i] = float(src[i]) for i0 <= i < i1: the
 * activation conversions around a bf16 GEMM handed to PyTorch. */
typedef void (*helm_to_bf16_fn)(uint16_t *dst, const float *src, long i0, long i1);
typedef void (*helm_from_bf16_fn)(float *dst, const uint16_t *src, long i0, long i1);
/* dst[i] = float(src[i]) for IEEE half src, i0 <= i < i1 (weight tiles widened for an fp32 GEMM). */
typedef void (*helm_from_f16_fn)(float *dst, const uint16_t *src, long i0, long i1);

/* The packed GEMM of prompt chunks (gemm_core.h): out[m*ldo + n] (+)= bias[n] + x[m, :] . w[n, :]
 * for m < M, n < N, as helm_gemm_fn below but register-blocked for many rows of x; thread t of nt
 * computes the columns n of its share (whole micro-tiles), so there are no claims. fp32
 * accumulation in k order per panel of GEMM_KC columns (8192 / (2 x vector width): 512 on AVX2,
 * 256 on AVX-512), each panel's sum added to out in
 * turn (with accum, out's old value is where the first panel's sum + bias lands: for K > GEMM_KC
 * that rounds differently from out + (x . w + bias)); the result depends on neither nt nor M. */
typedef void (*helm_gemm_fn)(float *out, long ldo, const float *x, const void *w, const float *bias,
                             int accum, int M, int N, int K, int t, int nt);

/* Reads nbytes (a multiple of 64) from p and returns a checksum: the read-bandwidth probe. */
typedef uint64_t (*helm_read_fn)(const void *p, size_t nbytes);

typedef struct helm_kernel_table {
    const char *isa;  /* "avx512bf16", "avx512", "avx2", "portable"; NULL if not compiled in */
    helm_gemv_fn gemv[HELM_NUM_DTYPES];
    helm_rms_norm_fn rms_norm[HELM_NUM_DTYPES];
    helm_silu_mul_fn silu_mul;
    helm_read_fn read;
    helm_rope_qk_fn rope_qk;
    helm_kv_write_fn kv_write[HELM_NUM_DTYPES];
    helm_attention_fn attention[HELM_NUM_DTYPES];
    helm_to_bf16_fn to_bf16;
    helm_from_bf16_fn from_bf16;
    helm_from_f16_fn from_f16;
    helm_gemm_fn gemm[HELM_NUM_DTYPES];
    float (*fma_peak)(long iters); /* iters x 12 x VL fp32 FMAs from registers: the peak probe */
} helm_kernel_table;

extern const helm_kernel_table helm_table_avx512bf16;
extern const helm_kernel_table helm_table_avx512;
extern const helm_kernel_table helm_table_avx2;
extern const helm_kernel_table helm_table_portable;

/* 1 if this CPU (and OS: XSAVE state enabled) can run the named variant, else 0. */
int helm_cpu_supports(const char *isa);

/* Distance, in bytes, that the GEMV kernels prefetch ahead along each weight-row stream, per weight
 * dtype (0 disables software prefetch); the read probe uses the fp32 one. Measured on the
 * development machine (B=1, 2-32 MiB weights, 2 threads): fp32 is flat from 256 to 3072 bytes;
 * bf16/fp16 gain 5-15% from 256 to 1024 bytes and another ~2% at 2048. */
extern long helm_prefetch_bytes[HELM_NUM_DTYPES];

#ifdef __cplusplus
}
#endif
#endif
