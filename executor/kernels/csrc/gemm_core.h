/* gemm_core.h — the dtype-independent half of the packed GEMM (gemm_tile.h has the per-dtype
 * half): the register micro-kernel and the packing of x, included once per ISA by kernels_impl.h.
 *
 * Prompt chunks multiply many rows of x by each weight, so the weights no longer bound the time,
 * the FMA units do. The GEMV (gemv_tile.h) computes dot products along k and ends every output in
 * a horizontal sum; this GEMM instead keeps a GEMM_MR x GEMM_NR block of outputs in registers and
 * updates it with outer products, one broadcast x value against GEMM_NR weights per FMA pair, the
 * way BLIS-style kernels reach the FMA peak. Both operands are packed first: x into GEMM_MR-row
 * panels ([k][GEMM_MR]), the weights into GEMM_NR-row panels ([k][GEMM_NR]) widened to fp32 on the
 * way (so bf16/fp16 weights cost one conversion per element per call, not per use), each panel
 * GEMM_KC columns deep so that a weight panel stays in L1 while the x panels stream past it. */

/* Rows of x per micro-tile: GEMM_MR x 2 accumulators + 2 weight vectors + 1 broadcast fit the
 * vector registers (12 + 3 of 16; 24 + 3 of 32). */
#if HELM_NVREGS >= 32
#define GEMM_MR 12
#else
#define GEMM_MR 6
#endif
#define GEMM_NR (2 * VL) /* weight rows (output columns) per micro-tile */
#ifndef GEMM_KC
/* k per packed panel: a weight micro-panel of GEMM_KC x GEMM_NR floats is 32 KiB, and the output
 * tile is loaded and stored once per panel, so deeper panels cost fewer passes over it (on AVX2,
 * 512 ran 5-10% faster than 256 on Qwen3-0.6B/1.7B projections at 128-512 rows, though the
 * micro-panel and the x panel then no longer share a 32 KiB L1 and stream from L2). */
#define GEMM_KC (8192 / GEMM_NR)
#endif
#ifndef GEMM_NC
#define GEMM_NC 128 /* weight rows packed at a time: GEMM_NC x GEMM_KC floats (256 KiB on AVX2), in L2 */
#endif
#define GEMM_MB (96 * GEMM_MR) /* rows of x packed at a time (a 512-token prompt chunk in one block) */

/* Per-thread packing buffers, grown on demand and kept for the thread's lifetime (OpenMP threads
 * are pooled), 64-byte aligned. */
static __thread float *helm_gemm_a = NULL, *helm_gemm_b = NULL;

static int helm_gemm_scratch(void) {
    if (!helm_gemm_a && posix_memalign((void **)&helm_gemm_a, 64, sizeof(float) * GEMM_MB * GEMM_KC)) {
        helm_gemm_a = NULL;
        return 0;
    }
    if (!helm_gemm_b && posix_memalign((void **)&helm_gemm_b, 64, sizeof(float) * GEMM_NC * GEMM_KC)) {
        helm_gemm_b = NULL;
        return 0;
    }
    return 1;
}

/* ap[p][k][i] = x[(m0 + p*MR + i)*K + k0 + k] for the rows m0..m0+mb (zeros past them). */
static void helm_gemm_pack_x(float *restrict ap, const float *restrict x, int K, int m0, int mb, int k0,
                             int kc) {
    for (int p = 0; p < mb; p += GEMM_MR) {
        float *restrict dst = ap + (size_t)p * kc;
        const int rows = mb - p < GEMM_MR ? mb - p : GEMM_MR;
        for (int i = 0; i < GEMM_MR; i++) {
            if (i < rows) {
                const float *restrict src = x + (size_t)(m0 + p + i) * K + k0;
                for (int k = 0; k < kc; k++) dst[k * GEMM_MR + i] = src[k];
            } else {
                for (int k = 0; k < kc; k++) dst[k * GEMM_MR + i] = 0.0f;
            }
        }
    }
}

/* c[i*ldc + j] for i < mr, j < nr, from the product of x panel a and weight panel b over kc:
 *   first: c = (accum ? c : 0) + (sum + bias[j])   (bias may be NULL)
 *   later k panels: c = c + sum. */
HELM_INLINE void helm_gemm_micro(int kc, const float *restrict a, const float *restrict b,
                                 float *restrict c, long ldc, int mr, int nr, int first, int accum,
                                 const float *restrict bias) {
    vf acc[GEMM_MR][2];
    for (int i = 0; i < GEMM_MR; i++) acc[i][0] = acc[i][1] = v_zero();
#pragma GCC unroll 4
    for (int k = 0; k < kc; k++) {
        const vf b0 = v_load(b + k * GEMM_NR), b1 = v_load(b + k * GEMM_NR + VL);
        for (int i = 0; i < GEMM_MR; i++) {
            const vf ai = v_set1(a[k * GEMM_MR + i]);
            acc[i][0] = v_fma(ai, b0, acc[i][0]);
            acc[i][1] = v_fma(ai, b1, acc[i][1]);
        }
    }
    const int load_c = !first || accum;
    if (nr == GEMM_NR) {
        const vf bias0 = first && bias ? v_load(bias) : v_zero();
        const vf bias1 = first && bias ? v_load(bias + VL) : v_zero();
        for (int i = 0; i < mr; i++) {
            float *ci = c + (size_t)i * ldc;
            vf y0 = acc[i][0], y1 = acc[i][1];
            if (first && bias) {
                y0 = v_add(y0, bias0);
                y1 = v_add(y1, bias1);
            }
            if (load_c) {
                y0 = v_add(v_load(ci), y0);
                y1 = v_add(v_load(ci + VL), y1);
            }
            v_store(ci, y0);
            v_store(ci + VL, y1);
        }
        return;
    }
    float tmp[GEMM_NR];
    for (int i = 0; i < mr; i++) {
        float *ci = c + (size_t)i * ldc;
        v_store(tmp, acc[i][0]);
        v_store(tmp + VL, acc[i][1]);
        for (int j = 0; j < nr; j++) {
            float y = tmp[j];
            if (first && bias) y = y + bias[j];
            ci[j] = load_c ? ci[j] + y : y;
        }
    }
}
