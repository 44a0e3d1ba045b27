"""The shape of the executor's steps: what its scheduler promises, and the planner prices.

The engine (executor/engine.py) runs every running sequence's next token and chunks of waiting
prompts together in one step; the GPU stage replays its decode steps as CUDA graphs padded to
power-of-two buckets (executor/device_step.py). The cost model prices prompt chunks and the GPU
stage's working memory (planner/working_set.py) at these sizes, so they have one owner, here.
"""
from __future__ import annotations

PREFILL_CHUNK_TOKENS = 512      # the executor prefills a long prompt in steps of at most this many tokens
MAX_STEP_TOKENS = 2048          # tokens in one step at most: decodes plus prompt chunks (without a plan)
MAX_RUNNING_SEQUENCES = 64      # sequences in one step at most (the daemon's default --max-batch)
# A CPU stage's prompt steps streamed to the GPU (executor/streamed_prefill.py): each weight crosses
# the link in pieces of at most this many bytes, into a ring of this many device slots (one being
# copied while one is multiplied, one spare so a copy never waits for the product before it)
STREAM_PIECE_BYTES = 32 << 20
STREAM_SLOTS = 3
# A streamed step takes at most this many prompt tokens (a plan's own, what its VRAM holds, is
# partition.stream_prefill_step_tokens): each step crosses every CPU-stage weight once, so larger
# steps cross them fewer times per prompt. The streamed path works through them a prompt chunk of
# rows at a time wherever that bounds memory (its price: working_set.streamed_step_bytes), and
# the GPU stage takes such a step in sub-steps no larger than the step it is priced for
# (executor/engine.py), so only the streamed blocks' own arrays grow with it.
STREAMED_STEP_TOKENS = MAX_STEP_TOKENS


def step_tokens(batch: int, context: int) -> int:
    """Tokens in one step at most under a plan for `batch` sequences of `context` tokens: a prompt
    chunk for each (the plan's working set is priced for it, planner/working_set.py)."""
    return min(MAX_STEP_TOKENS, max(1, batch) * min(PREFILL_CHUNK_TOKENS, max(1, context)))


def streams(prompt_tokens: float, min_rows: int | None) -> bool:
    """Whether a step whose prompt chunks hold `prompt_tokens` tokens (a mean over steps may be
    fractional) runs a CPU stage's blocks on the GPU, weights streamed, under a policy that streams
    from `min_rows` (None: never): executor/streamed_prefill.py decides so, and the cost model,
    the Recorder and recalibration read a step alike."""
    return min_rows is not None and round(prompt_tokens, 6) >= min_rows


def prompt_steps(prompt_tokens: int, stream_min_rows: int | None, chunk: int = PREFILL_CHUNK_TOKENS,
                 stream_chunk: int = STREAMED_STEP_TOKENS) -> list[tuple[int, int]]:
    """(first position, tokens) of the steps one request's prompt is computed in, alone in the
    engine (executor/engine.py schedules it so): chunks of `stream_chunk` tokens while they reach
    `stream_min_rows` and stream (None: a load that streams nothing), else of `chunk`."""
    steps, start = [], 0
    while start < prompt_tokens:
        n = min(stream_chunk, prompt_tokens - start)
        if stream_min_rows is None or n < stream_min_rows:
            n = min(n, chunk)
        steps.append((start, n))
        start += n
    return steps


def pieces(tokens: int, max_slice: int = PREFILL_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """(offset, tokens) of the pieces a sequence's chunk of `tokens` is cut into for a stage that
    takes a larger step in sub-steps (sub_steps; executor.batch.StepBatch.split): at most
    `max_slice` each, in order."""
    return [(a, min(max_slice, tokens - a)) for a in range(0, tokens, max_slice)]


def longest_gather(device_pages: int, page_size_tokens: int) -> int:
    """The most tokens of a sequence a GPU stage's prompt chunk gathers its K/V over for fused
    attention (executor/kv_cache.py KVCache.gathers; planner/working_set.py prices that gather):
    what the stage's device pages hold. A longer sequence's chunks take flash attention a page at
    a time (executor/attention.py segmented_prompt_attention; streamed where flash attention does
    not run)."""
    return device_pages * page_size_tokens


def sub_steps(batch: float, prompt: float, max_rows: int, max_slice: int = PREFILL_CHUNK_TOKENS,
              riders: float = 0) -> int:
    """The consecutive sub-steps a stage priced for steps of `max_rows` tokens takes a step of
    `batch` prompt chunks of `prompt` tokens each in (means round to whole ones), after `riders`
    decodes (the engine schedules them first): each chunk in pieces of at most `max_slice`, one
    piece of a sequence per sub-step, pieces packed in order as executor.batch.StepBatch.split
    packs them."""
    count = rows = 0
    last = None  # the sequence of the current sub-step's last piece
    decodes = max(0, round(riders))
    for seq in range(decodes + max(1, round(batch))):
        for _, n in pieces(1 if seq < decodes else max(1, round(prompt)), max_slice):
            if not count or rows + n > max_rows or last == seq:
                count, rows = count + 1, 0
            rows, last = rows + n, seq
    return count


def running_sequences(budget_pages: int) -> int:
    """Sequences a plan's working sets are priced for: as many as its KV budget has pages (short
    requests share them), at most MAX_RUNNING_SEQUENCES. An engine with a GPU stage runs no more
    at once (executor/engine.py), whatever page size it runs."""
    return max(1, min(MAX_RUNNING_SEQUENCES, budget_pages))


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1): the rows and pages a static decode step is padded to."""
    return 1 << (n - 1).bit_length()
