"""Optional parts of the test environment: Triton (its kernels run under Triton's interpreter on CPU
tensors) and a Slurm cluster (tests/test_slurm.py).

Where a part is missing, the tests that need it skip and say why, unless MEGATRON_RAILS_REQUIRE names
it (space- or comma-separated, from PARTS): there they fail, so a run that is meant to exercise the
part cannot pass without it. `make test` names triton wherever its venv installs it; .ci/run's first
pass names slurm as well. tests/conftest.py refuses names it does not know (a misspelt one would
quietly require nothing).
"""
from __future__ import annotations

import os

import pytest

PARTS = ("triton", "slurm")
REQUIRED = frozenset(os.environ.get("MEGATRON_RAILS_REQUIRE", "").replace(",", " ").split())


def missing(part: str, reason: str):
    """Skip the calling test (`part` is missing, `reason` says why), or fail it where REQUIRED names it."""
    assert part in PARTS, part
    if part in REQUIRED:
        pytest.fail(f"{reason} (MEGATRON_RAILS_REQUIRE names {part}: this run must not skip it)", pytrace=False)
    pytest.skip(reason)


def import_triton():
    """The triton module, else missing('triton', ...)."""
    try:
        import triton
    except ImportError as err:
        missing("triton", f"triton is not importable ({err}); `make venv` installs it (TRITON= leaves it out)")
    return triton
