"""atom-ray's Ray layer: rank actors, the coordinator, placement, the CLI and the client for other Ray
jobs. Ray itself is imported lazily, so `atom-ray generate` runs without it."""
from __future__ import annotations


def start(model: str, **kwargs):
    """Run an engine for `model` on Ray and return its handle (see atom_ray.api.start)."""
    from atom_ray.api import start as _start
    return _start(model, **kwargs)


__all__ = ["start"]
