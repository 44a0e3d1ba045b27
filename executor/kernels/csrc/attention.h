/* attention.h — the KV write and the paged attention for one KV dtype, included once per dtype by
 * kernels_impl.h with WT, WNAME, LOAD_W, SCALAR_W (as for gemv_tile.h) and STORE_W (float → WT,
 * round to nearest even) defined. Contracts: helm_kv_write_fn and helm_attention_fn in
 * helm_kernels.h.
 *
 * Why a kernel: decode attention reads each cached K and V once per token, so it is bound by
 * memory like the GEMV, and the PyTorch path paid for a conversion of every page to fp32 on every
 * step plus a dozen small ops per layer. Here each KV head's keys are streamed straight from the
 * pages (widened in registers), HELM_ATT_BLOCK keys at a time: for each of the G query heads
 * sharing the KV head (GQA: the block comes from DRAM once, then from cache for the other heads)
 * its scores, the online-softmax update (running max m, sum l; the output o rescaled by
 * exp(m_old - m_new)) and the weighted sum of the block's V, with o held in registers. */

/* Keys scored per pass of att_scores: independent FMA chains, enough to hide the FMA latency. */
#define HELM_ATT_KEYS 8

/* sc[i] = scale * dot(q, K[i*D .. i*D + D)) for i < NK (1 or HELM_ATT_KEYS): one FMA chain per key
 * over whole vectors, then the scalar tail, so a key's score does not depend on NK. */
HELM_INLINE void CAT(att_scores_n_, WNAME)(float *restrict sc, const float *restrict q,
                                           const WT *restrict K, int D, float scale, const int NK) {
    vf acc[HELM_ATT_KEYS];
    for (int i = 0; i < NK; i++) acc[i] = v_zero();
    int d = 0;
    for (; d + VL <= D; d += VL) {
        const vf qv = v_load(q + d);
        for (int i = 0; i < NK; i++) acc[i] = v_fma(LOAD_W(K + (long)i * D + d), qv, acc[i]);
    }
    for (int i = 0; i < NK; i++) {
        float s = v_hsum(acc[i]);
        for (int e = d; e < D; e++) s = s_fma(SCALAR_W(K[(long)i * D + e]), q[e], s);
        sc[i] = s * scale;
    }
}

static void CAT(att_scores_, WNAME)(float *sc, const float *q, const WT *K, int nb, int D, float scale) {
    int j = 0;
    for (; j + HELM_ATT_KEYS <= nb; j += HELM_ATT_KEYS)
        CAT(att_scores_n_, WNAME)(sc + j, q, K + (long)j * D, D, scale, HELM_ATT_KEYS);
    for (; j < nb; j++) CAT(att_scores_n_, WNAME)(sc + j, q, K + (long)j * D, D, scale, 1);
}

/* o[d0 .. d0 + U·VL) = o·corr + sum_j p[j] · V[j*D + d]: U output vectors held in registers
 * across the nb keys. */
HELM_INLINE void CAT(att_values_u_, WNAME)(float *restrict o, float corr, const float *restrict p,
                                           const WT *restrict V, int nb, int D, int d0, const int U) {
    vf acc[8];
    const vf c = v_set1(corr);
    for (int u = 0; u < U; u++) acc[u] = v_mul(v_load(o + d0 + u * VL), c);
    for (int j = 0; j < nb; j++) {
        const vf pj = v_set1(p[j]);
        const WT *vj = V + (long)j * D + d0;
        for (int u = 0; u < U; u++) acc[u] = v_fma(LOAD_W(vj + u * VL), pj, acc[u]);
    }
    for (int u = 0; u < U; u++) v_store(o + d0 + u * VL, acc[u]);
}

/* o = o·corr + sum_{j < nb} p[j] · V[j*D ..]: the online-softmax update of one query head. */
static void CAT(att_values_, WNAME)(float *o, float corr, const float *p, const WT *V, int nb, int D) {
    int d = 0;
    for (; d + 8 * VL <= D; d += 8 * VL) CAT(att_values_u_, WNAME)(o, corr, p, V, nb, D, d, 8);
    for (; d + 4 * VL <= D; d += 4 * VL) CAT(att_values_u_, WNAME)(o, corr, p, V, nb, D, d, 4);
    for (; d + VL <= D; d += VL) CAT(att_values_u_, WNAME)(o, corr, p, V, nb, D, d, 1);
    for (; d < D; d++) {
        float s = o[d] * corr;
        for (int j = 0; j < nb; j++) s = s_fma(SCALAR_W(V[(long)j * D + d]), p[j], s);
        o[d] = s;
    }
}

static void CAT(kv_write_, WNAME)(const helm_kv_pages *kv, const float *qkv, long ld, int Hq,
                                  long start, long t0, long t1) {
    const int Hkv = kv->Hkv, P = kv->P, D = kv->D;
    for (long t = t0; t < t1; t++) {
        const long pos = start + t;
        WT *page = (WT *)kv->pages[pos / P] + kv->layer_off + (pos % P) * D;
        const float *row = qkv + t * ld + (long)Hq * D;
        for (int h = 0; h < Hkv; h++) {
            const float *k = row + (long)h * D, *v = row + (long)(Hkv + h) * D;
            WT *kd = page + h * kv->head_stride, *vd = kd + kv->v_off;
            for (int d = 0; d < D; d++) kd[d] = STORE_W(k[d]);
            for (int d = 0; d < D; d++) vd[d] = STORE_W(v[d]);
        }
    }
}

static void CAT(attention_, WNAME)(float *out, long ldo, const float *qkv, long ld, int Hq,
                                   const helm_kv_pages *kv, long start, long T, float scale,
                                   long item) {
    const int P = kv->P, D = kv->D, G = Hq / kv->Hkv;
    const long h = item / T, t = item % T;
    const long kend = start + t + 1; /* causal: keys at positions <= start + t */
    const float *q = qkv + t * ld + h * G * D; /* the G query heads of KV head h, adjacent */
    float *o = out + t * ldo + h * G * D;      /* accumulated in place */
    float m[G], l[G], sc[HELM_ATT_BLOCK]; /* running max and sum per head; a block's scores */
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)G * (size_t)D);
    for (long p0 = 0; p0 < kend; p0 += P) {
        const WT *K = (const WT *)kv->pages[p0 / P] + kv->layer_off + h * kv->head_stride;
        const WT *V = K + kv->v_off;
        const long n = kend - p0 < P ? kend - p0 : P;
        for (long j0 = 0; j0 < n; j0 += HELM_ATT_BLOCK) {
            const int nb = n - j0 < HELM_ATT_BLOCK ? (int)(n - j0) : HELM_ATT_BLOCK;
            const WT *Kb = K + j0 * D, *Vb = V + j0 * D; /* this block's keys stay in L1/L2 for all G heads */
            for (int g = 0; g < G; g++) {
                float *sg = sc;
                CAT(att_scores_, WNAME)(sg, q + g * D, Kb, nb, D, scale);
                const float mx = helm_max(sg, nb, m[g]);
                /* The first block rescales nothing (l = o = 0); exp(-inf) clamps to ~1e-38 there. */
                const float corr = helm_expf(m[g] - mx);
                for (int j = 0; j < nb; j++) sg[j] = helm_expf(sg[j] - mx);
                l[g] = l[g] * corr + helm_sum(sg, nb);
                m[g] = mx;
                CAT(att_values_, WNAME)(o + g * D, corr, sg, Vb, nb, D);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *og = o + g * D;
        for (int d = 0; d < D; d++) og[d] /= l[g];
    }
}
