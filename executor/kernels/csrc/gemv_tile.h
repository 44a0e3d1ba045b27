/* gemv_tile.h — the GEMV for one weight dtype, included once per dtype by kernels_impl.h with WT
 * (element type), WNAME (suffix), WDTYPE (HELM_F32 / HELM_BF16 / HELM_F16), LOAD_W (VL elements → vf) and SCALAR_W (one element → float)
 * defined, and optionally LOAD_W_PAIR (2·VL elements → even-index vf, odd-index vf).
 * A thread splits its rows into R contiguous segments and a tile takes one row from each, so each
 * thread reads R independent sequential streams (measured here: 4 distant streams per thread reach
 * the machine's read bandwidth, 4 adjacent rows do not). */

/* out[b*ldo + n + r*seg] (+)= bias[n + r*seg] + dot(x[b, :], w[r*seg*K : r*seg*K + K])
 *   (added to what out holds when accum) for r < R, b < B: R weight rows `seg` rows apart, x: [B, K]. R, B, U are compile-time
 *   constants after inlining, so the accumulators acc[R][B][U] live in registers; U > 1 unrolls
 *   k to break the FMA dependency chains when R·B alone is too few.
 * With LOAD_W_PAIR, the first K2 columns use xs: x with each chunk of 2·VL columns stored as its
 *   VL even columns then its VL odd ones ([B, K2]), matching the pair load, which splits the
 *   weights without widening them (bf16: one shift and one mask per 2·VL weights). */
HELM_INLINE void CAT(tile_, WNAME)(float *restrict out, long ldo, const float *restrict x,
                                   const float *restrict xs, int K2, const WT *restrict w,
                                   const float *restrict bias, int accum, int K, int n, long seg,
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
        for (int b = 0; b < B; b++) {
            float *o = out + (size_t)b * ldo + n + r * seg;
            const float y = s[r][b] + (bias ? bias[n + r * seg] : 0.0f);
            *o = accum ? *o + y : y;
        }
}

/* Tiles j0..j1 of a share of rows n0.. walked as R segments of `seg` rows. */
HELM_INLINE void CAT(tiles_, WNAME)(float *out, long ldo, const float *x, const float *xs, int K2,
                                    const WT *w, const float *bias, int accum, int K, int n0, int seg, int j0,
                                    int j1, const int R, const int B, const int U, long pf) {
    for (int j = j0; j < j1; j++)
        CAT(tile_, WNAME)(out, ldo, x, xs, K2, w + (size_t)(n0 + j) * K, bias, accum, K, n0 + j, seg, R, B,
                          U, pf);
}

/* Thread t's part of a batch of B <= HELM_MAX_TILE_B rows of x: its own share as R = TILE_R(B)
 * segments walked in lock-step (tiles claimed from the front), its leftover rows one at a time,
 * then tiles left in the other threads' shares (claimed from the back). Without claims: its own
 * share only. */
static void CAT(rows_, WNAME)(float *out, long ldo, const float *x, const float *xs, int K2,
                              const WT *w, const float *bias, int accum, int B, int N, int K, int t,
                              int nt, helm_claim *claims) {
    const long pf = helm_prefetch_bytes[WDTYPE] / (long)sizeof(WT);
#define HELM_ROWS_CASE(BB)                                                                        \
    case BB: {                                                                                    \
        const int R = TILE_R(BB), U = TILE_U(BB);                                                 \
        const int n0 = (int)((long)N * t / nt), n1 = (int)((long)N * (t + 1) / nt);              \
        const int seg = (n1 - n0) / R;                                                            \
        int j0, n;                                                                                \
        if (!claims) {                                                                            \
            CAT(tiles_, WNAME)(out, ldo, x, xs, K2, w, bias, accum, K, n0, seg, 0, seg, R, BB, U, pf);   \
        } else {                                                                                  \
            while ((n = helm_claim_tiles(&claims[t], seg, HELM_CLAIM_OWNER_TILES, 0, &j0)) > 0)   \
                CAT(tiles_, WNAME)(out, ldo, x, xs, K2, w, bias, accum, K, n0, seg, j0, j0 + n, R, BB,   \
                                   U, pf);                                                        \
        }                                                                                         \
        for (int r = n0 + R * seg; r < n1; r++)                                                   \
            CAT(tile_, WNAME)(out, ldo, x, xs, K2, w + (size_t)r * K, bias, accum, K, r, 0, 1, BB, U, pf); \
        for (int v = 1; claims && v < nt; v++) {                                                  \
            const int u = (t + v) % nt;                                                           \
            const int u0 = (int)((long)N * u / nt), useg = ((int)((long)N * (u + 1) / nt) - u0) / R; \
            while ((n = helm_claim_tiles(&claims[u], useg, 1, 1, &j0)) > 0)                       \
                CAT(tiles_, WNAME)(out, ldo, x, xs, K2, w, bias, accum, K, u0, useg, j0, j0 + n, R, BB,  \
                                   U, pf);                                                        \
        }                                                                                         \
        break;                                                                                    \
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

/* helm_gemv_fn for this dtype. Batches above HELM_MAX_TILE_B (compute-bound: no claims) run
 * chunk by chunk over blocks of the thread's rows small enough to stay in L2, so each weight byte
 * comes from DRAM once. */
static void CAT(gemv_, WNAME)(float *out, long ldo, const float *x, const void *wv,
                              const float *bias, int accum, int B, int N, int K, int t, int nt,
                              helm_claim *claims) {
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
        CAT(rows_, WNAME)(out, ldo, x, xs, K2, w, bias, accum, B, N, K, t, nt, claims);
        return;
    }
    const int n0 = (int)((long)N * t / nt), n1 = (int)((long)N * (t + 1) / nt);
    long block = HELM_L2_BLOCK_BYTES / ((long)K * (long)sizeof(WT));
    if (block < 8) block = 8;
    for (int nb = n0; nb < n1; nb += (int)block) {
        const int ne = (n1 - nb < block) ? n1 : nb + (int)block;
        for (int b0 = 0; b0 < B; b0 += HELM_MAX_TILE_B) {
            const int bn = (B - b0 < HELM_MAX_TILE_B) ? B - b0 : HELM_MAX_TILE_B;
            /* rows nb..ne as a one-thread share: N = ne - nb rows from w + nb*K, out + nb */
            CAT(rows_, WNAME)(out + (size_t)b0 * ldo + nb, ldo, x + (size_t)b0 * K, NULL, 0,
                              w + (size_t)nb * K, bias ? bias + nb : NULL, accum, bn, ne - nb, K, 0, 1,
                              NULL);
        }
    }
}
