"""An LLM (or AsyncLLM) that is shut down, leaves a `with` block or is dropped gives back its weights, KV cache
and graphs, so that a second engine in the same process gets the same capacity (issue #26)."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from engine import EngineConfig, SamplingParams
from engine.async_llm import AsyncLLM
from engine.errors import EngineDeadError
from engine.llm import LLM

PROMPT = [5, 17, 42, 9, 3]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def build(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32", max_model_len=256, show_progress=False)


def held_memory(engine) -> list[weakref.ref]:
    """Weak references to the model, a weight and a KV cache tensor of an engine's runner."""
    runner = engine.executor.runner
    return [weakref.ref(runner.model), weakref.ref(next(runner.model.parameters())),
            weakref.ref(runner.cache_layers[0].kv_cache)]


def tokens(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids)


def test_shutdown_frees_the_model_and_the_kv_cache(llama_dir):
    llm = build(llama_dir)
    tokens(llm)
    refs = held_memory(llm.engine)
    llm.shutdown()
    assert [ref() for ref in refs] == [None, None, None]


def test_a_second_llm_after_shutdown_gets_the_same_capacity_and_tokens(llama_dir):
    # On CPU the capacity is capped by max_num_seqs full-length sequences, so equal capacities show that the
    # second engine was built as the first; the freed memory itself is checked by the weak references.
    first = build(llama_dir)
    expected, blocks = tokens(first), first.engine.stats()["num_kv_blocks"]
    first.shutdown()
    second = build(llama_dir)
    try:
        assert second.engine.stats()["num_kv_blocks"] == blocks
        assert tokens(second) == expected
    finally:
        second.shutdown()


def test_shutdown_twice_is_harmless(llama_dir):
    llm = build(llama_dir)
    llm.shutdown()
    llm.shutdown()


def test_generate_after_shutdown_raises_a_clear_error(llama_dir):
    llm = build(llama_dir)
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([PROMPT], GREEDY)


def test_a_with_block_shuts_the_llm_down_at_its_end(llama_dir):
    with build(llama_dir) as llm:
        assert len(tokens(llm)) == GREEDY.max_tokens
        refs = held_memory(llm.engine)
    assert [ref() for ref in refs] == [None, None, None]
    with pytest.raises(EngineDeadError):
        llm.generate([PROMPT], GREEDY)


def test_a_dropped_llm_frees_its_memory_at_once(llama_dir):
    llm = build(llama_dir)
    tokens(llm)
    refs = held_memory(llm.engine) + [weakref.ref(llm.engine.executor.runner)]
    gc.disable()  # freed when the last reference goes, not at some later garbage collection
    try:
        del llm
        assert [ref() for ref in refs] == [None, None, None, None]
    finally:
        gc.enable()


def test_async_llm_shutdown_frees_the_model_and_the_kv_cache(llama_dir):
    llm = AsyncLLM.from_config(EngineConfig(str(llama_dir), dtype="float32", max_model_len=256))

    async def complete():
        async for output in llm.generate(PROMPT, GREEDY):
            last = output
        return last.outputs[0].token_ids

    assert len(asyncio.run(complete())) == GREEDY.max_tokens
    refs = held_memory(llm.engine)
    llm.shutdown()
    llm.shutdown()
    assert [ref() for ref in refs] == [None, None, None]
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(complete())


def test_a_dropped_async_llm_stops_its_loop_and_frees_its_memory(llama_dir):
    llm = AsyncLLM.from_config(EngineConfig(str(llama_dir), dtype="float32", max_model_len=256))
    refs = held_memory(llm.engine)
    thread = llm._loop._thread
    del llm
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert [ref() for ref in refs] == [None, None, None]


def test_shutdown_frees_a_moe_models_experts_too(tiny_model_dirs):
    """The expert-load tracker holds the MoE layers: shutdown must let go of them as well."""
    llm = LLM(str(tiny_model_dirs["qwen3_moe"]), dtype="float32", max_model_len=256, show_progress=False)
    tokens(llm)
    runner = llm.engine.executor.runner
    assert runner.expert_load is not None
    refs = held_memory(llm.engine) + [weakref.ref(runner.expert_load.layers[0].w13)]
    llm.shutdown()
    assert [ref() for ref in refs] == [None] * 4
