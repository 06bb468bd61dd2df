"""A Kimi-style tokenizer folder (tiktoken.model, tokenizer_config.json naming tokenization_kimi.TikTokenTokenizer,
a chat template) gets a fast tokenizer without running the folder's code: it encodes and decodes as tiktoken
does with the same ranks, pattern and special tokens; special tokens keep their ids, the ids between them are
reserved tokens; the folder's chat template is applied; a malformed tiktoken.model names its line."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from engine.loader import ModelSourceError, resolve_model
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kimi_tokenizer import TRAINING_TEXT, write_kimi_tokenizer

CORPUS = [
    "Hello world! The capital of France is Paris.",
    "I'm sure they'LL say IT'S fine; we've done it, haven't we? DON'T panic.",
    "def f(x):\n    return {'a': x ** 2, \"b\": [1, 2, 3]}\n\n\nclass A(B):\n\tpass\n",
    "今天天气很好，我们去公园散步吧。中文English混合mixed文本123。",
    "日本語のテキストとカタカナ、ひらがな。한국어 텍스트도 있습니다.",
    "😀 🚀✨👩‍👩‍👧 emoji sequences, flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e-10 ١٢٣٤ ½ ²",
    "   leading spaces, trailing spaces   \n\n\n  blank lines \r\n windows \t\t tabs  \u00a0nbsp \u3000ideographic",
    "naïve café Übermaß ΩΜΈΓΑ ωμέγα e\u0301 combining a\u0308\u0301 marks",
    "<|im_user|>user<|im_middle|>hi there<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text between[EOS] special tokens <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}",
    "",
]


def write_kimi_folder(folder: Path, **kwargs) -> dict:
    """A Kimi-K2 checkpoint folder's metadata (config.json of model_type kimi_k2, generation_config.json) with
    its tokenizer."""
    encoding = write_kimi_tokenizer(folder, **kwargs)
    specials = encoding["special_tokens"]
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
              "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
              "vocab_size": max(specials.values()) + 1, "hidden_size": 64, "num_hidden_layers": 1,
              "bos_token_id": specials["[BOS]"], "eos_token_id": specials["[EOS]"]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": specials["<|im_end|>"]}))
    return encoding


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(the folder, the tiktoken.Encoding arguments of its tokenizer)."""
    folder = tmp_path_factory.mktemp("kimi-k2")
    return folder, write_kimi_folder(folder)


@pytest.fixture(scope="module")
def tokenizer(kimi) -> Tokenizer:
    return Tokenizer.from_source(resolve_model(str(kimi[0]), load_format="dummy"))


@pytest.fixture(scope="module")
def reference(kimi):
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.Encoding(**kimi[1])


def test_tiktoken_folder_gets_a_tokenizer_without_running_its_code(kimi, tokenizer):
    assert Tokenizer.has_tokenizer_files(kimi[0])
    assert tokenizer.vocab_size == max(kimi[1]["special_tokens"].values()) + 1
    assert not [name for name in sys.modules if "tokenization_kimi" in name]


@pytest.mark.parametrize("text", CORPUS)
def test_encoding_and_decoding_equal_tiktoken(tokenizer, reference, text):
    token_ids = tokenizer.encode(text)
    assert token_ids == reference.encode(text, allowed_special="all")
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == reference.decode(token_ids) == text


def test_long_mixed_text_encodes_as_tiktoken(tokenizer, reference):
    text = "\n".join(CORPUS) * 3 + TRAINING_TEXT + " " * 40 + "\n" * 7 + "1" * 50 + "中" * 30 + "💡" * 9
    assert tokenizer.encode(text) == reference.encode(text, allowed_special="all")


def test_special_tokens_have_their_folder_ids_and_the_gaps_are_reserved(kimi, tokenizer):
    specials = kimi[1]["special_tokens"]
    first = len(kimi[1]["mergeable_ranks"])
    assert tokenizer.encode("<|im_user|><|im_middle|>[EOS]") == [specials["<|im_user|>"], specials["<|im_middle|>"],
                                                                specials["[EOS]"]]
    assert tokenizer.convert_ids_to_tokens([first + 5, first + 200]) == [f"<|reserved_token_{first + 5}|>",
                                                                         f"<|reserved_token_{first + 200}|>"]
    assert set(specials.values()) <= tokenizer.all_special_ids
    assert tokenizer.hf.bos_token == "[BOS]" and tokenizer.hf.pad_token_id == specials["[PAD]"]


def test_no_special_token_is_added_to_an_encoding(tokenizer, reference):
    assert tokenizer.encode("hello") == reference.encode("hello")


def test_eos_ids_are_the_config_eos_and_generation_config_eos(kimi, tokenizer):
    specials = kimi[1]["special_tokens"]
    assert tokenizer.eos_token_ids == {specials["[EOS]"], specials["<|im_end|>"]}


def test_decoding_skips_special_tokens_on_request(tokenizer):
    token_ids = tokenizer.encode("<|im_assistant|>assistant<|im_middle|>Paris.<|im_end|>")
    assert tokenizer.decode(token_ids) == "assistantParis."


@pytest.mark.parametrize("template_in", ["tokenizer_config.json", "chat_template.jinja"])
def test_chat_template_of_the_folder_is_applied(tmp_path, template_in):
    encoding = write_kimi_folder(tmp_path / "kimi", template_in=template_in)
    tokenizer = Tokenizer.from_source(resolve_model(str(tmp_path / "kimi"), load_format="dummy"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "今天好吗?"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>今天好吗?"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    token_ids = tokenizer.encode_chat(messages)
    assert token_ids[0] == encoding["special_tokens"]["<|im_system|>"]
    assert token_ids[-1] == encoding["special_tokens"]["<|im_middle|>"]


def test_streamed_text_of_split_characters_is_whole(tokenizer):
    text = "中文 😀 naïve 🚀✨ done"
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detokenizer.add(token_id) for token_id in token_ids) == text


def test_malformed_line_is_refused_naming_the_file_and_line(tmp_path):
    write_kimi_folder(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines(keepends=True)
    lines[2] = "not-base64!! 2\n"
    (tmp_path / "tiktoken.model").write_text("".join(lines))
    with pytest.raises(ModelSourceError, match=rf"{re.escape(str(tmp_path / 'tiktoken.model'))}, line 3: "
                                               r"not a tiktoken BPE line"):
        Tokenizer.from_source(resolve_model(str(tmp_path), load_format="dummy"))


def test_ranks_with_a_hole_are_refused(tmp_path):
    write_kimi_folder(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines(keepends=True)
    (tmp_path / "tiktoken.model").write_text("".join(lines[:300] + lines[301:]))
    with pytest.raises(ModelSourceError, match="no token of rank 300"):
        Tokenizer.from_source(resolve_model(str(tmp_path), load_format="dummy"))
