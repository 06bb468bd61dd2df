"""Block manager: allocation, chained prefix hashes, reference counts, least-recently-freed eviction."""
from __future__ import annotations

from engine.core.block_manager import BlockManager, hash_block
from engine.core.request import Request
from engine.sampling_params import SamplingParams


def make_request(tokens, request_id="r"):
    return Request(request_id, list(tokens), SamplingParams(), max_tokens=16)


def computed(manager, request, num_tokens):
    """Pretend the KV of the first `num_tokens` tokens was written, as the scheduler does after a step."""
    request.num_computed_tokens = num_tokens
    manager.cache_computed_blocks(request)


def test_allocation_takes_ceil_of_tokens_over_block_size():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(range(9))
    assert manager.allocate(request, 9)
    assert len(request.block_ids) == 3 and manager.num_free_blocks == 5
    request.num_computed_tokens = 9
    assert manager.allocate(request, 3)  # 12 tokens still fit in 3 blocks
    assert len(request.block_ids) == 3
    assert manager.allocate(request, 4)
    assert len(request.block_ids) == 4


def test_failed_allocation_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request(range(12))
    assert not manager.allocate(request, 12)
    assert request.block_ids == [] and manager.num_free_blocks == 2


def test_hash_of_a_block_covers_every_token_before_it():
    first = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(b"", [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) == hash_block(hash_block(b"", [1, 2, 3, 4]), [5, 6, 7, 8])


def test_cached_prefix_is_found_only_for_identical_leading_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    writer = make_request(range(12), "writer")
    manager.allocate(writer, 12)
    computed(manager, writer, 12)
    same_start = make_request(list(range(8)) + [99, 98, 97, 96, 95], "same-start")
    assert manager.find_cached_prefix(same_start) == writer.block_ids[:2]
    other_start = make_request([50] + list(range(1, 12)), "other")
    assert manager.find_cached_prefix(other_start) == []


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute():
    manager = BlockManager(num_blocks=16, block_size=4)
    writer = make_request(range(8), "writer")
    manager.allocate(writer, 8)
    computed(manager, writer, 8)
    assert manager.find_cached_prefix(make_request(range(8), "again")) == writer.block_ids[:1]


def test_blocks_are_cached_only_once_their_kv_is_computed():
    manager = BlockManager(num_blocks=16, block_size=4)
    writer = make_request(range(12), "writer")
    manager.allocate(writer, 12)
    computed(manager, writer, 7)  # one full block written so far
    assert manager.find_cached_prefix(make_request(range(12), "reader")) == writer.block_ids[:1]


def test_shared_blocks_are_reference_counted():
    manager = BlockManager(num_blocks=8, block_size=4)
    writer = make_request(range(9), "writer")
    manager.allocate(writer, 9)
    computed(manager, writer, 9)
    reader = make_request(list(range(8)) + [42], "reader")
    hits = manager.find_cached_prefix(reader)
    assert manager.allocate(reader, 1, hits)
    assert reader.block_ids[:2] == writer.block_ids[:2]
    assert [manager.blocks[b].ref_count for b in writer.block_ids[:2]] == [2, 2]
    manager.free(writer)
    assert [manager.blocks[b].ref_count for b in reader.block_ids[:2]] == [1, 1]
    assert manager.num_free_blocks == 8 - 3
    manager.free(reader)
    assert manager.num_free_blocks == 8


def test_freed_cached_blocks_are_reused_by_a_later_request():
    manager = BlockManager(num_blocks=8, block_size=4)
    writer = make_request(range(9), "writer")
    manager.allocate(writer, 9)
    computed(manager, writer, 9)
    manager.free(writer)
    reader = make_request(list(range(8)) + [1, 2], "reader")
    hits = manager.find_cached_prefix(reader)
    assert len(hits) == 2 and manager.allocate(reader, 2, hits)
    assert manager.num_free_blocks == 8 - 3
    assert manager.prefix_cache_hits == 8


def test_eviction_takes_least_recently_freed_block_first_tail_before_head():
    manager = BlockManager(num_blocks=4, block_size=2)
    older, newer = make_request([1, 2, 3, 4], "older"), make_request([5, 6, 7, 8], "newer")
    for request in (older, newer):
        manager.allocate(request, 4)
        computed(manager, request, 4)
    older_blocks, newer_blocks = list(older.block_ids), list(newer.block_ids)
    manager.free(older)
    manager.free(newer)
    assert list(manager.free_queue) == older_blocks[::-1] + newer_blocks[::-1]
    probe_old, probe_new = make_request([1, 2, 3, 4, 0], "probe-old"), make_request([5, 6, 7, 8, 0], "probe-new")
    manager.allocate(make_request([9, 9], "first-taker"), 2)
    assert manager.find_cached_prefix(probe_old) == older_blocks[:1]  # older's tail evicted, head kept
    assert manager.find_cached_prefix(probe_new) == newer_blocks
    manager.allocate(make_request([9, 9], "second-taker"), 2)
    assert manager.find_cached_prefix(probe_old) == []
    assert manager.find_cached_prefix(probe_new) == newer_blocks


def test_reset_prefix_cache_forgets_unused_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    request = make_request([1, 2, 3], "r")
    manager.allocate(request, 3)
    computed(manager, request, 3)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.find_cached_prefix(make_request([1, 2, 3], "probe")) == []
