"""Qwen3-Coder and Qwen3.5 (vLLM's `qwen3_coder`): XML-ish calls with bare-text values
(agentic_and_spec_formats.md A.3, from the Qwen3-Coder chat template):

`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>`

One newline on each side of a value is layout; values are typed by the tool's schema, an undeclared
parameter stays a string (vLLM's `_convert_param_value`). A `<function=` without its `<tool_call>` is read too."""
from __future__ import annotations

import re

from .xml_calls import XmlToolParser


class Qwen3CoderToolParser(XmlToolParser):
    name = "qwen3_coder"
    block_begins, block_ends = ("<tool_call>",), ("</tool_call>",)
    invoke_prefixes, invoke_ends = ("<function=",), ("</function>",)
    param_prefixes, value_end = ("<parameter=",), "</parameter>"
    bare_invokes = True
    value_trim = "newline"
    unknown_params = "string"
    invoke_tag = re.compile(r"<function=(?P<name>[^>\n]*)>")
    param_tag = re.compile(r"<parameter=(?P<name>[^>\n]*)>")
