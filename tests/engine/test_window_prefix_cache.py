"""Prefix caching with sliding-window groups: every group of one entry per token caches its own blocks, a window
group keeps the blocks its windows left behind cached (evictable), and a hit of L tokens counts only when the
full group holds all of [0, L) and each window group the blocks its window reaches from L on. Block manager
level (hits, cut-back after eviction, reference counts, no leaks through finish, abort and preemption), then
end to end with tiny gpt-oss and Gemma 4: the same tokens and logprobs with prefix caching on as off."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine import LLM, SamplingParams
from engine.core.block_manager import UNTAKEN_BLOCK, KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.scheduler_output import RunnerOutput
from engine.kv_cache_spec import CacheGroupLayout, CacheLayout

BLOCK, WINDOW = 4, 8
PREFIX = list(range(3, 27))  # 24 tokens: six blocks, three windows


def _manager(full_blocks: int = 64, window_blocks: int = 12) -> KVCacheManager:
    return KVCacheManager(CacheLayout(BLOCK, (CacheGroupLayout(1, None, full_blocks),
                                              CacheGroupLayout(1, WINDOW, window_blocks))))


def _request(tokens, request_id: str) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), max_tokens=64)


def _prefill(manager: KVCacheManager, request: Request):
    """Admit with the request's prefix hit and compute its whole prompt, as the scheduler and a step do."""
    hit = manager.find_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens - len(hit) * BLOCK, hit)
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    return hit


def _decode(manager: KVCacheManager, request: Request, steps: int) -> None:
    for _ in range(steps):
        request.append_token(999)
        assert manager.allocate(request, 1)
        request.num_computed_tokens += 1
        manager.cache_computed_blocks(request)


def _all_free(manager: KVCacheManager) -> bool:
    return (manager.num_free_blocks == manager.num_blocks
            and all(block.ref_count == 0 for m in manager.managers for block in m.blocks))


# ---- block managers ----------------------------------------------------------------------------------
def test_windowed_layouts_enable_prefix_caching_in_every_group():
    manager = _manager()
    assert manager.enable_prefix_caching and all(m.enable_prefix_caching for m in manager.managers)


def test_second_request_hits_a_prefix_longer_than_the_window():
    manager = _manager()
    writer = _request(PREFIX + [100] * 6, "writer")
    _prefill(manager, writer)
    full_ids, window_ids = list(writer.groups[0].block_ids), list(writer.groups[1].block_ids)
    manager.free(writer)
    reader = _request(PREFIX + [200] * 6, "reader")
    hit = _prefill(manager, reader)
    assert len(hit) == 6
    # A query from token 24 on reads tokens >= 17: blocks 4 and 5 of the window group, not those before.
    assert hit.group_block_ids == (full_ids[:6], [None] * 4 + window_ids[4:6])
    assert reader.groups[0].block_ids[:6] == full_ids[:6]
    assert reader.groups[1].block_ids[:6] == [UNTAKEN_BLOCK] * 4 + window_ids[4:6]
    assert reader.groups[1].num_released == 4
    assert manager.prefix_cache_hits == 24  # once per request, not once per group
    assert manager.prefix_cache_queries == 2 * 30
    manager.free(reader)
    assert _all_free(manager)


def test_blocks_that_left_the_window_stay_cached():
    manager = _manager()
    writer = _request(PREFIX + [100] * 6, "writer")
    _prefill(manager, writer)
    _decode(manager, writer, 12)  # the window moves on: its first blocks go back to the free queue
    window = manager.managers[1]
    released = writer.groups[1].block_ids[:writer.groups[1].num_released]
    assert len(released) >= 3
    assert all(window.blocks[b].ref_count == 0 and b in window.free_queue for b in released)
    reader = _request(PREFIX[:12] + [300] * 5, "reader")  # shares three blocks the writer's window left
    hit = _prefill(manager, reader)
    assert len(hit) == 3 and hit.group_block_ids[1] == [None] + released[1:3]
    manager.free(writer)
    manager.free(reader)
    assert _all_free(manager)


def test_hit_is_cut_back_when_the_window_blocks_were_evicted():
    manager = _manager(full_blocks=64, window_blocks=12)
    writer = _request(PREFIX, "writer")
    _prefill(manager, writer)
    manager.free(writer)  # window free queue: 6 never-used blocks, then the writer's blocks 5, 4, ... 0
    reader_tokens = PREFIX + [200] * 6
    filler = _request([1000 + i for i in range(28)], "filler")  # 7 window blocks: evicts the writer's block 5
    assert manager.allocate(filler, 28)
    assert len(manager.managers[0].lookup(_request(reader_tokens, "probe"), 7)) == 6  # full group: all there
    hit = manager.find_cached_prefix(_request(reader_tokens, "reader"))
    assert len(hit) == 5  # 20 tokens: a query from 20 on reads blocks 3 and 4, both still cached
    second_filler = _request([2000 + i for i in range(20)], "filler-2")  # the last 5 window blocks
    assert manager.allocate(second_filler, 20)
    assert len(manager.managers[0].lookup(_request(reader_tokens, "probe"), 7)) == 6
    assert len(manager.find_cached_prefix(_request(reader_tokens, "reader"))) == 0
    manager.free(filler)
    manager.free(second_filler)
    assert _all_free(manager)


def test_a_prefix_shorter_than_the_window_needs_every_block():
    manager = _manager()
    writer = _request(PREFIX[:6] + [100] * 6, "writer")
    _prefill(manager, writer)
    manager.free(writer)
    hit = _prefill(manager, _request(PREFIX[:6] + [200] * 6, "reader"))
    assert len(hit) == 1 and None not in hit.group_block_ids[1]


def test_running_requests_share_blocks_with_reference_counts():
    manager = _manager()
    full, window = manager.managers
    writer = _request(PREFIX + [100] * 6, "writer")
    _prefill(manager, writer)
    reader = _request(PREFIX + [200] * 6, "reader")
    hit = _prefill(manager, reader)
    shared_full, shared_window = hit.group_block_ids[0], hit.group_block_ids[1][4:]
    assert [full.blocks[b].ref_count for b in shared_full] == [2] * 6
    assert [window.blocks[b].ref_count for b in shared_window] == [2, 2]
    _decode(manager, writer, 2)  # the writer's window moves past blocks 4 and 5: the reader still holds them
    assert writer.groups[1].num_released == 6
    assert [window.blocks[b].ref_count for b in shared_window] == [1, 1]
    manager.free(writer)
    assert [full.blocks[b].ref_count for b in shared_full] == [1] * 6
    assert [window.blocks[b].ref_count for b in shared_window] == [1, 1]
    manager.free(reader)
    assert _all_free(manager)


def test_reset_prefix_cache_clears_every_group():
    manager = _manager()
    writer = _request(PREFIX, "writer")
    _prefill(manager, writer)
    assert not manager.reset_prefix_cache()  # in use
    assert all(m.cached_blocks for m in manager.managers)
    manager.free(writer)
    assert manager.reset_prefix_cache()
    assert not any(m.cached_blocks for m in manager.managers)
    assert len(manager.find_cached_prefix(_request(PREFIX, "reader"))) == 0


def test_finish_abort_and_preemption_leave_no_blocks_behind():
    """Requests sharing a long prefix under chunked prefill and a window group too small for all of them:
    some are preempted, one is aborted; at the end every block of both groups is free."""
    manager = _manager(full_blocks=24, window_blocks=8)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=128), manager)
    for index in range(6):
        scheduler.add_request(Request(f"r{index}", PREFIX + [100 + index] * (3 + index),
                                      SamplingParams(max_tokens=12, ignore_eos=True), max_tokens=12))
    aborted = None
    for steps in range(500):
        if not scheduler.has_unfinished:
            break
        scheduled = scheduler.schedule()
        sampled = [rid for rid in scheduled.num_scheduled_tokens
                   if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens]
        scheduler.update_from_output(scheduled, RunnerOutput(sampled, [[7]] * len(sampled)))
        for request in scheduler.running:
            for group in manager.managers:  # a running request holds a reference to each block it reads
                blocks = request.groups[group.group]
                assert all(group.blocks[b].ref_count > 0 for b in blocks.block_ids[blocks.num_released:])
        if aborted is None and steps >= 5 and scheduler.running:
            aborted = scheduler.running[0]
            scheduler.abort_requests([aborted.request_id])
    assert not scheduler.has_unfinished and aborted is not None and aborted.num_output_tokens < 12
    assert scheduler.num_preemptions > 0 and manager.prefix_cache_hits > 0
    assert _all_free(manager)


# ---- end to end: tiny gpt-oss and Gemma 4 (window 8 on their sliding layers) --------------------------
@pytest.fixture(scope="module", params=["gpt_oss", "gemma4"])
def windowed_dir(request, tmp_path_factory):
    assert tiny_models.GPT_OSS_CONFIG["sliding_window"] == tiny_models.GEMMA4_CONFIG["sliding_window"] == WINDOW
    make = {"gpt_oss": tiny_models.make_tiny_gpt_oss, "gemma4": tiny_models.make_tiny_gemma4}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
FIRST = PREFIX + list(range(40, 46))  # 30 tokens
CASES = {  # second prompt -> tokens it should find cached
    "shared prefix longer than the window": (PREFIX + list(range(60, 66)), 24),
    "shared prefix shorter than the window": (PREFIX[:6] + list(range(60, 70)), 4),
    "diverges inside the window": (FIRST[:22] + list(range(60, 68)), 20),
}


def _engine(folder, prefix_caching: bool, **extra) -> LLM:
    return LLM(str(folder), dtype="float32", block_size=BLOCK, show_progress=False,
               enable_prefix_caching=prefix_caching, **extra)


def _one_after_another(llm: LLM, prompts):
    return [llm.generate([prompt], PARAMS)[0] for prompt in prompts]


def _chosen_logprobs(output) -> list[float]:
    return [position[token].logprob for position, token in zip(output.logprobs, output.token_ids)]


def _same(cached, plain) -> None:
    assert cached.token_ids == plain.token_ids
    assert _chosen_logprobs(cached) == pytest.approx(_chosen_logprobs(plain), abs=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_prefix_caching_is_exact_with_window_groups(windowed_dir, case):
    second, expected_hit = CASES[case]
    llm = _engine(windowed_dir, True)
    cached = _one_after_another(llm, [FIRST, second])
    plain = _one_after_another(_engine(windowed_dir, False), [FIRST, second])
    assert cached[1].num_cached_tokens == expected_hit and llm.engine.stats()["prefix_cache_hits"] == expected_hit
    for ours, theirs in zip(cached, plain):
        _same(ours, theirs)
    stats = llm.engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_a_hit_reads_the_window_groups_cached_blocks(windowed_dir):
    """Negative control: the blocks a window group supplies are the ones the second request reads. Noise
    written into them (after the first request) changes its logprobs."""
    second, _ = CASES["shared prefix longer than the window"]
    llm = _engine(windowed_dir, True)
    _one_after_another(llm, [FIRST])
    manager = llm.engine.scheduler.block_manager
    window_group = next(i for i, m in enumerate(manager.managers) if m.window)
    hit = manager.find_cached_prefix(_request(second, "probe"))
    ids = [b for b in hit.group_block_ids[window_group] if b is not None]
    assert len(ids) == 2
    runner = llm.engine.executor.runner
    layers = [layer for layer in runner.cache_layers
              if "kv" in layer.cache_specs() and layer.cache_specs()["kv"].window == WINDOW]
    assert layers
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        noise = torch.randn(layer.kv_cache[:, ids].shape, generator=generator)
        layer.kv_cache[:, ids] = noise.to(layer.kv_cache.dtype)
    corrupted = _one_after_another(llm, [second])[0]
    plain = _one_after_another(_engine(windowed_dir, False), [FIRST, second])[1]
    assert corrupted.num_cached_tokens == 24
    assert _chosen_logprobs(corrupted) != pytest.approx(_chosen_logprobs(plain), abs=1e-4)


def test_exact_under_preemption_and_chunked_prefill(windowed_dir):
    """Prompts sharing a prefix, all at once, in a cache too small for them and 5-token chunks: preempted
    requests recompute (hitting what is still cached), and nothing leaks."""
    prompts = [PREFIX + [100 + i] * (2 + 3 * i) for i in range(4)] + [FIRST, CASES["diverges inside the window"][0]]
    extra = dict(num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=5, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    cached_llm = _engine(windowed_dir, True, **extra)
    cached = cached_llm.generate(prompts, params)
    plain = _engine(windowed_dir, False, **extra).generate(prompts, params)
    for ours, theirs in zip(cached, plain):
        _same(ours, theirs)
    stats = cached_llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
