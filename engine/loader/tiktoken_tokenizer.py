"""tiktoken tokenizers (Kimi-K2, Kimi-K2.5: `tiktoken.model` beside a `tokenizer_config.json` whose class lives in
the checkpoint's own `tokenization_kimi.py`) read as a transformers fast tokenizer, never with that code.

`tiktoken.model` holds one `<base64 token> <rank>` line per BPE token. The special tokens take the ids after the
ranks: those `added_tokens_decoder` names, the ids it skips as `<|reserved_token_<id>|>`, as Kimi's code does.
The fast tokenizer splits text with Kimi's pre-tokenizer pattern and merges bytes in rank order, so it encodes
and decodes as `tiktoken.Encoding(pat_str=KIMI_PATTERN, ...)` does (tests/engine/test_tiktoken_tokenizer.py).
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
from pathlib import Path

from engine.loader.source import ModelSourceError

logger = logging.getLogger(__name__)

TIKTOKEN_FILE = "tiktoken.model"
# Tokenizer classes of checkpoints that ship a tiktoken file with their own code.
TIKTOKEN_CLASSES = ("TikTokenTokenizer", "KimiTokenizer")

# Kimi-K2's pat_str (tokenization_kimi.py): cl100k's pattern with runs of Han characters as pieces of their own.
# The `&&` class intersections are read the same by tiktoken's regex and by Oniguruma, the `tokenizers` engine.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def is_tiktoken_folder(folder) -> bool:
    """A folder whose tokenizer is a tiktoken file: `tiktoken.model` with no `tokenizer.json`, or with a
    tokenizer_config naming a tiktoken class."""
    folder = Path(folder)
    if not (folder / TIKTOKEN_FILE).is_file():
        return False
    return not (folder / "tokenizer.json").is_file() or _class_name(_read_config(folder)) in TIKTOKEN_CLASSES


def load_tiktoken_tokenizer(folder):
    """transformers' fast tokenizer for a tiktoken folder: BPE ranks, special tokens, special token names and
    chat template from the folder's files; no file of the folder is executed."""
    from transformers import PreTrainedTokenizerFast
    folder = Path(folder)
    config = _read_config(folder)
    ranks = read_tiktoken_ranks(folder / TIKTOKEN_FILE)
    special_tokens = special_tokens_after(len(ranks), config.get("added_tokens_decoder") or {}, folder)
    backend = _fast_backend(ranks, special_tokens)
    named = {}
    for name in _SPECIAL_TOKEN_NAMES:
        token = _token_text(config.get(name))
        if token is not None and token in special_tokens:
            named[name] = token
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False,
        model_max_length=config.get("model_max_length", int(1e30)),
        # Every special token (reserved ones too) is skipped where special tokens are skipped.
        additional_special_tokens=[token for token in special_tokens if token not in named.values()], **named)
    tokenizer.chat_template = chat_template_of(folder, config)
    logger.info("tokenizer of %s read from %s: %d BPE tokens, %d special tokens (no remote code)",
                folder, TIKTOKEN_FILE, len(ranks), len(special_tokens))
    return tokenizer


def read_tiktoken_ranks(path: Path) -> list[bytes]:
    """The BPE tokens of a tiktoken file in rank order; a malformed file is refused naming the line."""
    by_rank: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    with open(path, "rb") as file:
        for line_number, line in enumerate(file, 1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError(f"expected '<base64 token> <rank>', got {len(fields)} fields")
                token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
                if rank < 0:
                    raise ValueError(f"negative rank {rank}")
                if rank in by_rank:
                    raise ValueError(f"rank {rank} given twice")
                if token in seen:
                    raise ValueError(f"token {token!r} given twice (ranks {seen[token]} and {rank})")
            except (ValueError, binascii.Error) as exc:
                raise ModelSourceError(f"{path}, line {line_number}: not a tiktoken BPE line ({exc}): "
                                       f"{line[:80]!r}") from None
            by_rank[rank] = token
            seen[token] = rank
    if len(by_rank) < 256 or any(bytes([b]) not in seen for b in range(256)):
        missing = [b for b in range(256) if bytes([b]) not in seen]
        raise ModelSourceError(f"{path} lacks single-byte tokens {missing[:8]}: a byte-level BPE file ranks all 256")
    if max(by_rank) != len(by_rank) - 1:
        hole = next(rank for rank in range(len(by_rank)) if rank not in by_rank)
        raise ModelSourceError(f"{path} has no token of rank {hole}: ranks must run from 0 without holes")
    return [by_rank[rank] for rank in range(len(by_rank))]


def special_tokens_after(num_ranks: int, added_tokens_decoder: dict, folder: Path) -> dict[str, int]:
    """Special token -> id: the added tokens at ids from `num_ranks` on, the ids between them reserved."""
    named: dict[int, str] = {}
    for token_id, token in added_tokens_decoder.items():
        text = _token_text(token)
        if not str(token_id).isdigit() or text is None:
            raise ModelSourceError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder entry "
                                   f"{token_id!r}: {token!r} is not an id with a token")
        if int(token_id) < num_ranks:
            # Kimi's code reads special tokens only above the BPE ranks; the rank's own token stands.
            logger.warning("added token %r has id %s inside the BPE ranks of %s: ignored", text, token_id, folder)
            continue
        named[int(token_id)] = text
    last = max(named, default=num_ranks - 1)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_ranks, last + 1)}
    if len(specials) != last + 1 - num_ranks:
        raise ModelSourceError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder names a token twice")
    return specials


def chat_template_of(folder: Path, config: dict) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config's (the default of a list of named
    templates), else chat_template.json's."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = by_name.get("default", next(iter(by_name.values()), None))
    return template if isinstance(template, str) else None


def _fast_backend(ranks: list[bytes], special_tokens: dict[str, int]):
    """The `tokenizers` object: a byte-level BPE whose merges follow the ranks (a token's every split into two
    tokens merges at its rank; a piece found whole in the vocabulary is taken as it is, as tiktoken does), Kimi's
    pattern before it, the special tokens after the ranks. transformers' TikTokenConverter builds the same, but
    reads the file with tiktoken, a package atom-ray does not need at run time."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_chars = bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_chars[byte] for byte in token)

    rank_of = {token: rank for rank, token in enumerate(ranks)}
    merges = []
    for token in ranks:  # in rank order: a merge's priority is its token's rank
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in rank_of and token[i:] in rank_of]
        merges.extend(sorted(splits, key=lambda pair: (rank_of[pair[0]], rank_of[pair[1]])))
    backend = Tokenizer(models.BPE({as_text(token): rank for rank, token in enumerate(ranks)},
                                   [(as_text(left), as_text(right)) for left, right in merges],
                                   fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added in id order right after the ranks, so each takes its id from the folder.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token in sorted(special_tokens, key=special_tokens.get)])
    assert all(backend.token_to_id(token) == token_id for token, token_id in special_tokens.items())
    return backend


def _read_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return _read_json(path) if path.is_file() else {}


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelSourceError(f"{path} holds {type(value).__name__}, not a JSON object")
    return value


def _class_name(config: dict) -> str | None:
    """The tokenizer class a config names: `tokenizer_class`, else the class of auto_map's AutoTokenizer."""
    auto = (config.get("auto_map") or {}).get("AutoTokenizer")
    reference = auto[0] if isinstance(auto, (list, tuple)) and auto else auto
    name = config.get("tokenizer_class") or reference
    return name.rsplit(".", 1)[-1] if isinstance(name, str) else None


def _token_text(token) -> str | None:
    """A token as tokenizer_config writes it: a string, or an AddedToken dict with its `content`."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
