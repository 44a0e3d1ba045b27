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
/* How far ahead along K the scoring prefetches, in keys (x D x element size bytes). */
#ifndef HELM_ATT_PF_KEYS
#define HELM_ATT_PF_KEYS 32
#endif
/* Independent key ranges one attention item walks at once (see attention_*). */
#ifndef HELM_ATT_LANES
#define HELM_ATT_LANES 2
#endif

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

/* Scores of the nb keys at K. With prefetch (the first of the G heads): the K rows
 * HELM_ATT_PF_KEYS ahead (up to `ahead` more keys exist) and these keys' V rows are requested as
 * it goes: two streams in flight, where one core reading K then V alone reached ~9 GB/s here. */
static void CAT(att_scores_, WNAME)(float *sc, const float *q, const WT *K, const WT *V, int nb,
                                    long ahead, int D, float scale, int prefetch) {
    const long row = (long)D * (long)sizeof(WT);
    int j = 0;
    for (; j + HELM_ATT_KEYS <= nb; j += HELM_ATT_KEYS) {
        if (prefetch) {
            const char *k = (const char *)(K + (long)(j + HELM_ATT_PF_KEYS) * D), *v = (const char *)(V + (long)j * D);
            const long kb = (ahead - j - HELM_ATT_PF_KEYS < HELM_ATT_KEYS ? ahead - j - HELM_ATT_PF_KEYS : HELM_ATT_KEYS) * row;
            for (long b = 0; b < kb; b += 64) __builtin_prefetch(k + b, 0, 3);
            for (long b = 0; b < HELM_ATT_KEYS * row; b += 64) __builtin_prefetch(v + b, 0, 3);
        }
        CAT(att_scores_n_, WNAME)(sc + j, q, K + (long)j * D, D, scale, HELM_ATT_KEYS);
    }
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

/* One block of nb keys (at K, V) of a lane: for each of the G query heads, its scores, the
 * online-softmax update of (m, l) and of its output o. */
HELM_INLINE void CAT(att_block_, WNAME)(float *restrict m, float *restrict l, float *o, const float *q,
                                        const WT *Kb, const WT *Vb, int nb, long ahead, int G, int D,
                                        float scale) {
    float sc[HELM_ATT_BLOCK];
    for (int g = 0; g < G; g++) {
        CAT(att_scores_, WNAME)(sc, q + g * D, Kb, Vb, nb, ahead, D, scale, g == 0);
        const float mx = helm_max(sc, nb, m[g]);
        /* The first block rescales nothing (l = o = 0); exp(-inf) clamps to ~1e-38 there. */
        const float corr = helm_expf(m[g] - mx);
        for (int j = 0; j < nb; j++) sc[j] = helm_expf(sc[j] - mx);
        l[g] = l[g] * corr + helm_sum(sc, nb);
        m[g] = mx;
        CAT(att_values_, WNAME)(o + g * D, corr, sc, Vb, nb, D);
    }
}

/* Keys [0, kend) are split into HELM_ATT_LANES contiguous ranges (lanes), each with its own
 * online-softmax state, walked a block at a time in turn: one thread then streams 2·LANES
 * independent runs of memory (K and V of each lane), where one run of K then V reached ~9 GB/s
 * here against ~24 GB/s for the machine. The lanes merge at the end (a softmax over the union).
 * Short sequences (under two blocks per lane) take one lane; the split depends only on kend. */
static void CAT(attention_, WNAME)(float *out, long ldo, const float *qkv, long ld, int Hq,
                                   const helm_kv_pages *kv, long start, long T, float scale,
                                   long item) {
    const int P = kv->P, D = kv->D, G = Hq / kv->Hkv;
    const long h = item / T, t = item % T;
    const long kend = start + t + 1; /* causal: keys at positions <= start + t */
    const float *q = qkv + t * ld + h * G * D; /* the G query heads of KV head h, adjacent */
    float *o = out + t * ldo + h * G * D;      /* lane 0 accumulates in place */
    const int lanes = kend >= 2L * HELM_ATT_BLOCK * HELM_ATT_LANES ? HELM_ATT_LANES : 1;
    float m[HELM_ATT_LANES][G], l[HELM_ATT_LANES][G], spare[HELM_ATT_LANES - 1][G * D];
    float *lo[HELM_ATT_LANES];
    long key[HELM_ATT_LANES], end[HELM_ATT_LANES];
    for (int r = 0; r < lanes; r++) {
        lo[r] = r == 0 ? o : spare[r - 1];
        memset(lo[r], 0, sizeof(float) * (size_t)G * (size_t)D);
        for (int g = 0; g < G; g++) {
            m[r][g] = -INFINITY;
            l[r][g] = 0.0f;
        }
        /* lane boundaries on whole blocks, so the blocks are the same whatever the lane count */
        key[r] = kend * r / lanes / HELM_ATT_BLOCK * HELM_ATT_BLOCK;
        end[r] = r + 1 < lanes ? kend * (r + 1) / lanes / HELM_ATT_BLOCK * HELM_ATT_BLOCK : kend;
    }
    for (int busy = 1; busy;) {
        busy = 0;
        for (int r = 0; r < lanes; r++) {
            if (key[r] >= end[r]) continue;
            busy = 1;
            const long page = key[r] / P, j0 = key[r] % P;
            const long in_page = (page + 1) * P < end[r] ? P - j0 : end[r] - key[r];
            const int nb = in_page < HELM_ATT_BLOCK ? (int)in_page : HELM_ATT_BLOCK;
            const WT *K = (const WT *)kv->pages[page] + kv->layer_off + h * kv->head_stride + j0 * D;
            CAT(att_block_, WNAME)(m[r], l[r], lo[r], q, K, K + kv->v_off, nb, in_page, G, D, scale);
            key[r] += nb;
        }
    }
    for (int g = 0; g < G; g++) { /* merge: rescale every lane to the overall max */
        float mx = m[0][g];
        for (int r = 1; r < lanes; r++) mx = m[r][g] > mx ? m[r][g] : mx;
        float sum = 0.0f, w[HELM_ATT_LANES];
        for (int r = 0; r < lanes; r++) {
            w[r] = helm_expf(m[r][g] - mx);
            sum += l[r][g] * w[r];
        }
        float *og = o + g * D;
        for (int d = 0; d < D; d++) {
            float acc = og[d] * w[0];
            for (int r = 1; r < lanes; r++) acc += lo[r][g * D + d] * w[r];
            og[d] = acc / sum;
        }
    }
}
