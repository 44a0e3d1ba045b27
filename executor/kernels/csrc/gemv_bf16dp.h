/* gemv_bf16dp.h — bf16-weight GEMV on AVX512-BF16 (VDPBF16PS), included by kernels_impl.h in the
 * avx512bf16 unit only. x is split once per call into bf16 hi + lo parts (x ≈ hi + lo to ~16
 * mantissa bits); each product of two bf16 is exact in fp32, so the result matches the fp32
 * reference about as closely as the upcasting kernel does, with two instructions per 32 weights.
 * VDPBF16PS reads subnormal bf16 (|w| < 2^-126) as zero, the one difference in results. */

/* Per-thread scratch for the split x: grown on demand, kept for the thread's lifetime. */
static __thread uint16_t *xs_buf = NULL;
static __thread size_t xs_cap = 0;

/* xs[b*2*K32 + k] = hi(x[b, k]), xs[b*2*K32 + K32 + k] = lo(x[b, k]) for k < K32. */
static uint16_t *xs_prepare(const float *x, int B, int K, int K32) {
    const size_t need = (size_t)B * 2 * (size_t)K32 + 32;
    if (need > xs_cap) {
        free(xs_buf);
        xs_buf = (uint16_t *)malloc(need * sizeof(uint16_t));
        xs_cap = xs_buf ? need : 0;
        if (!xs_buf) return NULL;
    }
    for (int b = 0; b < B; b++) {
        const float *xb = x + (size_t)b * K;
        uint16_t *hi = xs_buf + (size_t)b * 2 * K32, *lo = hi + K32;
        for (int k = 0; k < K32; k += 16) {
            const __m512 v = _mm512_loadu_ps(xb + k);
            const __m256bh h = _mm512_cvtneps_pbh(v);
            const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
            /* lo = x - hi where hi is finite; 0 where x rounded to ±inf (inf - inf would be NaN) */
            const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(hf), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
            const __m256bh l = _mm512_cvtneps_pbh(_mm512_maskz_sub_ps(finite, v, hf));
            _mm256_storeu_si256((__m256i *)(hi + k), (__m256i)h);
            _mm256_storeu_si256((__m256i *)(lo + k), (__m256i)l);
        }
    }
    return xs_buf;
}

/* As tile_* in gemv_tile.h: R rows `seg` rows apart, one from each of the thread's streams. */
HELM_INLINE void tile_bf16dp(float *restrict out, long ldo, const uint16_t *restrict xs, int K32,
                             const float *restrict x, const uint16_t *restrict w,
                             const float *restrict bias, int accum, int K, int n, long seg, const int R,
                             const int B, long pf) {
    const size_t rs = (size_t)seg * (size_t)K;
    const int S = B <= 3 ? 2 : 1; /* separate hi/lo accumulators while R·B is small */
    __m512 acc[4][HELM_MAX_TILE_B][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++) acc[r][b][s] = _mm512_setzero_ps();
    int k = 0;
    for (; k < K32; k += 32) {
        if (pf)
            for (int r = 0; r < R; r++) __builtin_prefetch(w + r * rs + k + pf, 0, 3);
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * rs + k);
            for (int b = 0; b < B; b++) {
                const uint16_t *xb = xs + (size_t)b * 2 * K32 + k;
                acc[r][b][0] = _mm512_dpbf16_ps(acc[r][b][0], wv, (__m512bh)_mm512_loadu_si512(xb));
                acc[r][b][S - 1] =
                    _mm512_dpbf16_ps(acc[r][b][S - 1], wv, (__m512bh)_mm512_loadu_si512(xb + K32));
            }
        }
    }
    float s[4][HELM_MAX_TILE_B];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            s[r][b] = _mm512_reduce_add_ps(S == 2 ? _mm512_add_ps(acc[r][b][0], acc[r][b][1]) : acc[r][b][0]);
    for (; k < K; k++) /* tail in exact fp32 */
        for (int r = 0; r < R; r++) {
            const float wk = helm_bf16_f32(w[r * rs + k]);
            for (int b = 0; b < B; b++) s[r][b] = s_fma(wk, x[(size_t)b * K + k], s[r][b]);
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) {
            float *o = out + (size_t)b * ldo + n + r * seg;
            const float y = s[r][b] + (bias ? bias[n + r * seg] : 0.0f);
            *o = accum ? *o + y : y;
        }
}

static void rows_bf16dp(float *out, long ldo, const uint16_t *xs, int K32, const float *x,
                        const uint16_t *w, const float *bias, int accum, int B, int K, int n0, int n1) {
    const long pf = helm_prefetch_bytes[HELM_BF16] / (long)sizeof(uint16_t);
#define HELM_DP_CASE(BB)                                                                    \
    case BB: {                                                                              \
        const int R = TILE_R(BB);                                                           \
        const int seg = (n1 - n0) / R;                                                      \
        for (int j = 0; j < seg; j++)                                                       \
            tile_bf16dp(out, ldo, xs, K32, x, w + (size_t)(n0 + j) * K, bias, accum, K, n0 + j, seg, \
                        R, BB, pf);                                                         \
        for (int n = n0 + R * seg; n < n1; n++)                                             \
            tile_bf16dp(out, ldo, xs, K32, x, w + (size_t)n * K, bias, accum, K, n, 0, 1, BB, pf);  \
        break;                                                                              \
    }
    switch (B) {
        HELM_DP_CASE(1)
        HELM_DP_CASE(2)
        HELM_DP_CASE(3)
        HELM_DP_CASE(4)
        HELM_DP_CASE(5)
        HELM_DP_CASE(6)
        HELM_DP_CASE(7)
        HELM_DP_CASE(8)
        default: break;
    }
#undef HELM_DP_CASE
}

/* helm_gemv_fn; each thread does exactly its own share (this variant ignores claims). */
static void gemv_bf16dp(float *out, long ldo, const float *x, const void *wv, const float *bias,
                        int accum, int B, int N, int K, int t, int nt, helm_claim *claims) {
    (void)claims;
    const uint16_t *w = (const uint16_t *)wv;
    const int n0 = (int)((long)N * t / nt), n1 = (int)((long)N * (t + 1) / nt);
    const int K32 = K - K % 32;
    const uint16_t *xs = xs_prepare(x, B, K, K32);
    if (!xs) { /* out of memory for a few KiB of scratch: fall back to the upcasting kernel */
        gemv_bf16(out, ldo, x, wv, bias, accum, B, N, K, t, nt, NULL);
        return;
    }
    if (B <= HELM_MAX_TILE_B) {
        rows_bf16dp(out, ldo, xs, K32, x, w, bias, accum, B, K, n0, n1);
        return;
    }
    long block = HELM_L2_BLOCK_BYTES / ((long)K * 2);
    if (block < 8) block = 8;
    for (int nb = n0; nb < n1; nb += (int)block) {
        const int ne = (n1 - nb < block) ? n1 : nb + (int)block;
        for (int b0 = 0; b0 < B; b0 += HELM_MAX_TILE_B) {
            const int bn = (B - b0 < HELM_MAX_TILE_B) ? B - b0 : HELM_MAX_TILE_B;
            rows_bf16dp(out + (size_t)b0 * ldo, ldo, xs + (size_t)b0 * 2 * K32, K32,
                        x + (size_t)b0 * K, w, bias, accum, bn, K, nb, ne);
        }
    }
}
