"""Quantized checkpoints: reading a `quantization_config` into per-layer schemes (config.py) and writing
quantized checkpoints in each real-world format from a full-precision one (quantizer.py)."""
from engine.quantization.config import QuantConfig, QuantConfigError, parse_quantization_config

__all__ = ["QuantConfig", "QuantConfigError", "parse_quantization_config"]
