/* gemv_tile.h — the GEMV for one weight dtype, included once per dtype by kernels_impl.h with WT
 * (element type), WNAME (suffix), LOAD_W (VL elements → vf) and SCALAR_W (one element → float)
 * defined, and optionally LOAD_W_PAIR (2·VL elements → even-index vf, odd-index vf).
 * A thread splits its rows into R contiguous segments and a tile takes one row from each, so each
 * thread reads R independent sequential streams (measured here: 4 distant streams per thread reach
 * the machine's read bandwidth, 4 adjacent rows do not). */

/* out[b*ldo + n + r*seg] = bias[n + r*seg] + dot(x[b, :], w[r*seg*K : r*seg*K + K])
 *   for r < R, b < B: R weight rows `seg` rows apart, x: [B, K]. R, B, U are compile-time
 *   constants after inlining, so the accumulators acc[R][B][U] live in registers; U > 1 unrolls
 *   k to break the FMA dependency chains when R·B alone is too few.
 * With LOAD_W_PAIR, the first K2 columns use xs: x with each chunk of 2·VL columns stored as its
 *   VL even columns then its VL odd ones ([B, K2]), matching the pair load, which splits the
 *   weights without widening them (bf16: one shift and one mask per 2·VL weights). */
HELM_INLINE void CAT(tile_, WNAME)(float *restrict out, long ldo, const float *restrict x,
                                   const float *restrict xs, int K2, const WT *restrict w,
                                   const float *restrict bias, int K, int n, long seg,
                                   const int R, const int B, const int U, long pf) {
    const size_t rs = (size_t)seg * (size_t)K; /* elements between the R row streams */
    vf acc[4][HELM_MAX_TILE_B][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            for (int u = 0; u < U; u++) acc[r][b][u] = v_zero();
    int k = 0;
#ifdef LOAD_W_PAIR
    for (; B <= HELM_PAIR_MAX_B && k < K2; k += 2 * VL) {
        if (pf)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < (int)(2 * VL * sizeof(WT)); l += 64)
                    __builtin_prefetch((const char *)(w + r * rs + k + pf) + l, 0, 3);
        for (int r = 0; r < R; r++) {
            vf we, wo;
            LOAD_W_PAIR(w + r * rs + k, we, wo);
            for (int b = 0; b < B; b++) {
                const float *xb = xs + (size_t)b * K2 + k;
                acc[r][b][0] = v_fma(we, v_load(xb), acc[r][b][0]);
                acc[r][b][U - 1] = v_fma(wo, v_load(xb + VL), acc[r][b][U - 1]);
            }
        }
    }
#else
    (void)xs;
    (void)K2;
#endif
    const int step = VL * U;
    for (; k + step <= K; k += step) {
        /* pf elements ahead in each stream; past the row's end that is the stream's next row. */
        if (pf)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < (int)(step * sizeof(WT)); l += 64)
                    __builtin_prefetch((const char *)(w + r * rs + k + pf) + l, 0, 3);
        for (int u = 0; u < U; u++)
            for (int r = 0; r < R; r++) {
                const vf wv = LOAD_W(w + r * rs + k + u * VL);
                for (int b = 0; b < B; b++)
                    acc[r][b][u] = v_fma(wv, v_load(x + (size_t)b * K + k + u * VL), acc[r][b][u]);
            }
    }
    for (; k + VL <= K; k += VL)
        for (int r = 0; r < R; r++) {
            const vf wv = LOAD_W(w + r * rs + k);
            for (int b = 0; b < B; b++)
                acc[r][b][0] = v_fma(wv, v_load(x + (size_t)b * K + k), acc[r][b][0]);
        }
    float s[4][HELM_MAX_TILE_B];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) {
            vf a = acc[r][b][0];
            for (int u = 1; u < U; u++) a = v_add(a, acc[r][b][u]);
            s[r][b] = v_hsum(a);
        }
    for (; k < K; k++) /* tail: fewer than VL columns */
        for (int r = 0; r < R; r++) {
            const float wk = SCALAR_W(w[r * rs + k]);
            for (int b = 0; b < B; b++) s[r][b] = s_fma(wk, x[(size_t)b * K + k], s[r][b]);
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            out[(size_t)b * ldo + n + r * seg] = s[r][b] + (bias ? bias[n + r * seg] : 0.0f);
}

/* Rows n0..n1 for a batch of B <= HELM_MAX_TILE_B: R = TILE_R(B) segments of `seg` rows walked
 * in lock-step, then the leftover rows one at a time. */
static void CAT(rows_, WNAME)(float *out, long ldo, const float *x, const float *xs, int K2,
                              const WT *w, const float *bias, int B, int K, int n0, int n1) {
    const long pf = helm_prefetch_bytes / (long)sizeof(WT);
#define HELM_ROWS_CASE(BB)                                                                       \
    case BB: {                                                                                   \
        const int R = TILE_R(BB);                                                                \
        const int seg = (n1 - n0) / R;                                                           \
        for (int j = 0; j < seg; j++)                                                            \
            CAT(tile_, WNAME)(out, ldo, x, xs, K2, w + (size_t)(n0 + j) * K, bias, K, n0 + j, seg, \
                              R, BB, TILE_U(BB), pf);                                            \
        for (int n = n0 + R * seg; n < n1; n++)                                                  \
            CAT(tile_, WNAME)(out, ldo, x, xs, K2, w + (size_t)n * K, bias, K, n, 0, 1, BB,      \
                              TILE_U(BB), pf);                                                   \
        break;                                                                                   \
    }
    switch (B) {
        HELM_ROWS_CASE(1)
        HELM_ROWS_CASE(2)
        HELM_ROWS_CASE(3)
        HELM_ROWS_CASE(4)
        HELM_ROWS_CASE(5)
        HELM_ROWS_CASE(6)
        HELM_ROWS_CASE(7)
        HELM_ROWS_CASE(8)
        default: break;
    }
#undef HELM_ROWS_CASE
}

/* helm_gemv_fn for this dtype: batches above HELM_MAX_TILE_B run chunk by chunk over blocks of
 * weight rows small enough to stay in L2, so each weight byte comes from DRAM once. */
static void CAT(gemv_, WNAME)(float *out, long ldo, const float *x, const void *wv,
                              const float *bias, int B, int K, int n0, int n1) {
    const WT *w = (const WT *)wv;
    int K2 = 0;
    const float *xs = NULL;
#ifdef LOAD_W_PAIR
    if (B <= HELM_PAIR_MAX_B) {
        K2 = K - K % (2 * VL);
        xs = helm_deinterleave_x(x, B, K, K2, VL);
        if (!xs) K2 = 0; /* no scratch memory: every column takes the widening path */
    }
#endif
    if (B <= HELM_MAX_TILE_B) {
        CAT(rows_, WNAME)(out, ldo, x, xs, K2, w, bias, B, K, n0, n1);
        return;
    }
    long block = HELM_L2_BLOCK_BYTES / ((long)K * (long)sizeof(WT));
    if (block < 8) block = 8;
    for (int nb = n0; nb < n1; nb += (int)block) {
        const int ne = (n1 - nb < block) ? n1 : nb + (int)block;
        for (int b0 = 0; b0 < B; b0 += HELM_MAX_TILE_B) {
            const int bn = (B - b0 < HELM_MAX_TILE_B) ? B - b0 : HELM_MAX_TILE_B;
            CAT(rows_, WNAME)(out + (size_t)b0 * ldo, ldo, x + (size_t)b0 * K,
                              xs ? xs + (size_t)b0 * K2 : NULL, K2, w, bias, bn, K, nb, ne);
        }
    }
}
