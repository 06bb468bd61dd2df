"""MiniMax-M2 (vLLM's `minimax_m2`): invokes in a block, values as bare text
(agentic_and_spec_formats.md A.8, from the MiniMax-M2 chat template):

`<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="P">V</parameter>\n...</invoke>\n...</minimax:tool_call>`

Whitespace around a value is layout; values are typed by the tool's schema, an undeclared parameter stays a
string (vLLM's minimax_m2 parser)."""
from __future__ import annotations

import re

from .xml_calls import XmlToolParser


class MiniMaxM2ToolParser(XmlToolParser):
    name = "minimax_m2"
    block_begins, block_ends = ("<minimax:tool_call>",), ("</minimax:tool_call>",)
    invoke_prefixes, invoke_ends = ("<invoke",), ("</invoke>",)
    param_prefixes, value_end = ("<parameter",), "</parameter>"
    value_trim = "strip"
    unknown_params = "string"
    invoke_tag = re.compile(r"""<invoke\s+name=(["']?)(?P<name>[^"'>]*)\1\s*>""")
    param_tag = re.compile(r"""<parameter\s+name=(["']?)(?P<name>[^"'>]*)\1\s*>""")
