"""The torch backend's batched decode attention (every context padded to the longest and masked, query
heads grouped by their KV head) against plain attention over each sequence's own context."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.attention import CommonAttentionMetadata
from engine.kernels.torch.attention import TorchAttentionBackend


def decode_batch(seq_lens: list[int], block_size: int, num_blocks: int) -> CommonAttentionMetadata:
    """One new token per sequence; each sequence's blocks scattered over the cache."""
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(map(len, tables)), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    slots = [blocks[(n - 1) // block_size] * block_size + (n - 1) % block_size for blocks, n in zip(tables, seq_lens)]
    starts = list(range(len(seq_lens) + 1))
    return CommonAttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=len(seq_lens), num_tokens=len(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table, slot_mapping=torch.tensor(slots), max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, num_computed_tokens_cpu=[n - 1 for n in seq_lens])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("head_size, block_size", [(64, 16), (128, 32)])
def test_batched_decode_equals_attention_over_each_context(dtype, num_heads, num_kv_heads, head_size, block_size):
    torch.manual_seed(num_heads * 1000 + head_size + block_size)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 5, 70]  # within, at and across block ends
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    metadata = decode_batch(seq_lens, block_size, num_blocks)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    key, value = (torch.randn(len(seq_lens), num_kv_heads, head_size).to(dtype) for _ in range(2))
    scale = head_size ** -0.5
    out = TorchAttentionBackend.forward(query, key, value, cache, metadata, scale, block_size)
    group = num_heads // num_kv_heads
    for seq, n in enumerate(seq_lens):
        blocks = metadata.block_table[seq, :-(-n // block_size)].long()
        keys = cache[0][blocks].flatten(0, 1)[:n].float()  # [n, Hk, D], this step's key written in place
        values = cache[1][blocks].flatten(0, 1)[:n].float()
        assert torch.equal(keys[-1], key[seq].float()) and torch.equal(values[-1], value[seq].float())
        scores = torch.einsum("hd,nhd->hn", query[seq].float(), keys.repeat_interleave(group, dim=1)) * scale
        expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.repeat_interleave(group, dim=1))
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out[seq].float(), expected, **tolerance)
