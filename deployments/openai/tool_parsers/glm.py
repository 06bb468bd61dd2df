"""GLM-4.5/4.6 and GLM-4.7/GLM-5 (vLLM's `glm45` and `glm47`): one call per block, the name first, then
key/value pairs (agentic_and_spec_formats.md A.7):

GLM-4.5: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`
GLM-4.7/5: the same without the newlines, and `<tool_call>NAME</tool_call>` for a call without arguments.

A value is raw text when the schema makes it a string, JSON (or a Python literal) otherwise; an undeclared
parameter is read as JSON when it parses (vLLM's glm4_moe parser)."""
from __future__ import annotations

from .scanning import FAIL, NEED, expect, find_first, is_function_name, read_until, skip_whitespace
from .xml_calls import XmlToolParser

CALL, CALL_END, KEY, KEY_END, VALUE = "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>"


class Glm45ToolParser(XmlToolParser):
    name = "glm45"
    block_begins, block_ends = (), ()
    invoke_prefixes, invoke_ends = (CALL,), (CALL_END,)
    param_prefixes, value_end = (KEY,), "</arg_value>"
    bare_invokes = True  # the block is the invoke
    value_trim = "none"
    unknown_params = "json"

    def _invoke_header(self, text: str, pos: int):
        pos = skip_whitespace(text, pos + len(CALL))
        hit = find_first(text, ("\n", KEY, CALL_END), pos)
        if hit is None:
            if self._eof or len(text) - pos > 256:
                return FAIL
            return NEED
        name = text[pos:hit[0]].strip()
        if not is_function_name(name):
            return FAIL
        return name, hit[0] + (1 if hit[1] == "\n" else 0)

    def _param_header(self, text: str, pos: int):
        key = read_until(text, pos + len(KEY), KEY_END, self._eof, limit=256)
        if key is NEED or key is FAIL:
            return key
        value_pos = skip_whitespace(text, key[1])
        if value_pos == len(text) and not self._eof:
            return NEED
        end = expect(text, value_pos, VALUE, self._eof)
        if end is NEED or end is FAIL:
            return end
        name = key[0].strip()
        return (name, end, None) if name else FAIL


