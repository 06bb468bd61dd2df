"""Reasoning parsers: a thinking model's output split into its reasoning (`reasoning_content`) and its
answer (`content`), whole or streamed. Independent of the engine: they read text.

How /v1/chat/completions uses them (chat.py):

    parser_class = reasoning_parser_class(args.reasoning_parser, hf_config, chat_template)   # at start-up
    parser = parser_class(prompt_text, body.chat_template_kwargs)    # one per choice; the rendered prompt
                                                                     # says whether the output starts inside
    whole:     reasoning, content = parser.parse(text)               # each None when empty
    streamed:  reasoning_delta, content_delta = parser.feed(piece); at the end parser.finish()
               a non-empty reasoning_delta goes out as delta.reasoning_content, content_delta as delta.content
    with tools, content (whole or each content_delta) goes on to the tool parser, so calls are read from
    the answer only; a tool parser with `reads_reasoning` (harmony) replaces this parser instead.
    constrained (response_format, tool_choice required or named): parser.reasoning_tags() says where the
    constraint starts, after the reasoning (None: from the first token, and no parser reads the output);
    the output is read by parser_class(prompt, kwargs, end_tag_only=True)

The `<think>` tags are ordinary text in some tokenizers and special tokens in others: decode with
skip_special_tokens=False when a reasoning parser is on."""
from __future__ import annotations

from typing import Any

from ..parser_registry import ParserRegistry
from ..tool_parsers import model_family
from .base import ReasoningParser, ThinkReasoningParser
from .harmony import HarmonyReasoningParser
from .think import (DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser, Glm45ReasoningParser,
                    KimiK2ReasoningParser, MiniMaxM2ReasoningParser, Qwen3ReasoningParser)

# --reasoning-parser names: vLLM's, so its serving commands carry over.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v3": DeepSeekV3ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "minimax_m2": MiniMaxM2ReasoningParser,
    "kimi_k2": KimiK2ReasoningParser,
    "openai": HarmonyReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,
}


def default_reasoning_parser(config: Any, chat_template: str | None = None) -> str | None:
    """The parser name for a model from its config's model_type and architectures, None for models that do
    not reason (Llama, Mixtral, Gemma). DeepSeek-V3's architecture serves V3 (no reasoning), R1 and V3.1;
    the chat template tells them apart: no `<think>` is V3, a `thinking` switch is V3.1, else R1. Without it
    the choice is `deepseek_v3`, which finds reasoning only where the prompt or the output opens it."""
    family = model_family(config)
    if family == "deepseek_v3":
        if chat_template is None:
            return "deepseek_v3"
        if "<think>" not in chat_template:
            return None
        return "deepseek_v3" if "thinking" in chat_template else "deepseek_r1"
    return {"kimi_k2": "kimi_k2", "gpt_oss": "openai", "minimax_m2": "minimax_m2", "glm": "glm45",
            "deepseek_dsa": "deepseek_v3", "qwen3_5": "qwen3", "qwen3": "qwen3"}.get(family)


_REGISTRY = ParserRegistry("reasoning parser", REASONING_PARSERS, default_reasoning_parser)
reasoning_parser_names = _REGISTRY.names
get_reasoning_parser = _REGISTRY.get
reasoning_parser_class = _REGISTRY.for_model  # (name, config, chat_template): "auto" picks the model's

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ThinkReasoningParser", "default_reasoning_parser",
           "get_reasoning_parser", "reasoning_parser_class", "reasoning_parser_names"]
