"""MiniMax-M2 (vLLM's `minimax_m2`): invokes in a block, values as bare text
(agentic_and_spec_formats.md A.8, from the MiniMax-M2 chat template):

`<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="P">V</parameter>\n...</invoke>\n...</minimax:tool_call>`

Whitespace around a value is layout; values are typed by the tool's schema, an undeclared parameter stays a
string (vLLM's minimax_m2 parser)."""
from __future__ import annotations

import re

from .scanning import FAIL, NEED, is_function_name, read_tag
from .xml_calls import XmlToolParser

_INVOKE = re.compile(r"""<invoke\s+name=(["']?)([^"'>]*)\1\s*>""")
_PARAMETER = re.compile(r"""<parameter\s+name=(["']?)([^"'>]*)\1\s*>""")


class MiniMaxM2ToolParser(XmlToolParser):
    name = "minimax_m2"
    block_begins, block_ends = ("<minimax:tool_call>",), ("</minimax:tool_call>",)
    invoke_prefixes, invoke_ends = ("<invoke",), ("</invoke>",)
    param_prefixes, value_end = ("<parameter",), "</parameter>"
    value_trim = "strip"
    unknown_params = "string"

    def _invoke_header(self, text: str, pos: int):
        tag = read_tag(text, pos, _INVOKE, ">", self._eof)
        if tag is NEED or tag is FAIL:
            return tag
        name = tag[0][2].strip()
        return (name, tag[1]) if is_function_name(name) else FAIL

    def _param_header(self, text: str, pos: int):
        tag = read_tag(text, pos, _PARAMETER, ">", self._eof)
        if tag is NEED or tag is FAIL:
            return tag
        key = tag[0][2].strip()
        return (key, tag[1], None) if key else FAIL
