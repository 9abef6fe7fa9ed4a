"""ModelOpt NVFP4/FP8 Hugging Face exports -> the MLX layout of ARCHITECTURE.md, byte for byte."""

from .convert import convert
from .errors import ConversionError

__all__ = ["convert", "ConversionError"]
