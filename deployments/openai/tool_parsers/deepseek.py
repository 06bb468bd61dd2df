"""DeepSeek-V3 (0324) / R1 (0528) and DeepSeek-V3.1 tool calls (agentic_and_spec_formats.md A.4, A.5):

V3/R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
        ...<｜tool▁calls▁end｜>`
V3.1:  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`

(U+FF5C `｜` and U+2581 `▁`, not ASCII.) V3.2 and V4 write DSML instead: deepseek_dsml.py."""
from __future__ import annotations

from .scanning import FAIL, NEED, expect, is_function_name, read_until
from .sections import SectionToolParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class _DeepSeekToolParser(SectionToolParser):
    section_begins = (CALLS_BEGIN,)
    section_ends = (CALLS_END,)
    call_begins = (CALL_BEGIN,)
    call_ends = (CALL_END,)


class DeepSeekV3ToolParser(_DeepSeekToolParser):
    name = "deepseek_v3"
    arguments_tail = " \t\r\n`"  # the closing fence

    def _read_header(self, text: str, pos: int):
        eof = self._eof
        kind = read_until(text, pos, SEP, eof, limit=32)
        if kind is NEED or kind is FAIL:
            return kind
        if kind[0].strip() != "function":
            return FAIL
        line = read_until(text, kind[1], "\n", eof, limit=256)
        if line is NEED or line is FAIL:
            return line
        name, pos = line[0].strip(), line[1]
        if not is_function_name(name):
            return FAIL
        fence = expect(text, pos, FENCE, eof)
        if fence is NEED:
            return NEED
        if fence is not FAIL:  # ```json and its line end
            rest = read_until(text, fence, "\n", eof, limit=16)
            if rest is NEED or rest is FAIL:
                return rest
            pos = rest[1]
        return name, None, pos


class DeepSeekV31ToolParser(_DeepSeekToolParser):
    name = "deepseek_v31"

    def _read_header(self, text: str, pos: int):
        head = read_until(text, pos, SEP, self._eof, limit=256)
        if head is NEED or head is FAIL:
            return head
        name = head[0].strip()
        return (name, None, head[1]) if is_function_name(name) else FAIL
