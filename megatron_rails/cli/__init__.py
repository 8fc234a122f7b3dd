"""The `megatron-rails` command line (tools layer, the top)."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
