"""A tiny Kimi-K2 tokenizer folder (tiktoken.model of a byte-level BPE, tokenizer_config.json naming
tokenization_kimi.TikTokenTokenizer, a chat template) and the tiktoken.Encoding arguments of the same tokenizer."""
from __future__ import annotations

import base64
import collections
import json
import re
from pathlib import Path

from engine.loader.tiktoken_tokenizer import KIMI_PATTERN

TRAINING_TEXT = """The quick brown fox jumps over the lazy dog. Models answer questions; tokenizers split text.
def encode(self, text: str) -> list[int]:
    return [self.ranks[piece] for piece in self.split(text)]
for i in range(100): total += i * 2  # 0, 2, 4, 6, 8 ... 1234567890
今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。你好，世界！中文分词和英文不同。用Python写代码，中文English混合文本。
Emoji: 😀😃😄 🚀 ✨ — naïve café, Übermaß, Ωμέγα, こんにちは世界。 I'm sure they'll say it's fine, we've done it.
"""
# Kimi-K2's special tokens, at their offsets from the first id after the BPE ranks (163584 in the real file);
# the offsets it skips are reserved tokens.
KIMI_SPECIAL_TOKENS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}
CHAT_TEMPLATE = ("{%- for message in messages -%}<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
                 "{{ message['content'] }}<|im_end|>{%- endfor -%}"
                 "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def train_byte_bpe(text: str, num_merges: int) -> list[bytes]:
    """Tokens of a byte-level BPE in rank order: the 256 bytes, then `num_merges` merges learned on `text`, the
    most frequent pair first."""
    counts = collections.Counter(re.findall(r" ?\S+|\s+", text))  # merges across the pattern's pieces too
    pieces = {word: [bytes([b]) for b in word.encode()] for word in counts}
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, count in counts.items():
            for pair in zip(pieces[word], pieces[word][1:]):
                if pair[0] + pair[1] not in known:
                    pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        ranks.append(best[0] + best[1])
        known.add(ranks[-1])
        for word, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if tuple(parts[i:i + 2]) == best:
                    merged.append(ranks[-1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[word] = merged
    return ranks


def write_kimi_tokenizer(folder: Path, num_merges: int = 300, special_tokens: dict[int, str] = KIMI_SPECIAL_TOKENS,
                         template_in: str = "tokenizer_config.json") -> dict:
    """Kimi-K2's tokenizer files, at a tiny size, into `folder`, with a tokenization_kimi.py that fails on import.
    Returns the tiktoken.Encoding arguments that describe the same tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = train_byte_bpe(TRAINING_TEXT, num_merges)
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks)))
    specials = {name: len(ranks) + offset for offset, name in special_tokens.items()}
    config = {
        "added_tokens_decoder": {str(token_id): {"content": name, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
                                 for name, token_id in specials.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                      "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "clean_up_tokenization_spaces": False, "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "TikTokenTokenizer",
    }
    config = {name: value for name, value in config.items() if name not in ("unk_token", "pad_token")
              or value in specials}
    if template_in == "tokenizer_config.json":
        config["chat_template"] = CHAT_TEMPLATE
    else:
        (folder / template_in).write_text(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenization_kimi.py").write_text('raise RuntimeError("atom-ray ran the checkpoint\'s code")\n')
    named = {token_id: name for name, token_id in specials.items()}
    all_specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), max(named) + 1)}
    return {"name": "kimi-tiny", "pat_str": KIMI_PATTERN, "special_tokens": all_specials,
            "mergeable_ranks": {token: rank for rank, token in enumerate(ranks)}}
