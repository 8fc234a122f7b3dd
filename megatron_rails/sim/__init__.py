"""Iteration-time simulator: what a policy and comm scheme would buy on a cluster, before running it.

`model.py` holds the per-layer cost model, `run.py` drives workloads and planners through it,
`report.py` prints and plots, `cli.py` is `megatron-rails simulate run`. See docs/simulator.md.
"""
from .model import Setup, SimError, SimOptions
from .run import Workload, simulate_run

__all__ = ["Setup", "SimError", "SimOptions", "Workload", "simulate_run"]
