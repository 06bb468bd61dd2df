"""DeepSeek-V3.2 and V4 ("DSML", vLLM's `deepseek_v32`): invokes in a block, each parameter saying whether
its value is a raw string or JSON (agentic_and_spec_formats.md A.5, from DeepSeek's encoding_dsv32.py):

`<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="P" string="true">V</｜DSML｜parameter>
...</｜DSML｜invoke>\n</｜DSML｜function_calls>`

V4 names the block `<｜DSML｜tool_calls>` (vLLM's deepseekv4 parser); both are read. `string="false"` values
are JSON as written, typed by the schema when they do not parse."""
from __future__ import annotations

import re

from .xml_calls import XmlToolParser


class DeepSeekDsmlToolParser(XmlToolParser):
    name = "deepseek_v32"
    block_begins = ("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>")
    block_ends = ("</｜DSML｜function_calls>", "</｜DSML｜tool_calls>")
    invoke_prefixes, invoke_ends = ("<｜DSML｜invoke",), ("</｜DSML｜invoke>",)
    param_prefixes, value_end = ("<｜DSML｜parameter",), "</｜DSML｜parameter>"
    value_trim = "none"
    unknown_params = "json"
    invoke_tag = re.compile(r'<｜DSML｜invoke\s+name="(?P<name>[^"]*)"\s*>')
    param_tag = re.compile(r'<｜DSML｜parameter\s+name="(?P<name>[^"]*)"(?:\s+string="(?P<string>true|false)")?\s*>')
