"""The Triton mixture-of-experts ops against the torch reference: the experts' grouped GEMMs over skewed,
empty and partly remote (-1) routings, decode-sized and ragged batches, fp32 and bf16, shapes that are not
powers of two; the pair layout they run on; the fused softmax top-k router.

On a CUDA GPU the kernels run compiled; elsewhere under TRITON_INTERPRET=1, at tiny sizes."""
from __future__ import annotations


import pytest
import torch

from triton_device import DEVICE, ON_GPU  # noqa: E402  (skips the module without Triton)

from engine.kernels.torch import moe as reference  # noqa: E402
from engine.kernels.triton import moe, moe_routing  # noqa: E402

HIDDEN, INTER, EXPERTS = 96, 40, 8  # not powers of two: every tile has masked rows or columns


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """The largest error relative to the output's scale. bf16 allows a few units in the last place of the
    rounded intermediates (the interpreter truncates float32 to bf16 where a GPU rounds to nearest)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    limit = 1e-5 if dtype == torch.float32 else 3e-2
    error = float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())
    assert error < limit, error


def experts(dtype: torch.dtype, num_experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = INTER):
    # Scaled so activations stay near one: errors are then measured against a meaningful output scale.
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    return w13, w2


def routing(num_tokens: int, top_k: int, choices: list[int] | None = None, hot: int | None = None):
    """(weights, ids): distinct experts per token drawn from `choices` (default: all), or with `hot`, that
    expert first for every token but one."""
    choices = torch.tensor(choices if choices is not None else range(EXPERTS), device=DEVICE)
    scores = torch.rand(num_tokens, choices.numel(), device=DEVICE)
    if hot is not None:
        scores[1:, (choices == hot).nonzero()[0, 0]] = 2.0
    ids = choices[scores.topk(top_k, dim=-1).indices].to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    return weights / weights.sum(-1, keepdim=True), ids


def check_against_reference(x, w13, w2, weights, ids, tiles=None):
    actual = moe.fused_experts(x, w13, w2, weights, ids, tiles)
    assert_close_to_scale(actual, reference.fused_experts(x, w13, w2, weights, ids), x.dtype)
    return actual


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_decode_token_matches_reference(dtype):
    x = torch.randn(1, HIDDEN, device=DEVICE).to(dtype)
    check_against_reference(x, *experts(dtype), *routing(1, top_k=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 3])
def test_ragged_batch_with_idle_experts_matches_reference(dtype, top_k):
    """37 tokens (no multiple of any row tile) routed among 4 of the 8 experts: the rest receive none."""
    x = torch.randn(37, HIDDEN, device=DEVICE).to(dtype)
    check_against_reference(x, *experts(dtype), *routing(37, top_k, choices=[1, 2, 5, 6]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_expert_taking_most_tokens_matches_reference(dtype):
    x = torch.randn(45, HIDDEN, device=DEVICE).to(dtype)
    weights, ids = routing(45, top_k=2, hot=3)
    assert (ids == 3).sum() == 44
    check_against_reference(x, *experts(dtype), weights, ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pairs_of_remote_experts_contribute_nothing(dtype):
    """An expert-parallel rank passes -1 for experts held elsewhere: those pairs add nothing, and a token
    with no local expert at all comes out zero."""
    x = torch.randn(20, HIDDEN, device=DEVICE).to(dtype)
    w13, w2 = experts(dtype)
    weights, ids = routing(20, top_k=2)
    ids[torch.rand(20, 2, device=DEVICE) < 0.4] = -1
    ids[7] = -1
    out = check_against_reference(x, w13, w2, weights, ids)
    assert not out[7].any()
    assert not moe.fused_experts(x, w13, w2, weights, torch.full_like(ids, -1)).any()


@pytest.mark.parametrize("block_m", [16, 64])
def test_both_row_tiles_match_reference(block_m):
    """The decode tile (16 rows) and the prefill tile (64 rows) on the same batch."""
    x = torch.randn(30, HIDDEN, device=DEVICE)
    tiles = moe.MoeTiles(block_m=block_m, gate_up_block_n=32, gate_up_block_k=32, down_block_n=64,
                         down_block_k=16)
    check_against_reference(x, *experts(torch.float32), *routing(30, top_k=2), tiles=tiles)


def test_long_batches_run_in_chunks_of_tokens(monkeypatch):
    monkeypatch.setattr(moe, "PAIR_OUTPUT_BUDGET_BYTES", 7 * 2 * HIDDEN * 4)  # 7 tokens per chunk
    x = torch.randn(23, HIDDEN, device=DEVICE)
    check_against_reference(x, *experts(torch.float32), *routing(23, top_k=2))


def test_an_empty_batch_gives_an_empty_output():
    w13, w2 = experts(torch.bfloat16)
    x = torch.empty(0, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    out = moe.fused_experts(x, w13, w2, torch.empty(0, 2, device=DEVICE),
                            torch.empty(0, 2, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16


def test_align_pairs_puts_each_experts_pairs_in_whole_blocks_of_that_expert():
    ids = torch.tensor([[2, 0], [2, -1], [5, 2]], dtype=torch.int32, device=DEVICE)
    sorted_pairs, block_expert = moe.align_pairs(ids, num_experts=EXPERTS, block_m=4)
    sentinel = ids.numel()
    # Pair t * 2 + j is token t's slot j. Expert 0: pair 1; expert 2: pairs 0, 2, 5 (in any order within
    # the run); expert 5: pair 4; no local expert: pair 3; then unused blocks.
    blocks = [sorted(block) for block in sorted_pairs.view(-1, 4).tolist()]
    assert blocks[:4] == [[1, sentinel, sentinel, sentinel], [0, 2, 5, sentinel], [4, sentinel, sentinel, sentinel],
                          [3, sentinel, sentinel, sentinel]]
    assert block_expert.tolist()[:4] == [0, 2, 5, -1]
    assert all(expert == -1 for expert in block_expert.tolist()[4:])
    assert all(pair == sentinel for block in blocks[4:] for pair in block)


def test_align_pairs_places_every_pair_once_in_a_run_of_its_expert():
    """A skewed batch: runs of several blocks, idle experts, pairs with no local expert."""
    ids = routing(50, top_k=3, hot=6)[1]
    ids[torch.rand(50, 3, device=DEVICE) < 0.2] = -1
    sorted_pairs, block_expert = moe.align_pairs(ids, num_experts=EXPERTS, block_m=16)
    assert sorted_pairs.numel() == 16 * block_expert.numel() == 16 * moe.max_blocks(150, EXPERTS, 16)
    expert_of_row = block_expert.long().repeat_interleave(16)
    placed = sorted_pairs < ids.numel()
    assert sorted(sorted_pairs[placed].tolist()) == list(range(ids.numel()))
    torch.testing.assert_close(expert_of_row[placed], ids.reshape(-1).long()[sorted_pairs[placed].long()])


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 19, 100])  # one row per program up to 64 tokens, 16 rows above
def test_topk_softmax_matches_reference(renormalize, num_tokens):
    logits = torch.randn(num_tokens, 60, device=DEVICE)  # 60 experts: a masked tail in the expert tile
    weights, ids = moe.moe_topk_softmax(logits, 4, renormalize)
    expected_weights, expected_ids = reference.moe_topk_softmax(logits, 4, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_experts_replays_in_a_cuda_graph_with_new_routing():
    """No host reads and data-independent shapes: a captured decode batch follows whatever routing it is
    given at replay."""
    dtype = torch.bfloat16
    w13, w2 = experts(dtype)
    x = torch.randn(4, HIDDEN, device=DEVICE).to(dtype)
    weights, ids = routing(4, top_k=2)
    moe.fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_experts(x, w13, w2, weights, ids)
    new_weights, new_ids = routing(4, top_k=2, choices=[0, 7])
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_close_to_scale(out, reference.fused_experts(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("valid", ["none", "int", "device"])
@pytest.mark.parametrize("count", [False, True], ids=["no_count", "count"])
def test_route_mask_routes_padding_rows_nowhere_and_counts_like_the_reference(valid, count):
    rows, top_k = 37, 3
    ids = torch.randint(-1, EXPERTS, (rows, top_k), dtype=torch.int32, device=DEVICE)
    weights = torch.rand(rows, top_k, device=DEVICE)
    weights[25:] = float("nan")  # padding rows (25.., numbered 30.. from 5) may hold anything
    limit = {"none": None, "int": 30, "device": torch.tensor([30], device=DEVICE)}[valid]
    if valid == "none":
        weights = torch.nan_to_num(weights)
    counts = {name: torch.zeros(EXPERTS + 1, dtype=torch.int64, device=DEVICE) if count else None
              for name in ("triton", "torch")}
    got = moe_routing.moe_route_mask(weights, ids, 5, limit, counts["triton"])  # rows numbered from 5
    expected = reference.moe_route_mask(weights, ids, 5, limit, counts["torch"])
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])
    if valid != "none":
        assert got[1][25:].eq(-1).all() and got[0][25:].eq(0).all()
    if count:
        assert torch.equal(counts["triton"], counts["torch"]) and int(counts["triton"].sum()) == rows * top_k


@pytest.mark.parametrize("count", [False, True], ids=["no_count", "count"])
def test_local_slots_keep_this_ranks_experts_and_count_every_ranks_pairs(count):
    rows, top_k, hidden = 21, 4, 8
    ids = torch.randint(-1, EXPERTS, (rows, top_k), device=DEVICE).float()
    weights = torch.rand(rows, top_k, device=DEVICE)
    gathered = torch.cat((torch.randn(rows, hidden, device=DEVICE), ids, weights), dim=1)  # a column slice
    routing = gathered[:, hidden:]
    counts = {name: torch.zeros(EXPERTS + 1, dtype=torch.int64, device=DEVICE) if count else None
              for name in ("triton", "torch")}
    got = moe_routing.moe_local_slots(routing, 3, 3, counts["triton"])
    expected = reference.moe_local_slots(routing, 3, 3, counts["torch"])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert set(got[0].unique().tolist()) <= {-1, 0, 1, 2} and got[1][got[0] == -1].eq(0).all()
    if count:
        assert torch.equal(counts["triton"], counts["torch"])
