"""The `megatron-rails` command line (tools layer, the top)."""
from .main import main

__all__ = ["main"]
