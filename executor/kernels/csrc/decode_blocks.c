/* decode_blocks.c — every transformer block of a CPU stage for one decode step, in one call and one
 * OpenMP parallel region.
 *
 * Why: at batch 1 a block is four DRAM-bound GEMVs and a handful of tiny ops. Run op by op from
 * Python, each tiny op costs more in interpreter dispatch, argument checks and the start of a
 * parallel region (5-20 µs, worse when the GEMVs have just flushed the caches) than its arithmetic,
 * and Qwen3-0.6B has ~12 of them in each of 28 blocks. Here the threads stay in one parallel region
 * for the whole stack and meet at a barrier between dependent phases; every phase calls the same
 * kernels (one ISA's helm_kernel_table) as the op-by-op path, with the same work split rules, so
 * the result is bit-identical to it.
 *
 * Compiled with the project's portable base flags: it only calls through the table. */
#include <omp.h>
#include <stddef.h>

#include "decode_blocks.h"

/* [lo, hi) of `n` items for thread t of nt, contiguous and balanced. */
static inline void helm_share(long n, int t, int nt, long *lo, long *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

static inline void gemv(const helm_kernel_table *tab, const helm_linear_desc *l, float *out,
                        const float *x, int accum, int T, int t, int nt, helm_claim *claims) {
    tab->gemv[l->dtype](out, l->N, x, l->w, l->bias, accum, T, l->N, l->K, t, nt, claims);
}

long helm_decode_attention_floats(const helm_stack_desc *m, const helm_seq_desc *seqs, int nseq) {
    long n = 0;
    for (int s = 0; s < nseq; s++) {
        const int S = helm_att_segments(seqs[s].start + seqs[s].count, (long)m->Hkv * seqs[s].count);
        if (S > 1) n += (long)m->Hkv * seqs[s].count * S * (m->Hq / m->Hkv) * (m->D + 2);
    }
    return n;
}

void helm_decode_blocks(const helm_kernel_table *tab, const helm_stack_desc *m,
                        const helm_block_desc *blocks, int nblocks, const helm_seq_desc *seqs,
                        int nseq, int T, const float *cos, const float *sin,
                        const helm_step_buffers *buf, int num_threads, helm_claim *claims,
                        long *counters) {
    const int H = m->H, Hq = m->Hq, Hkv = m->Hkv, D = m->D, I = m->I;
    const long ldq = (long)(Hq + 2 * Hkv) * D, lda = (long)Hq * D;
    /* attention work items of one layer: (sequence, KV head, query row, key segment) */
    long items = 0, hts = 0, part = 0;
    int segs[nseq];
    long seq_items[nseq], part_off[nseq], ht_off[nseq];
    for (int s = 0; s < nseq; s++) {
        segs[s] = helm_att_segments(seqs[s].start + seqs[s].count, (long)Hkv * seqs[s].count);
        seq_items[s] = (long)Hkv * seqs[s].count * segs[s];
        part_off[s] = part;
        ht_off[s] = hts;
        items += seq_items[s];
        hts += (long)Hkv * seqs[s].count;
        if (segs[s] > 1) part += seq_items[s] * (Hq / Hkv) * (D + 2);
    }

#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long r0, r1, c0, c1;
        helm_share(T, t, nt, &r0, &r1); /* rows of the step for the row-wise ops */
        helm_share(I, t, nt, &c0, &c1); /* columns of the SiLU·mul */
        for (int i = 0; i < nblocks; i++) {
            const helm_block_desc *b = blocks + i;
            helm_claim *cl = claims + (size_t)i * 4 * num_threads; /* one set per GEMV */
            const long layer_off = 2L * Hkv * m->P * D * (long)i;

            if (r0 < r1) tab->rms_norm[HELM_F32](buf->h, buf->x, b->input_norm, m->eps, H, r0, r1);
#pragma omp barrier
            gemv(tab, &b->qkv, buf->qkv, buf->h, 0, T, t, nt, cl);
#pragma omp barrier
            if (r0 < r1)
                tab->rope_qk(buf->qkv, ldq, Hq, Hkv, D, b->q_norm, b->k_norm, m->eps, cos, sin, r0, r1);
#pragma omp barrier
            for (int s = t; s < nseq; s += nt) {
                const helm_kv_pages kv = {seqs[s].pages, layer_off, (long)m->P * D, (long)Hkv * m->P * D,
                                          Hkv, m->P, D};
                tab->kv_write[m->kv_dtype](&kv, buf->qkv + seqs[s].offset * ldq, ldq, Hq, seqs[s].start,
                                           0, seqs[s].count);
            }
#pragma omp barrier
            /* Attention items handed out one at a time: sequences differ in length. */
            for (long it; (it = __atomic_fetch_add(&counters[i], 1, __ATOMIC_RELAXED)) < items;) {
                int s = 0;
                while (it >= seq_items[s]) it -= seq_items[s++];
                const helm_kv_pages kv = {seqs[s].pages, layer_off, (long)m->P * D, (long)Hkv * m->P * D,
                                          Hkv, m->P, D};
                const helm_att_split split = {segs[s], buf->att_partial + part_off[s],
                                              buf->att_done + (long)i * hts + ht_off[s]};
                tab->attention[m->kv_dtype](buf->attn + seqs[s].offset * lda, lda,
                                            buf->qkv + seqs[s].offset * ldq, ldq, Hq, &kv, seqs[s].start,
                                            seqs[s].count, m->scale, it, segs[s] > 1 ? &split : NULL);
            }
#pragma omp barrier
            gemv(tab, &b->o, buf->x, buf->attn, 1, T, t, nt, cl + num_threads); /* x += o(attn) */
#pragma omp barrier
            if (r0 < r1) tab->rms_norm[HELM_F32](buf->h, buf->x, b->post_norm, m->eps, H, r0, r1);
#pragma omp barrier
            gemv(tab, &b->gate_up, buf->gu, buf->h, 0, T, t, nt, cl + 2 * num_threads);
#pragma omp barrier
            if (c0 < c1)
                tab->silu_mul(buf->act + c0, I, buf->gu + c0, 2L * I, buf->gu + I + c0, 2L * I, c1 - c0, 0, T);
#pragma omp barrier
            gemv(tab, &b->down, buf->x, buf->act, 1, T, t, nt, cl + 3 * num_threads); /* x += down(act) */
#pragma omp barrier
        }
    }
}
