"""Tool-call parsers: each family's own call format (as its chat template teaches it) read back into
OpenAI `tool_calls`, whole or as streamed deltas. Independent of the engine: they read text.

How /v1/chat/completions uses them (chat.py; for requests with `tools` and `tool_choice` "auto"):

    parser_class = tool_parser_class(args.tool_call_parser, hf_config, chat_template)   # once, at start-up
    parser = parser_class(body.tools)                                  # one per choice of a request
    # parser.needs_special_tokens: decode with skip_special_tokens=False (the markers are special tokens)
    whole:     result = parser.parse(text)    # ParsedToolCalls(content, calls[ToolCall(id, name, arguments_json)])
    streamed:  for each new piece of text: deltas = parser.feed(piece); at the end: deltas += parser.finish()
               each DeltaMessage goes out as a chunk's `delta` (DeltaMessage.to_dict() is OpenAI's shape)
    finish_reason "tool_calls" when the output held a call (result.calls, or any delta with tool_calls).

The text fed is the answer: a reasoning parser (reasoning_parsers/) runs first and hands its content
on, so calls written inside the reasoning are not parsed; except for a parser with `reads_reasoning`
(harmony), which takes the raw output and returns reasoning_content itself."""
from __future__ import annotations

from typing import Any

from ..parser_registry import ParserRegistry
from .base import DeltaMessage, FunctionDelta, ParsedToolCalls, ToolCall, ToolCallDelta, ToolParser, collect
from .deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from .deepseek_dsml import DeepSeekDsmlToolParser
from .glm import Glm45ToolParser
from .harmony import HarmonyToolParser
from .hermes import HermesToolParser
from .kimi_k2 import KimiK2ToolParser
from .llama3 import Llama3JsonToolParser
from .minimax_m2 import MiniMaxM2ToolParser
from .qwen3_coder import Qwen3CoderToolParser

# --tool-call-parser names: vLLM's, so its serving commands carry over.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "llama3_json": Llama3JsonToolParser,
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "deepseek_v32": DeepSeekDsmlToolParser,
    "deepseek_v4": DeepSeekDsmlToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,  # the same tags without newlines: one reader takes both
    "minimax_m2": MiniMaxM2ToolParser,
    "openai": HarmonyToolParser,
}


def model_type_and_architectures(config: Any) -> tuple[str, list[str]]:
    """A HF config's (or config.json dict's) model_type and architectures; a wrapper's text model counts."""
    def field(source: Any, key: str) -> Any:
        return source.get(key) if isinstance(source, dict) else getattr(source, key, None)
    if config is None:
        return "", []
    architectures = list(field(config, "architectures") or [])
    model_type = field(config, "model_type") or ""
    text_config = field(config, "text_config")
    if text_config is not None:
        architectures += list(field(text_config, "architectures") or [])
        model_type = model_type or field(text_config, "model_type") or ""
    return model_type, architectures


def model_family(config: Any) -> str | None:
    """Which family's output formats a model writes, from its config's model_type and architectures (the
    parsers' "auto" choice; the chat template then tells checkpoints of one family apart): kimi_k2, gpt_oss,
    minimax_m2, glm, deepseek_dsa (V3.2, V4), deepseek_v3, qwen3_5, qwen3, qwen2, llama, or None."""
    model_type, architectures = model_type_and_architectures(config)
    names = {model_type, *architectures}
    if model_type in ("kimi_k2", "kimi_k25") or any(a.startswith("KimiK2") for a in architectures):
        return "kimi_k2"
    for family, members in (
            ("gpt_oss", {"gpt_oss", "GptOssForCausalLM"}),
            ("minimax_m2", {"minimax_m2", "MiniMaxM2ForCausalLM"}),
            ("glm", {"glm4_moe", "glm_moe_dsa", "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM"}),
            ("deepseek_dsa", {"deepseek_v32", "deepseek_v4", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM"}),
            ("deepseek_v3", {"deepseek_v3", "DeepseekV3ForCausalLM"}),
            ("qwen3_5", {"qwen3_5", "qwen3_5_moe", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                         "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"})):
        if names & members:
            return family
    for family, prefix in (("qwen3", "qwen3"), ("qwen2", "qwen2")):
        if model_type.startswith(prefix) or any(a.startswith(prefix.capitalize()) for a in architectures):
            return family
    return "llama" if names & {"llama", "LlamaForCausalLM"} else None


def default_tool_parser(config: Any, chat_template: str | None = None) -> str | None:
    """The parser name for a model, from its family (`model_family`); the chat template, when given, tells
    apart checkpoints of one family that call tools differently (DeepSeek-V3 vs V3.1, Qwen3 vs Qwen3-Coder,
    SmolLM/Hermes-style Llama fine-tunes). None when no parser fits."""
    family, template = model_family(config), chat_template or ""
    if family == "deepseek_v3":  # V3.1 dropped the fenced JSON
        return "deepseek_v31" if "<｜tool▁sep｜>" in template and "```json" not in template else "deepseek_v3"
    if family in ("qwen3", "qwen2"):
        return "qwen3_coder" if "<function=" in template else "hermes"
    if family == "llama":
        return "hermes" if "<tool_call>" in template else "llama3_json"
    return {"kimi_k2": "kimi_k2", "gpt_oss": "openai", "minimax_m2": "minimax_m2", "glm": "glm45",
            "deepseek_dsa": "deepseek_v32", "qwen3_5": "qwen3_coder"}.get(family)


_REGISTRY = ParserRegistry("tool call parser", TOOL_PARSERS, default_tool_parser)
tool_parser_names = _REGISTRY.names
get_tool_parser = _REGISTRY.get
tool_parser_class = _REGISTRY.for_model  # (name, config, chat_template): "auto" picks the model's

__all__ = ["DeltaMessage", "FunctionDelta", "ParsedToolCalls", "TOOL_PARSERS", "ToolCall", "ToolCallDelta",
           "ToolParser", "collect", "default_tool_parser", "get_tool_parser", "model_family",
           "model_type_and_architectures", "tool_parser_class", "tool_parser_names"]
