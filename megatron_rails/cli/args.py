"""argparse value checkers shared by the subcommands."""
from __future__ import annotations

import argparse


def int_at_least(name: str, lo: int):
    """argparse type: an integer >= lo, with an error naming the flag."""
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {v}")
        return v
    return conv
