"""Kimi-K2 / K2-Thinking / K2.5 tool calls (agentic_and_spec_formats.md A.6, from MoonshotAI/Kimi-K2's
tool_call_guidance.md):

`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}
<|tool_call_end|>...<|tool_calls_section_end|>`

The call's id is the model's own `functions.NAME:IDX` (IDX counts calls across the conversation, so the
chat template needs it back unchanged); NAME is what lies between `functions.` and the last `:`."""
from __future__ import annotations

import re

from .scanning import FAIL, NEED, is_function_name, read_until
from .sections import SectionToolParser

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"(?P<name>[^\s<>]+):(?P<index>\d+)")


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    # vLLM also reads the singular spelling of the section tokens, which some K2 outputs use.
    section_begins = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    section_ends = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    call_begins = ("<|tool_call_begin|>",)
    call_ends = ("<|tool_call_end|>",)

    def _read_header(self, text: str, pos: int):
        head = read_until(text, pos, ARGUMENT_BEGIN, self._eof, limit=256)
        if head is NEED or head is FAIL:
            return head
        call_id = head[0].strip()
        match = _CALL_ID.fullmatch(call_id)
        if match is None:
            return FAIL
        name = match["name"].removeprefix("functions.")
        return (name, call_id, head[1]) if is_function_name(name) else FAIL
