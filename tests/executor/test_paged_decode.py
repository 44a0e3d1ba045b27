"""The paged decode-attention kernels (executor/paged_decode.py) against softmax attention over the
same pages gathered in plain PyTorch: on a GPU where there is one, else on the CPU under Triton's
interpreter (tests/conftest.py turns it on)."""
import pytest
import torch

from executor import paged_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if paged_decode.unsupported(64, 16, 4, DEVICE) is not None:
    pytest.skip(paged_decode.unsupported(64, 16, 4, DEVICE), allow_module_level=True)


def reference(q, slab_layer, table, positions, scale):
    """Each row's query heads over its pages' keys at or before its position, in float64."""
    q, slab_layer, table, positions = q.cpu(), slab_layer.cpu(), table.cpu(), positions.cpu()
    rows, h_q, d = q.shape
    h_kv = slab_layer.shape[2]
    out = torch.empty(rows, h_q, d, dtype=torch.float64)
    for r in range(rows):
        kv = slab_layer[table[r]].double()  # [pages, 2, H_kv, P, D]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(h_kv, -1, d)  # [H_kv, pages·P, D]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(h_kv, -1, d)
        visible = torch.arange(k.shape[1]) <= positions[r]
        for h in range(h_q):
            kv_h = h // (h_q // h_kv)
            scores = (k[kv_h] @ q[r, h].double()) * scale
            p = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0)
            out[r, h] = p @ v[kv_h]
    return out.reshape(rows, h_q * d)


def case(dtype, h_q, h_kv, d, page, pages, positions, slots=9, seed=0):
    """A slab of `slots` random pages, rows whose tables name distinct pages (padded ones the
    scratch slot, the last), and their queries as a view into a wider heads buffer, as the
    decode step lays them out."""
    g = torch.Generator().manual_seed(seed)
    slab = torch.randn(slots + 1, 3, 2, h_kv, page, d, generator=g).to(dtype)  # 3 layers: the middle one
    rows = len(positions)
    table = torch.full((rows, pages), slots, dtype=torch.int64)
    order = torch.randperm(slots, generator=g).tolist()
    for r, pos in enumerate(positions):
        used = pos // page + 1
        table[r, :used] = torch.tensor([order.pop() for _ in range(used)])
    heads = torch.randn(rows, h_q + 2 * h_kv, d, generator=g).to(dtype)
    index = torch.cat([torch.tensor(positions)[:, None], table], 1).to(DEVICE)  # positions: a strided column
    return heads[:, :h_q].to(DEVICE), slab[:, 1].to(DEVICE), index[:, 1:], index[:, 0]


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,h_kv,d,page,pages", [(8, 2, 16, 16, 12), (4, 4, 32, 32, 4), (16, 2, 64, 16, 5),
                                                   (3, 1, 16, 16, 8)])
@pytest.mark.parametrize("processors", [1, 64])
def test_paged_decode_attention_equals_softmax_over_the_gathered_pages(dtype, h_q, h_kv, d, page, pages, processors):
    """Rows at positions within the first page, at a page's last slot, a page's first, the last
    page's, and a padded row (position 0 on the scratch slot); one split, and (processors 64)
    several (processors 64): 3 splits of 64 keys at pages of 16 (a padded lane in the combine), 2
    at pages of 32, 2 over 80 keys (the last split past the table), and a group of 3 query heads."""
    positions = [3, 2 * page - 1, 3 * page, (pages - 1) * page + 2, 0]
    q, slab_layer, table, pos = case(dtype, h_q, h_kv, d, page, pages=pages, positions=positions, slots=24)
    scale = d ** -0.5
    per_split, splits = paged_decode.splits_for(len(positions), h_kv, pages * page, processors)
    assert (splits > 1) == (processors > 1)
    got = paged_decode.paged_decode_attention(q, slab_layer, table, pos, scale, processors)
    assert got.dtype == dtype and got.shape == (len(positions), h_q * d)
    want = reference(q, slab_layer, table, pos, scale)
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * want.abs().max().item(), err


def test_keys_after_the_position_are_never_read():
    """NaN in every slot after a row's position (and in the scratch slot) changes nothing: the
    blocks after it are skipped, the rest of its block masked."""
    positions = [100, 5]
    q, slab_layer, table, pos = case(torch.float32, 4, 2, 16, 16, pages=8, positions=positions)
    want = paged_decode.paged_decode_attention(q, slab_layer, table, pos, 0.25, 8)
    assert paged_decode.splits_for(2, 2, 128, 8)[1] == 2  # the second split's blocks, skipped for row 1
    poisoned = slab_layer.clone()
    for r, p in enumerate(positions):
        for i, slot in enumerate(table[r].tolist()):
            first_hidden = max(0, p + 1 - i * 16)
            poisoned[slot, :, :, first_hidden:] = float("nan")
    got = paged_decode.paged_decode_attention(q, poisoned, table, pos, 0.25, 8)
    assert torch.equal(got, want)


def test_splits_cover_the_keys_in_whole_blocks():
    for rows, h_kv, keys, sms in [(1, 8, 1024, 132), (16, 8, 4096, 132), (1, 1, 16, 132), (2, 4, 512, 1)]:
        per_split, splits = paged_decode.splits_for(rows, h_kv, keys, sms)
        block = min(paged_decode.MAX_BLOCK_N, keys)
        assert per_split % block == 0 and (splits - 1) * per_split < keys <= splits * per_split
        assert splits == 1 or rows * h_kv * (splits - 1) < 2 * sms  # no more splits than two programs an SM needs


def test_blocks_stay_within_a_page_and_the_register_budget():
    """A block never spans two pages and divides a split's keys; widened (fp32) blocks hold a
    quarter of a half-precision block's elements (compiled for sm_90, 64 keys at D = 128 in fp32
    spilled registers)."""
    for page in (16, 32, 512):
        for d in (16, 64, 128, 256):
            for fp32 in (False, True):
                n = paged_decode.block_n(page, d, fp32)
                assert n >= paged_decode.MIN_BLOCK and page % n == 0 and n & (n - 1) == 0
                per_split, _ = paged_decode.splits_for(1, 8, 4 * page, 132)
                assert per_split % n == 0
                assert n * d <= paged_decode.BLOCK_ELEMENTS["fp32" if fp32 else "half"] or n == paged_decode.MIN_BLOCK
    assert paged_decode.block_n(512, 128, True) == 16 and paged_decode.block_n(512, 128, False) == 64


def test_what_the_kernels_cannot_run_is_said():
    assert paged_decode.unsupported(128, 512, 4, DEVICE) is None
    assert "head_dim 80" in paged_decode.unsupported(80, 512, 4, DEVICE)
    assert "page of 8" in paged_decode.unsupported(128, 8, 4, DEVICE)
    assert "meta device" in paged_decode.unsupported(128, 512, 4, torch.device("meta"))
    assert paged_decode.first_launch_error(32, 8, 128, 16, torch.bfloat16, DEVICE) is None
    assert paged_decode.first_launch_error(32, 8, 48, 16, torch.bfloat16, DEVICE) is not None  # no such block
