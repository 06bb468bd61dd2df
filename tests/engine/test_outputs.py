"""Merging queued outputs of one request (what a slow stream reader receives)."""
from __future__ import annotations

import asyncio

from engine.outputs import CompletionOutput, RequestOutput, drain_merged, merge_outputs


def output(text: str, new_text: str, ids: list[int], new_ids: list[int], finished=False) -> RequestOutput:
    completion = CompletionOutput(0, text, ids, "length" if finished else None, None, None, new_text, new_ids)
    return RequestOutput("r", "p", [1], [completion], finished)


def test_merged_output_has_the_last_state_and_every_delta():
    merged = merge_outputs([output("a", "a", [1], [1]), output("ab", "b", [1, 2], [2]),
                            output("abc", "c", [1, 2, 3], [3], finished=True)])
    completion = merged.outputs[0]
    assert (completion.text, completion.new_text, completion.token_ids, completion.new_token_ids) == \
        ("abc", "abc", [1, 2, 3], [1, 2, 3])
    assert merged.finished and completion.finish_reason == "length"


def test_draining_stops_at_an_error_and_leaves_it_queued():
    async def scenario():
        queue = asyncio.Queue()
        for item in (output("ab", "b", [1, 2], [2]), RuntimeError("boom"), output("abc", "c", [1, 2, 3], [3])):
            queue.put_nowait(item)
        merged = drain_merged(queue, output("a", "a", [1], [1]))
        return merged, await queue.get()
    merged, next_item = asyncio.run(scenario())
    assert merged.outputs[0].new_text == "ab" and isinstance(next_item, RuntimeError)
