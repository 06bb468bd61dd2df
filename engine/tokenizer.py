"""Tokenizer wrapper (encode, chat templates, EOS ids) and incremental detokenization that is correct
across multi-byte characters split over several tokens."""
from __future__ import annotations

import json
from pathlib import Path

from engine.errors import InvalidRequestError
from engine.loader.source import ModelSource, ModelSourceError
from engine.loader.tiktoken_tokenizer import TIKTOKEN_FILE, is_tiktoken_folder, load_tiktoken_tokenizer


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: set[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.all_special_ids = frozenset(hf_tokenizer.all_special_ids)
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_source(cls, source: ModelSource, tokenizer: str | None = None) -> "Tokenizer":
        if tokenizer is not None:
            hf = _hf_tokenizer(tokenizer)
        elif source.gguf is not None:
            hf = source.gguf.load_tokenizer()
        else:
            try:
                hf = _hf_tokenizer(source.folder)
            except (OSError, ValueError, TypeError) as exc:
                raise ModelSourceError(f"no usable tokenizer in {source.folder}: {exc}") from exc
        return cls(hf, _eos_ids(hf, source))

    @classmethod
    def has_tokenizer_files(cls, folder) -> bool:
        return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model", "vocab.json", TIKTOKEN_FILE))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; text the tokenizer cannot take (a lone surrogate, ...) is the request's fault."""
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:
            raise InvalidRequestError(_why_unencodable(text, exc)) from None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(token_ids)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.hf.convert_tokens_to_string(tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as the model's chat template writes it; messages the template refuses (its own
        checks, such as alternating roles, or values it cannot render) are the request's fault."""
        import jinja2
        if not self.has_chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt instead")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise InvalidRequestError(f"the chat template cannot render these messages: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template already spells out any BOS token, so the text is encoded without special tokens.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _hf_tokenizer(path):
    """transformers' tokenizer of a folder (or hub-style name), never built with code the folder ships."""
    if is_tiktoken_folder(path):
        return load_tiktoken_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def _why_unencodable(text, exc: Exception) -> str:
    if not isinstance(text, str):
        return f"a prompt must be text, not {type(text).__name__}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"the text is not valid Unicode: it holds a lone surrogate ({text[error.start]!r}) at character "
                f"{error.start}")
    return f"the tokenizer cannot encode this text: {exc}"


def eos_ids_from_config(source: ModelSource) -> set[int]:
    return _eos_ids(None, source)


def _eos_ids(hf_tokenizer, source: ModelSource) -> set[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    if hf_tokenizer is not None:
        add(hf_tokenizer.eos_token_id)
    add(getattr(source.hf_config, "eos_token_id", None))
    generation_config = Path(source.folder) / "generation_config.json"
    if source.gguf is None and generation_config.is_file():
        try:
            add(json.loads(generation_config.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError):
            pass
    return ids


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted piece by piece. A piece is released only once it no
    longer ends in an incomplete UTF-8 character; a few tokens of the prompt give the context for
    leading spaces."""

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [t for t in prompt_token_ids[-(self.CONTEXT_TOKENS + 1):] if not self._skipped(t)]
        self.tokens = tokenizer.convert_ids_to_tokens(context)
        self.prefix_offset = max(len(self.tokens) - self.CONTEXT_TOKENS, 0)
        self.read_offset = len(self.tokens)

    def _skipped(self, token_id: int) -> bool:
        return self.skip_special_tokens and token_id in self.tokenizer.all_special_ids

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        if self._skipped(token_id):
            return ""
        self.tokens.extend(self.tokenizer.convert_ids_to_tokens([token_id]))
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset:self.read_offset])
        full_text = to_string(self.tokens[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full_text[len(prefix_text):]
        return ""
