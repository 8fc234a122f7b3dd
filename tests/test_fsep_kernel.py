"""fsep's compiled layout (`_fsep_c.c`) against its Python definition.

The other fsep tests check the planner (compiled wherever it is built) against independent
references (max/mean bounds, the stock layout, one replica per expert within the tolerance, memory);
here the compiled and the Python planner must return bit-identical plans, so both paths carry those
guarantees. Inputs cover every branch the kernel decides: the stock layout within the tolerance,
one replica per expert, every slot, experts without tokens, unplaceable replicas and LPT round
repairs (several replicas of one expert per round).
"""
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rails.core.planners import PlannerConfig
from megatron_rails.core.planners.fsep import _compiled
from test_ultraep_kernel import assert_identical, problems  # counts of every kind the planners meet, with a config
from test_ultraep_kernel import both as both_kernels

pytestmark = [
    pytest.mark.skipif(os.environ.get("MEGATRON_RAILS_PURE_PYTHON", "") not in ("", "0"),
                       reason="MEGATRON_RAILS_PURE_PYTHON: the compiled layout is turned off"),
    pytest.mark.skipif(_compiled() is None and shutil.which("cc") is None,
                       reason="no C compiler: fsep runs in pure Python here"),
]


def test_kernel_is_built_where_a_compiler_exists():
    assert _compiled() is not None, "megatron_rails/core/planners/_fsep_c.c was not built: reinstall (pip install -e .)"


def both(cfg, counts):
    return both_kernels(cfg, counts, "fsep")


@st.composite
def tied_problems(draw):
    """Equal loads (replicas of one expert tie, LPT rounds repair conflicts), beside the ultraep
    kernel test's problems (uniform, pareto, zipf, one expert, no tokens, idle ranks)."""
    G = draw(st.sampled_from([1, 2, 4, 8]))
    D = G * draw(st.integers(1, 8))
    E = max(1, int(D * draw(st.sampled_from([0.25, 0.5, 1, 2, 4]))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = np.full((D, E), int(rng.integers(1, 5)), dtype=np.int64)
    counts[:, rng.integers(E)] *= int(rng.integers(2, 9))
    tol = draw(st.sampled_from([0.0, 0.05, 0.3]))
    return PlannerConfig(D, E, G, draw(st.integers(0, 3)), tolerance=tol), counts


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prob=st.one_of(problems(), tied_problems()))
def test_compiled_and_python_plans_are_identical(prob):
    assert_identical(*both(*prob))


@pytest.mark.parametrize("D,E,R", [(8, 8, 1), (64, 256, 1), (64, 256, 2), (256, 64, 1), (1024, 256, 2)])
@pytest.mark.parametrize("skew", ["uniform", "zipf:1.2", "zipf:2.0"])
def test_identical_at_benchmark_shapes(D, E, R, skew):
    from megatron_rails.core.workloads import WorkloadSpec, counts

    c = counts(WorkloadSpec(num_ranks=D, num_experts=E, topk=min(8, E), tokens_per_rank=4096, skew=skew, seed=D))
    for tol in (0.0, 0.05):
        assert_identical(*both(PlannerConfig(D, E, 8, R, tolerance=tol), c))


def test_every_branch_is_taken():
    """The stock layout, one replica per expert and every slot, each from the kernel."""
    cfg = PlannerConfig(4, 8, 4, 1, tolerance=0.05)
    stock = np.full((4, 8), 10, dtype=np.int64)
    # stock ranks 96, 80, 80, 64 of mean 80 (above 1.05); one replica each, LPT-placed: 80 everywhere
    lean = np.tile(np.array([12, 12, 10, 10, 10, 10, 8, 8], dtype=np.int64), (4, 1))
    full = stock.copy()
    full[:, 0] = 200
    stock_layout = np.arange(8).reshape(4, 2)
    for counts, replicas, is_stock in ((stock, 8, True), (lean, 8, False), (full, 12, False)):
        a, b = both(cfg, counts)
        assert_identical(a, b)
        assert a.info["replicas"] == replicas
        assert np.array_equal(a.placement.slot_expert_DS[:, :2], stock_layout) == is_stock
    assert both(cfg, lean)[0].load_D.max() == 80
