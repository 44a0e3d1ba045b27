/* decode_blocks.h — the fused decode step of a CPU stage (decode_blocks.c). */
#ifndef HELM_DECODE_BLOCKS_H
#define HELM_DECODE_BLOCKS_H

#include "helm_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A projection y = x Wᵀ + b: w [N, K] of dtype HELM_F32/BF16/F16, bias [N] fp32 or NULL. */
typedef struct helm_linear_desc {
    const void *w;
    const float *bias;
    int N, K, dtype;
} helm_linear_desc;

/* One pre-norm decoder block (executor/stage.py BlockWeights); norms fp32, q/k norms NULL if the
 * model has none. qkv: H → (Hq + 2 Hkv)·D, o: Hq·D → H, gate_up: H → 2I (gate then up), down: I → H. */
typedef struct helm_block_desc {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    helm_linear_desc qkv, o, gate_up, down;
} helm_block_desc;

/* Shapes shared by the stack; its KV cache pages are [nblocks, 2, Hkv, P, D] of kv_dtype. */
typedef struct helm_stack_desc {
    int H, Hq, Hkv, D, I, P, kv_dtype;
    float eps, scale;
} helm_stack_desc;

/* One sequence of the step: rows offset .. offset+count-1 are its tokens at positions start.. */
typedef struct helm_seq_desc {
    long offset, count, start;
    const void *const *pages; /* its page addresses, covering positions < start + count */
} helm_seq_desc;

/* fp32 activations, row-major with T rows: x [T, H] (the residual stream, updated in place),
 * h [T, H], qkv [T, (Hq + 2Hkv)·D], attn [T, Hq·D], gu [T, 2I], act [T, I]. Attention segments
 * (helm_att_split): att_partial, helm_decode_attention_floats(...) floats (NULL if 0), and att_done,
 * nblocks · Σ Hkv·count zeros. */
typedef struct helm_step_buffers {
    float *x, *h, *qkv, *attn, *gu, *act;
    float *att_partial;
    int *att_done;
} helm_step_buffers;

/* Floats of att_partial the step's sequences need. */
long helm_decode_attention_floats(const helm_stack_desc *m, const helm_seq_desc *seqs, int nseq);

/* Runs blocks 0..nblocks-1 (KV layers 0..nblocks-1) on the T rows of x with num_threads OpenMP
 * threads: writes each sequence's K/V for its positions, then attention over its pages. cos, sin:
 * [T, D/2]. claims: nblocks·4·num_threads set to HELM_CLAIM_INIT; counters: nblocks zeros. */
void helm_decode_blocks(const helm_kernel_table *tab, const helm_stack_desc *m,
                        const helm_block_desc *blocks, int nblocks, const helm_seq_desc *seqs,
                        int nseq, int T, const float *cos, const float *sin,
                        const helm_step_buffers *buf, int num_threads, helm_claim *claims,
                        long *counters);

#ifdef __cplusplus
}
#endif
#endif
