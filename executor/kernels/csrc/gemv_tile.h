/* gemv_tile.h — one register tile of the GEMV for one weight dtype, included once per dtype by
 * kernels_impl.h with WT (element type), WNAME (suffix), LOAD_W (VL elements → vf) and SCALAR_W
 * (one element → float) defined. A tile is R weight rows × B rows of x, all R row streams read
 * in lock-step so that each thread keeps R independent streams (plus prefetches) in flight. */

/* out[b*ldo + n + r] = bias[n + r] + dot(x[b, :], w[r, :])   for r < R, b < B.
 *   w: [R, K] (rows n..n+R-1 of the weight), x: [B, K]. R, B, U are compile-time constants after
 *   inlining: the accumulators acc[R][B][U] then live in registers; U > 1 unrolls k to break
 *   the FMA dependency chains when R·B alone is too few. */
HELM_INLINE void CAT(tile_, WNAME)(float *restrict out, long ldo, const float *restrict x,
                                   const WT *restrict w, const float *restrict bias, int K, int n,
                                   const int R, const int B, const int U, long pf) {
    vf acc[4][HELM_MAX_TILE_B][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            for (int u = 0; u < U; u++) acc[r][b][u] = v_zero();
    const int step = VL * U;
    int k = 0;
    for (; k + step <= K; k += step) {
        if (pf) {
            /* Same row, pf elements ahead; past the row's end, the matching row of the next
             * tile (R rows further), which is what this stream reads next. */
            const WT *p = (k + pf < K) ? w + k + pf : w + (size_t)(R - 1) * K + k + pf;
            for (int r = 0; r < R; r++)
                for (int l = 0; l < (int)(step * sizeof(WT)); l += 64)
                    __builtin_prefetch((const char *)(p + (size_t)r * K) + l, 0, 3);
        }
        for (int u = 0; u < U; u++)
            for (int r = 0; r < R; r++) {
                const vf wv = LOAD_W(w + (size_t)r * K + k + u * VL);
                for (int b = 0; b < B; b++)
                    acc[r][b][u] = v_fma(wv, v_load(x + (size_t)b * K + k + u * VL), acc[r][b][u]);
            }
    }
    for (; k + VL <= K; k += VL)
        for (int r = 0; r < R; r++) {
            const vf wv = LOAD_W(w + (size_t)r * K + k);
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
            const float wk = SCALAR_W(w[(size_t)r * K + k]);
            for (int b = 0; b < B; b++) s[r][b] += wk * x[(size_t)b * K + k];
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            out[(size_t)b * ldo + n + r] = s[r][b] + (bias ? bias[n + r] : 0.0f);
}

/* Rows n0..n1 for a batch of B <= HELM_MAX_TILE_B: full tiles of TILE_R(B) rows, then single rows. */
static void CAT(rows_, WNAME)(float *out, long ldo, const float *x, const WT *w, const float *bias,
                              int B, int K, int n0, int n1) {
    const long pf = helm_prefetch_bytes / (long)sizeof(WT);
#define HELM_ROWS_CASE(BB)                                                                   \
    case BB: {                                                                               \
        int n = n0;                                                                          \
        for (; n + TILE_R(BB) <= n1; n += TILE_R(BB))                                        \
            CAT(tile_, WNAME)(out, ldo, x, w + (size_t)n * K, bias, K, n, TILE_R(BB), BB,    \
                              TILE_U(BB), pf);                                               \
        for (; n < n1; n++)                                                                  \
            CAT(tile_, WNAME)(out, ldo, x, w + (size_t)n * K, bias, K, n, 1, BB, TILE_U(BB), \
                              pf);                                                           \
        break;                                                                               \
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
    if (B <= HELM_MAX_TILE_B) {
        CAT(rows_, WNAME)(out, ldo, x, w, bias, B, K, n0, n1);
        return;
    }
    long block = HELM_L2_BLOCK_BYTES / ((long)K * (long)sizeof(WT));
    if (block < 8) block = 8;
    for (int nb = n0; nb < n1; nb += (int)block) {
        const int ne = (n1 - nb < block) ? n1 : nb + (int)block;
        for (int b0 = 0; b0 < B; b0 += HELM_MAX_TILE_B) {
            const int bn = (B - b0 < HELM_MAX_TILE_B) ? B - b0 : HELM_MAX_TILE_B;
            CAT(rows_, WNAME)(out + (size_t)b0 * ldo, ldo, x + (size_t)b0 * K, w, bias, bn, K, nb,
                              ne);
        }
    }
}
