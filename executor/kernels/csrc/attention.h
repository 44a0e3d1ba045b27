/* attention.h — the KV write and the paged attention for one KV dtype, included once per dtype by
 * kernels_impl.h with WT, WNAME, LOAD_W, SCALAR_W (as for gemv_tile.h) and STORE_W (float → WT,
 * round to nearest even) defined. Contracts: helm_kv_write_fn and helm_attention_fn in
 * helm_kernels.h.
 *
 * Why a kernel: decode attention reads each cached K and V once per token, so it is bound by
 * memory like the GEMV, and the PyTorch path paid for a conversion of every page to fp32 on every
 * step plus a dozen small ops per layer. Here each KV head's keys are streamed straight from the
 * pages (widened in registers), HELM_ATT_BLOCK keys at a time: for the G query heads sharing the
 * KV head (GQA), up to HELM_ATT_HEADS per pass, so each K and V row is loaded and widened once
 * for them, their scores, the online-softmax update (running max m, sum l; the output o rescaled
 * by exp(m_old - m_new)) and the weighted sum of the block's V, with o held in registers. */

/* Query heads of one KV head served by one pass over its K and V rows (GQA): each row is
 * loaded and widened once for up to this many heads. */
#define HELM_ATT_HEADS 4
/* Keys scored per pass of att_scores with 1-2 heads (4 with 3-4): HELM_ATT_KEYS·heads
 * independent FMA chains, enough to hide the FMA latency within 16 accumulators. */
#define HELM_ATT_KEYS 8
/* How far ahead along K the scoring prefetches, in keys (x D x element size bytes). */
#ifndef HELM_ATT_PF_KEYS
#define HELM_ATT_PF_KEYS 32
#endif
/* Software prefetch of K ahead and V in the scoring loop: 1.2-1.4x on a cold cache here, though
 * 0.7x on one hot in L3 (the prefetches hold line-fill buffers the loads then wait for). */
#ifndef HELM_ATT_PREFETCH
#define HELM_ATT_PREFETCH 1
#endif
/* Independent key ranges one attention item walks at once (see attention_*). */
#ifndef HELM_ATT_LANES
#define HELM_ATT_LANES 2
#endif

/* sc[g*HELM_ATT_BLOCK + i] = scale * dot(q_g, K[i*D .. i*D + D)) for i < NK keys and g < GG heads
 * (q_g = q + g*D): one FMA chain per (head, key) over whole vectors, then the scalar tail, so a
 * score does not depend on NK or GG. Each K vector is loaded and widened once for the GG heads. */
HELM_INLINE void CAT(att_scores_n_, WNAME)(float *restrict sc, const float *restrict q,
                                           const WT *restrict K, int D, float scale, const int NK,
                                           const int GG) {
    vf acc[HELM_ATT_HEADS][HELM_ATT_KEYS];
    for (int g = 0; g < GG; g++)
        for (int i = 0; i < NK; i++) acc[g][i] = v_zero();
    int d = 0;
    for (; d + VL <= D; d += VL)
        for (int i = 0; i < NK; i++) {
            const vf kv = LOAD_W(K + (long)i * D + d);
            for (int g = 0; g < GG; g++) acc[g][i] = v_fma(kv, v_load(q + (long)g * D + d), acc[g][i]);
        }
    for (int g = 0; g < GG; g++)
        for (int i = 0; i < NK; i++) {
            float s = v_hsum(acc[g][i]);
            for (int e = d; e < D; e++) s = s_fma(SCALAR_W(K[(long)i * D + e]), q[(long)g * D + e], s);
            sc[g * HELM_ATT_BLOCK + i] = s * scale;
        }
}

/* Scores of the nb keys at K for GG heads. With prefetch (the first head group): the K rows
 * HELM_ATT_PF_KEYS ahead (up to `ahead` more keys exist) and these keys' V rows are requested as
 * it goes: two streams in flight, where one core reading K then V alone reached ~9 GB/s here. */
HELM_INLINE void CAT(att_scores_, WNAME)(float *sc, const float *q, const WT *K, const WT *V, int nb,
                                         long ahead, int D, float scale, int prefetch, const int GG) {
    const long row = (long)D * (long)sizeof(WT);
    const int NK = GG <= 2 ? HELM_ATT_KEYS : HELM_ATT_KEYS / 2;
    int j = 0;
    for (; j + NK <= nb; j += NK) {
        if (HELM_ATT_PREFETCH && prefetch) {
            const char *k = (const char *)(K + (long)(j + HELM_ATT_PF_KEYS) * D), *v = (const char *)(V + (long)j * D);
            const long kb = (ahead - j - HELM_ATT_PF_KEYS < NK ? ahead - j - HELM_ATT_PF_KEYS : NK) * row;
            for (long b = 0; b < kb; b += 64) __builtin_prefetch(k + b, 0, 3);
            for (long b = 0; b < NK * row; b += 64) __builtin_prefetch(v + b, 0, 3);
        }
        CAT(att_scores_n_, WNAME)(sc + j, q, K + (long)j * D, D, scale, NK, GG);
    }
    for (; j < nb; j++) CAT(att_scores_n_, WNAME)(sc + j, q, K + (long)j * D, D, scale, 1, GG);
}

/* o_g[d0 .. d0 + U·VL) = o_g·corr_g + sum_j p_g[j] · V[j*D + d] for g < GG (o_g = o + g*D, p_g =
 * p + g*HELM_ATT_BLOCK): GG·U output vectors held in registers across the nb keys, each V vector
 * loaded and widened once for the GG heads. */
HELM_INLINE void CAT(att_values_u_, WNAME)(float *restrict o, const float *restrict corr,
                                           const float *restrict p, const WT *restrict V, int nb, int D,
                                           int d0, const int U, const int GG) {
    vf acc[HELM_ATT_HEADS][8];
    for (int g = 0; g < GG; g++) {
        const vf c = v_set1(corr[g]);
        for (int u = 0; u < U; u++) acc[g][u] = v_mul(v_load(o + (long)g * D + d0 + u * VL), c);
    }
    for (int j = 0; j < nb; j++) {
        const WT *vj = V + (long)j * D + d0;
        for (int u = 0; u < U; u++) {
            const vf vv = LOAD_W(vj + u * VL);
            for (int g = 0; g < GG; g++) acc[g][u] = v_fma(vv, v_set1(p[g * HELM_ATT_BLOCK + j]), acc[g][u]);
        }
    }
    for (int g = 0; g < GG; g++)
        for (int u = 0; u < U; u++) v_store(o + (long)g * D + d0 + u * VL, acc[g][u]);
}

/* o_g = o_g·corr_g + sum_{j < nb} p_g[j] · V[j*D ..] for g < GG: the online-softmax update of GG
 * query heads; at most 16 accumulators (U·GG <= 16). */
HELM_INLINE void CAT(att_values_, WNAME)(float *o, const float *corr, const float *p, const WT *V, int nb,
                                         int D, const int GG) {
    const int U = GG == 1 ? 8 : GG == 2 ? 8 : 4;
    int d = 0;
    for (; d + U * VL <= D; d += U * VL) CAT(att_values_u_, WNAME)(o, corr, p, V, nb, D, d, U, GG);
    for (; d + VL <= D; d += VL) CAT(att_values_u_, WNAME)(o, corr, p, V, nb, D, d, 1, GG);
    for (int g = 0; g < GG; g++)
        for (int e = d; e < D; e++) {
            float s = o[(long)g * D + e] * corr[g];
            for (int j = 0; j < nb; j++) s = s_fma(SCALAR_W(V[(long)j * D + e]), p[g * HELM_ATT_BLOCK + j], s);
            o[(long)g * D + e] = s;
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

/* One block of nb keys (at K, V) of a lane for GG query heads: their scores, the online-softmax
 * update of (m, l) and of their outputs o. */
HELM_INLINE void CAT(att_heads_, WNAME)(float *restrict m, float *restrict l, float *o, const float *q,
                                        const WT *Kb, const WT *Vb, int nb, long ahead, int D, float scale,
                                        int prefetch, const int GG) {
    float sc[HELM_ATT_HEADS * HELM_ATT_BLOCK], corr[HELM_ATT_HEADS];
    CAT(att_scores_, WNAME)(sc, q, Kb, Vb, nb, ahead, D, scale, prefetch, GG);
    for (int g = 0; g < GG; g++) {
        float *p = sc + g * HELM_ATT_BLOCK;
        const float mx = helm_max(p, nb, m[g]);
        /* The first block rescales nothing (l = o = 0; exp(-inf) is 0). */
        corr[g] = helm_expf(m[g] - mx);
        for (int j = 0; j < nb; j++) p[j] = helm_expf(p[j] - mx);
        l[g] = l[g] * corr[g] + helm_sum(p, nb);
        m[g] = mx;
    }
    CAT(att_values_, WNAME)(o, corr, sc, Vb, nb, D, GG);
}

/* One block of nb keys of a lane for all G query heads of the KV head, HELM_ATT_HEADS at a time
 * (the K and V rows come from DRAM for the first group, from cache for the others). */
HELM_INLINE void CAT(att_block_, WNAME)(float *restrict m, float *restrict l, float *o, const float *q,
                                        const WT *Kb, const WT *Vb, int nb, long ahead, int G, int D,
                                        float scale) {
    for (int g = 0; g < G; g += HELM_ATT_HEADS) {
        const int pf = g == 0;
        switch (G - g < HELM_ATT_HEADS ? G - g : HELM_ATT_HEADS) {
        case 1: CAT(att_heads_, WNAME)(m + g, l + g, o + (long)g * D, q + (long)g * D, Kb, Vb, nb, ahead, D, scale, pf, 1); break;
        case 2: CAT(att_heads_, WNAME)(m + g, l + g, o + (long)g * D, q + (long)g * D, Kb, Vb, nb, ahead, D, scale, pf, 2); break;
        case 3: CAT(att_heads_, WNAME)(m + g, l + g, o + (long)g * D, q + (long)g * D, Kb, Vb, nb, ahead, D, scale, pf, 3); break;
        default: CAT(att_heads_, WNAME)(m + g, l + g, o + (long)g * D, q + (long)g * D, Kb, Vb, nb, ahead, D, scale, pf, 4); break;
        }
    }
}

/* Keys [k0, k1) of KV head h for its G query heads q: split into HELM_ATT_LANES contiguous
 * ranges (lanes), each with its own online-softmax state, walked a block at a time in turn: one
 * thread then streams 2·LANES independent runs of memory (K and V of each lane), where one run of
 * K then V reached ~9 GB/s here against ~24 GB/s for the machine. The lanes merge at the end into
 * m, l and the unnormalised o (rescaled to m). Short ranges (under two blocks per lane) take one
 * lane; the split depends only on the range. An empty range leaves m = -inf, l = o = 0. */
static void CAT(att_range_, WNAME)(float *restrict m_out, float *restrict l_out, float *o, const float *q,
                                   const helm_kv_pages *kv, long h, long k0, long k1, float scale, int G) {
    const int P = kv->P, D = kv->D;
    const long n = k1 - k0;
    const int lanes = n >= 2L * HELM_ATT_BLOCK * HELM_ATT_LANES ? HELM_ATT_LANES : 1;
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
        key[r] = k0 + n * r / lanes / HELM_ATT_BLOCK * HELM_ATT_BLOCK;
        end[r] = r + 1 < lanes ? k0 + n * (r + 1) / lanes / HELM_ATT_BLOCK * HELM_ATT_BLOCK : k1;
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
            w[r] = m[r][g] == -INFINITY ? 0.0f : helm_expf(m[r][g] - mx); /* a lane with no keys */
            sum += l[r][g] * w[r];
        }
        float *og = o + g * D;
        for (int d = 0; d < D; d++) {
            float acc = og[d] * w[0];
            for (int r = 1; r < lanes; r++) acc += lo[r][g * D + d] * w[r];
            og[d] = acc;
        }
        m_out[g] = mx;
        l_out[g] = sum;
    }
}

/* First key of segment s of S over [0, kend), on a block boundary (segment S: kend). */
static inline long CAT(att_seg_key_, WNAME)(long kend, int s, int S) {
    return s >= S ? kend : kend * s / S / HELM_ATT_BLOCK * HELM_ATT_BLOCK;
}

/* One work item (helm_attention_fn): a (KV head, query row) whole, or one segment of it, the
 * last segment to finish merging the partials in segment order (so whichever thread runs it, the
 * result is the same). */
static void CAT(attention_, WNAME)(float *out, long ldo, const float *qkv, long ld, int Hq,
                                   const helm_kv_pages *kv, long start, long T, float scale,
                                   long item, const helm_att_split *split) {
    const int D = kv->D, G = Hq / kv->Hkv;
    const int S = split ? split->segs : 1;
    const long ht = item / S;
    const int s = (int)(item % S);
    const long h = ht / T, t = ht % T;
    const long kend = start + t + 1; /* causal: keys at positions <= start + t */
    const float *q = qkv + t * ld + h * G * D; /* the G query heads of KV head h, adjacent */
    float *o = out + t * ldo + h * G * D;
    if (S == 1) {
        float m[G], l[G];
        CAT(att_range_, WNAME)(m, l, o, q, kv, h, 0, kend, scale, G);
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) o[g * D + d] /= l[g];
        return;
    }
    const size_t stride = (size_t)G * (size_t)(D + 2);
    float *part = split->partial + (size_t)ht * (size_t)S * stride;
    float *p = part + (size_t)s * stride;
    CAT(att_range_, WNAME)(p, p + G, p + 2 * G, q, kv, h, CAT(att_seg_key_, WNAME)(kend, s, S),
                           CAT(att_seg_key_, WNAME)(kend, s + 1, S), scale, G);
    /* release our partial, acquire the others' */
    if (__atomic_add_fetch(&split->done[ht], 1, __ATOMIC_ACQ_REL) < S) return;
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY;
        for (int r = 0; r < S; r++) mx = part[r * stride + g] > mx ? part[r * stride + g] : mx;
        float sum = 0.0f, w[HELM_ATT_MAX_SEGS];
        for (int r = 0; r < S; r++) {
            w[r] = part[r * stride + g] == -INFINITY ? 0.0f : helm_expf(part[r * stride + g] - mx); /* no keys */
            sum += part[r * stride + G + g] * w[r];
        }
        float *og = o + g * D;
        for (int d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int r = 0; r < S; r++) acc += part[r * stride + 2 * G + g * D + d] * w[r];
            og[d] = acc / sum;
        }
    }
}
