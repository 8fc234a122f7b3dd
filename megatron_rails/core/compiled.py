"""The optional compiled parts (C extensions built at install where a C compiler exists): one way to
find them, and one switch to turn them off.

Each has a Python definition it must match bit for bit (tests/test_*_kernel.py); where it is not
built, or MEGATRON_RAILS_PURE_PYTHON is set (not "" or "0"), the Python definition runs.
"""
from __future__ import annotations

import importlib
import os

PURE_PYTHON_ENV = "MEGATRON_RAILS_PURE_PYTHON"


def compiled(module: str, name: str):
    """`name` from the compiled module `module` (a full module path), or None where it is not built
    or turned off."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return None
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
