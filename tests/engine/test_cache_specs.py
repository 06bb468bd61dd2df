"""Cache specs and the two pools: block managers for compressed and sliding-window groups, the state slots,
the engine's admission over both pools, and an end-to-end probe model (tests/cache_probe_model.py) whose
window, compressed entries and per-request state must survive concurrency, chunked prefill and preemption
exactly, with every block and slot given back."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import cache_probe_model as probe
from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager, KVCacheManager
from engine.core.request import Request
from engine.kv_cache_spec import (CacheGroupLayout, CacheLayout, PagedSpec, StateSpec, entry_slots,
                                  group_blocks_for)

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 7, 13, 22, 35)] + [[9] * 17, list(range(200, 240))]


def _request(num_tokens: int, request_id: str = "r") -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(), max_tokens=100)


# ---- specs -------------------------------------------------------------------------------------------
def test_spec_groups_and_sizes():
    latent = PagedSpec((576,), torch.bfloat16, kind="mla")
    indexer = PagedSpec((128,), torch.bfloat16, kind="indexer")
    assert latent.group == indexer.group == (1, None) and latent.prefix_cacheable
    window = PagedSpec((512,), window=128)
    compressed = PagedSpec((512,), ratio=4)
    assert window.group == (1, 128) and compressed.group == (4, None)
    assert window.prefix_cacheable and not compressed.prefix_cacheable  # a window group caches what it keeps
    assert latent.bytes_per_block(16, torch.float32) == 16 * 576 * 2
    assert compressed.bytes_per_block(16, torch.float32) == 16 * 512 * 4  # the default dtype
    assert StateSpec((3, 8), torch.float32).bytes_per_slot(torch.bfloat16) == 96
    with pytest.raises(ValueError, match="ratio"):
        PagedSpec((4,), ratio=0)
    with pytest.raises(ValueError, match="window"):
        PagedSpec((4,), window=0)


def test_group_block_counts():
    full = group_blocks_for((1, None), 1000, 16, max_num_seqs=8, max_num_batched_tokens=256)
    compressed = group_blocks_for((4, None), 1000, 16, 8, 256)
    window = group_blocks_for((1, 128), 1000, 16, 8, 256)
    assert full == 1000
    assert compressed == 250 + 8  # a quarter, plus a partial block per running request
    assert window == 8 * (8 + 2) + 16  # every request's window and one step's new tokens
    assert group_blocks_for((1, 128), 20, 16, 8, 256) == 20  # never more than a full group's


def test_entry_slots_maps_entries_through_the_block_table():
    table = torch.tensor([[5, 2, 7], [1, 0, 0]], dtype=torch.int32)
    entries = torch.tensor([[0, 3, 4, 9, -1], [1, 2, -1, -1, -1]])
    slots = entry_slots(table, entries, block_size=4)
    assert slots.tolist() == [[20, 23, 8, 29, -1], [5, 6, -1, -1, -1]]


# ---- block managers ----------------------------------------------------------------------------------
def test_compressed_group_takes_a_block_per_block_size_entries():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, ratio=4)
    request = _request(64)
    assert manager.allocate(request, 17)  # entries 0..4: two blocks
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 17
    assert manager.allocate(request, 15)  # 32 tokens: 8 entries, still two blocks
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 32
    assert manager.allocate(request, 1)
    assert len(request.block_ids) == 3
    manager.free(request)
    assert manager.num_free_blocks == 8


def test_sliding_window_gives_back_blocks_outside_the_window():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False, window=6)
    request = _request(100)
    assert manager.allocate(request, 10)  # positions 0..9: three blocks
    assert manager.num_free_blocks == 1
    request.num_computed_tokens = 10  # the next query (position 10) reads positions 5..10: block 0 is out
    assert manager.allocate(request, 1)
    assert request.groups[0].num_released == 1 and manager.num_free_blocks == 2
    for computed in range(11, 40):  # decoding on in four blocks: the window never needs more
        request.num_computed_tokens = computed
        assert manager.allocate(request, 1), computed
    assert len(request.block_ids) == 10 and manager.num_free_blocks == 4 - (10 - request.groups[0].num_released)
    manager.free(request)
    assert manager.num_free_blocks == 4 and request.groups[0].num_released == 0


def test_sliding_window_refusal_takes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False, window=6)
    assert not manager.allocate(_request(40), 12)  # three blocks at once
    assert manager.num_free_blocks == 2


def _layout(num_slots: int = 2) -> CacheLayout:
    return CacheLayout(4, (CacheGroupLayout(1, None, 8), CacheGroupLayout(4, None, 2), CacheGroupLayout(1, 6, 5)),
                       num_state_slots=num_slots, state_bytes_per_slot=64)


def test_manager_admits_only_with_every_group_and_a_state_slot():
    manager = KVCacheManager(_layout(num_slots=2))
    assert not manager.enable_prefix_caching  # a compressed group and state: said at start
    first, second, third = _request(8, "a"), _request(8, "b"), _request(8, "c")
    assert manager.allocate(first, 8) and manager.allocate(second, 8)
    assert first.state_slot is not None and second.state_slot is not None and first.state_slot != second.state_slot
    assert [len(g.block_ids) for g in first.groups] == [2, 1, 2]
    free_before = manager.num_free_blocks
    assert not manager.allocate(third, 1)  # blocks left, but no state slot
    assert manager.num_free_blocks == free_before and third.state_slot is None
    manager.free(first)
    assert first.state_slot is None and all(not g.block_ids for g in first.groups)
    assert manager.allocate(third, 1)
    stats = manager.stats()
    assert stats["num_state_slots"] == 2 and stats["num_free_state_slots"] == 0 and stats["state_slot_usage"] == 1.0
    assert [g["ratio"] for g in stats["kv_cache_groups"]] == [1, 4, 1]


def test_manager_refuses_when_one_group_is_full():
    manager = KVCacheManager(_layout(num_slots=4))
    big = _request(40, "big")
    assert not manager.allocate(big, 40)  # the compressed group would need three blocks of its two
    assert manager.num_free_blocks == 8 + 2 + 5 and big.state_slot is None
    assert all(not g.block_ids for g in big.groups)


def test_layout_says_why_prefix_caching_is_off():
    assert CacheLayout.single(8, 16).prefix_caching_blocker is None
    windowed = CacheLayout(4, (CacheGroupLayout(1, None, 8), CacheGroupLayout(1, 6, 5)))
    assert windowed.prefix_caching_blocker is None  # window groups cache what their windows reach
    blocker = _layout().prefix_caching_blocker
    assert "one entry per 4 tokens" in blocker and "per-request state" in blocker and "window" not in blocker
    state_only = CacheLayout(4, (CacheGroupLayout(1, None, 8),), num_state_slots=2, state_bytes_per_slot=8)
    assert "per-request state" in state_only.prefix_caching_blocker


# ---- the engine, end to end, with the probe model ---------------------------------------------------
@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory, tiny_model_dirs):
    folder = tmp_path_factory.mktemp("cache_probe")
    for path in tiny_model_dirs["llama"].iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["CacheProbeForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config["vocab_size"]


@pytest.fixture(autouse=True)
def _probe_registered(monkeypatch):
    from engine import models
    monkeypatch.setitem(models._MODELS, "CacheProbeForCausalLM", ("cache_probe_model", "CacheProbeForCausalLM"))
    probe.CacheProbeLayer.errors.clear()
    yield
    assert probe.CacheProbeLayer.errors == [], probe.CacheProbeLayer.errors[:5]


def _expected(vocab_size: int) -> list[list[int]]:
    return [probe.expected_generation(p, GREEDY.max_tokens, vocab_size) for p in PROMPTS]


def _assert_pools_empty(llm) -> None:
    stats = llm.engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_free_state_slots"] == stats["num_state_slots"] > 0


def test_probe_model_runs_exactly_with_every_request_at_once(probe_dir):
    folder, vocab_size = probe_dir
    llm = LLM(str(folder), dtype="float32", show_progress=False, max_num_seqs=8)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == _expected(vocab_size)
    layout = llm.engine.scheduler.block_manager.layout
    assert [g.key for g in layout.groups] == [(1, probe.WINDOW), (probe.RATIO, None)]
    assert layout.num_state_slots == 8
    _assert_pools_empty(llm)


def test_probe_model_survives_chunked_prefill_and_preemption(probe_dir):
    folder, vocab_size = probe_dir
    # 16 blocks' worth of tokens: the compressed group gets 4 + 3 blocks, so the running requests outgrow
    # it and are preempted (recomputed from scratch, their state slots zeroed again); a 5-token budget
    # splits every longer prompt into chunks whose state carries over.
    llm = LLM(str(folder), dtype="float32", show_progress=False, max_num_seqs=3, max_num_batched_tokens=5,
              num_kv_blocks=16, block_size=4, max_model_len=64, enable_prefix_caching=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == _expected(vocab_size)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] == 0
    _assert_pools_empty(llm)


def test_probe_model_window_group_stays_small(probe_dir):
    folder, vocab_size = probe_dir
    # One long request: its window group holds at most a window and a step's worth of blocks, while its
    # compressed group grows with the context.
    llm = LLM(str(folder), dtype="float32", show_progress=False, max_num_seqs=1, max_num_batched_tokens=8,
              block_size=4, num_kv_blocks=64, max_model_len=128)
    long_prompt = list(range(10, 110))
    out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == probe.expected_generation(long_prompt, 8, vocab_size)
    groups = {(g["ratio"], g["window"]): g for g in llm.engine.stats()["kv_cache_groups"]}
    assert groups[(1, probe.WINDOW)]["num_blocks"] == 1 * (2 + 2) + 2  # sized for one window and a step
    _assert_pools_empty(llm)
