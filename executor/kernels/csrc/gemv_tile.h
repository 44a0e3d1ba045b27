/* gemv_tile.h — one register tile of the GEMV for one weight dtype, included once per dtype by
 * kernels_impl.h with WT (element type), WNAME (suffix), LOAD_W (VL elements → vf) and SCALAR_W
 * (one element → float) defined. A thread splits its rows into R contiguous segments and a tile
 * takes one row from each, so each thread reads R independent sequential streams (measured here:
 * 4 distant streams per thread reach the machine's read bandwidth, 4 adjacent rows do not). */

/* out[b*ldo + n + r*seg] = bias[n + r*seg] + dot(x[b, :], w[r*seg*K : r*seg*K + K])
 *   for r < R, b < B: R weight rows `seg` rows apart, x: [B, K]. R, B, U are compile-time
 *   constants after inlining, so the accumulators acc[R][B][U] live in registers; U > 1 unrolls
 *   k to break the FMA dependency chains when R·B alone is too few. */
HELM_INLINE void CAT(tile_, WNAME)(float *restrict out, long ldo, const float *restrict x,
                                   const WT *restrict w, const float *restrict bias, int K, int n,
                                   long seg, const int R, const int B, const int U, long pf) {
    const size_t rs = (size_t)seg * (size_t)K; /* elements between the R row streams */
    vf acc[4][HELM_MAX_TILE_B][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            for (int u = 0; u < U; u++) acc[r][b][u] = v_zero();
    const int step = VL * U;
    int k = 0;
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
static void CAT(rows_, WNAME)(float *out, long ldo, const float *x, const WT *w, const float *bias,
                              int B, int K, int n0, int n1) {
    const long pf = helm_prefetch_bytes / (long)sizeof(WT);
#define HELM_ROWS_CASE(BB)                                                                    \
    case BB: {                                                                                \
        const int R = TILE_R(BB);                                                             \
        const int seg = (n1 - n0) / R;                                                        \
        for (int j = 0; j < seg; j++)                                                         \
            CAT(tile_, WNAME)(out, ldo, x, w + (size_t)(n0 + j) * K, bias, K, n0 + j, seg, R, \
                              BB, TILE_U(BB), pf);                                            \
        for (int n = n0 + R * seg; n < n1; n++)                                               \
            CAT(tile_, WNAME)(out, ldo, x, w + (size_t)n * K, bias, K, n, 0, 1, BB,           \
                              TILE_U(BB), pf);                                                \
        break;                                                                                \
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
