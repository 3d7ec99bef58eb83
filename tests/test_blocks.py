"""cpbook.engine.blocks: the pairs a step needs, and their merge (exactness through the
batched call is tested in test_engine_attention.py)."""

from unittest import mock

import numpy as np
import torch

from cpbook.core.attention import dense_attention
from cpbook.engine import blocks
from cpbook.engine.blocks import block_pairs, gather_pairs, merge_pairs


def test_block_pairs_skip_what_no_row_sees():
    """Two fresh prompts of 3 and 9 rows, blocks of 4: the short one is one pair, the long one
    1 + 2 + 3 pairs (its third row block sees key blocks 0..2), not 2 x 3 x 3 padded."""
    rows = np.array([3, 9])
    sees = np.array([[1, 2, 3, 3, 3, 3, 3, 3, 3], list(range(1, 10))])
    with mock.patch.object(blocks, "BLOCKS_PAY_OFF", 1.0):
        b = block_pairs(rows, sees, torch.float64, "cpu", 4)
    assert b.num_blocks == 1 + 3 and b.pair_block.tolist() == [0, 1, 2, 2, 3, 3, 3]
    assert b.pair_key_block.tolist() == [0, 0, 0, 1, 0, 1, 2]
    assert b.row_slot.tolist() == [0, 1, 2] + list(range(4, 13))


def test_pairs_merged_equal_one_causal_call():
    """Pairs of blocks 4 wide, through the same kernel and merged, give the dense causal
    attention of three fresh prompts (float64, <= 1e-12)."""
    g = torch.Generator().manual_seed(0)
    lens = [3, 9, 6]
    rows = np.array(lens)
    sees = np.zeros((3, 9), dtype=np.int64)
    for r, n in enumerate(lens):
        sees[r, :n] = np.arange(1, n + 1)
    with mock.patch.object(blocks, "BLOCKS_PAY_OFF", 1.0):
        b = block_pairs(rows, sees, torch.float64, "cpu", 4)
    q = torch.randn(sum(lens), 4, 8, generator=g, dtype=torch.float64)
    k4 = torch.randn(3, 2, 12, 8, generator=g, dtype=torch.float64)
    v4 = torch.randn(3, 2, 12, 8, generator=g, dtype=torch.float64)
    qp, kp, vp = gather_pairs(q, k4, v4, b)
    assert qp.shape == (b.pair_block.numel(), 4, 4, 8) and kp.shape[1:] == (2, 4, 8)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qp, kp, vp, 0.0, False, attn_mask=b.mask, scale=8**-0.5
    )
    out, lse = merge_pairs(out, lse, b)
    at = 0
    for r, n in enumerate(lens):
        kk = k4[r, :, :n].repeat_interleave(2, 0).transpose(0, 1)
        vv = v4[r, :, :n].repeat_interleave(2, 0).transpose(0, 1)
        ref, ref_lse = dense_attention(q[at : at + n], kk, vv, causal=True)
        assert (out[at : at + n] - ref).abs().max() <= 1e-12
        assert (lse[at : at + n] - ref_lse).abs().max() <= 1e-12
        at += n


def test_blocks_only_where_they_pay_off():
    """Eight fresh prompts of 5..512 rows in blocks of 128: 40 pairs, 29 % of the padded call's
    scores; eight of 512 rows: 80 pairs, 62 %, so the padded call is kept."""
    mixed = np.linspace(5, 512, 8).round().astype(np.int64)
    sees = np.minimum(np.arange(1, 513)[None], mixed[:, None])
    b = block_pairs(mixed, sees, torch.float32, "cpu", 128)
    assert b is not None and b.pair_block.numel() == 40
    same = np.full(8, 512)
    assert block_pairs(same, np.tile(np.arange(1, 513), (8, 1)), torch.float32, "cpu", 128) is None
