"""Safetensors checkpoints, single-file or sharded (model.safetensors.index.json)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch

from engine.loader.source import ModelSourceError


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelSourceError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelSourceError(f"{index} names shard(s) that are missing: {missing}")
        return files
    return sorted(folder.glob("*.safetensors"))


def count_tensors(files: list[Path], rename: Callable[[str], str | None] | None = None) -> int:
    from safetensors import safe_open
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += sum(1 for name in f.keys() if rename is None or rename(name) is not None)
    return total


def iter_weights(files: list[Path], rename: Callable[[str], str | None] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor; with `rename`, (rename(name), tensor), and tensors it maps to None are
    skipped unread (a multimodal checkpoint's vision tower)."""
    from safetensors import SafetensorError, safe_open
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    target = rename(name) if rename is not None else name
                    if target is not None:
                        yield target, f.get_tensor(name)
        except SafetensorError as exc:
            raise ModelSourceError(f"{path} is not a readable safetensors file: {exc}") from exc
