"""OpenAI-compatible HTTP layer (FastAPI) over an engine client; Ray Serve mounts it in deployments.serve_app."""
from .app import build_openai_app

__all__ = ["build_openai_app"]
