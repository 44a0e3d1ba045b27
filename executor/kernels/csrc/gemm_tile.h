/* gemm_tile.h — the packed GEMM for one weight dtype (see gemm_core.h), included once per dtype
 * by kernels_impl.h with WT, WNAME, LOAD_W and SCALAR_W defined (as for gemv_tile.h). */

/* bp[p][k][j] = float(w[(n0 + p*NR + j)*K + k0 + k]) for the weight rows n0..n0+nb (zeros past
 * them): each row widened VL columns at a time with the vector load, then transposed through a
 * small L1 buffer into the panel. */
static void CAT(gemm_pack_w_, WNAME)(float *restrict bp, const WT *restrict w, int K, int n0, int nb,
                                      int k0, int kc) {
    float tmp[GEMM_NR * VL];
    for (int p = 0; p < nb; p += GEMM_NR) {
        float *restrict dst = bp + (size_t)p * kc;
        const int rows = nb - p < GEMM_NR ? nb - p : GEMM_NR;
        int k = 0;
        for (; k + VL <= kc; k += VL) {
            for (int j = 0; j < GEMM_NR; j++)
                v_store(tmp + j * VL, j < rows ? LOAD_W(w + (size_t)(n0 + p + j) * K + k0 + k) : v_zero());
            for (int kk = 0; kk < VL; kk++)
                for (int j = 0; j < GEMM_NR; j++) dst[(k + kk) * GEMM_NR + j] = tmp[j * VL + kk];
        }
        for (; k < kc; k++)
            for (int j = 0; j < GEMM_NR; j++)
                dst[k * GEMM_NR + j] = j < rows ? SCALAR_W(w[(size_t)(n0 + p + j) * K + k0 + k]) : 0.0f;
    }
}

/* helm_gemm_fn for this dtype: thread t of nt computes the output columns (weight rows) of its
 * share, [N*t/nt, N*(t+1)/nt) rounded to whole micro-tiles, for every row of x; the result of an
 * element depends on neither nt nor M. Without scratch memory the share falls back to the GEMV. */
static void CAT(gemm_, WNAME)(float *out, long ldo, const float *x, const void *wv, const float *bias,
                              int accum, int M, int N, int K, int t, int nt) {
    const WT *w = (const WT *)wv;
    const int tiles = (N + GEMM_NR - 1) / GEMM_NR;
    const int n0 = (int)((long)tiles * t / nt) * GEMM_NR;
    int n1 = (int)((long)tiles * (t + 1) / nt) * GEMM_NR;
    if (n1 > N) n1 = N;
    if (n0 >= n1) return;
    if (!helm_gemm_scratch()) {
        CAT(gemv_, WNAME)(out + n0, ldo, x, w + (size_t)n0 * K, bias ? bias + n0 : NULL, accum, M, n1 - n0,
                          K, 0, 1, NULL);
        return;
    }
    float *ap = helm_gemm_a, *bp = helm_gemm_b;
    for (int m0 = 0; m0 < M; m0 += GEMM_MB) {
        const int mb = M - m0 < GEMM_MB ? M - m0 : GEMM_MB;
        for (int k0 = 0; k0 < K; k0 += GEMM_KC) {
            const int kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
            const int first = k0 == 0;
            helm_gemm_pack_x(ap, x, K, m0, mb, k0, kc);
            for (int nc0 = n0; nc0 < n1; nc0 += GEMM_NC) {
                const int nb = n1 - nc0 < GEMM_NC ? n1 - nc0 : GEMM_NC;
                CAT(gemm_pack_w_, WNAME)(bp, w, K, nc0, nb, k0, kc);
                for (int j = 0; j < nb; j += GEMM_NR) {
                    const int nr = nb - j < GEMM_NR ? nb - j : GEMM_NR;
                    const float *bj = bp + (size_t)j * kc;
                    const float *bias_j = bias ? bias + nc0 + j : NULL;
                    for (int i = 0; i < mb; i += GEMM_MR) {
                        const int mr = mb - i < GEMM_MR ? mb - i : GEMM_MR;
                        helm_gemm_micro(kc, ap + (size_t)i * kc, bj, out + (size_t)(m0 + i) * ldo + nc0 + j, ldo,
                                        mr, nr, first, accum, bias_j);
                    }
                }
            }
        }
    }
}
