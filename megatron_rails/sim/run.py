"""`simulate run`'s driver: workloads -> planners -> per-layer costs -> iteration time per policy x comm.

Shape legend:  I steps   Y layers   D expert-parallel ranks   E experts   pipeline stages spelled out (pp of them)

One simulated step is one training iteration. Its routing is one counts_DE per layer (a synthetic skew
from workloads.py, or a recorded trace), taken to hold for every microbatch of the iteration; every
policy plans it with its own per-layer planner state (eplb's history carries across steps).

Pipeline (1F1B) of pp stages: stage k holds layers [k Y/pp, (k+1) Y/pp), the last stage also the LM
head; a microbatch costs a stage the sum of its layers' costs, and an iteration of m microbatches takes
(m + pp - 1) x the slowest stage's microbatch time. The breakdown reports m x each component of that
stage and the pipeline bubble (pp - 1) x its total, so the parts add up to the iteration time.
Not modeled: data-parallel gradient reduction, the optimizer step, TP/CP/PP communication, kernel
launch and framework overheads; they would add the same time to every policy and shrink speedups.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import reason, shown
from .model import (CommModel, Setup, SimError, SimOptions, balanced_traffic, force_balanced_cost, head_ms, layer_cost,
                    plan_traffic)

COMPONENTS = ("dense_ms", "expert_compute_ms", "token_a2a_ms", "weights_ms", "planner_ms", "pipeline_bubble_ms")
BASELINE = ("none", "direct")
IDEAL = "force-balanced"  # the router spreads every layer's tokens evenly; no replicas, no planner


# -- workloads ------------------------------------------------------------------------------------------------

def rescale_rows(counts_DE: np.ndarray, row_sum: int) -> np.ndarray:
    """int64 [D, E]: every non-empty row scaled to sum to `row_sum`, largest remainders rounded up
    (ties to the lower expert id); routing shares are kept, token volume changes."""
    c = np.asarray(counts_DE, dtype=np.int64)
    out = np.zeros_like(c)
    for d in range(c.shape[0]):
        s = int(c[d].sum())
        if not s:
            continue
        exact = c[d] * row_sum
        base = exact // s
        rem = exact - base * s
        short = row_sum - int(base.sum())
        order = np.lexsort((np.arange(c.shape[1]), -rem))
        base[order[:short]] += 1
        out[d] = base
    return out


def _trace_overrides(s: Setup, D: int, E: int) -> str:
    """The overrides that make the config `s` take a trace of D ranks and E experts: the sizes, and
    enough nodes for the world size to hold the new expert-parallel groups (config/checks.py's rule)."""
    say = [f"parallelism.expert_model_parallel_size={D}", f"model.num_experts={E}"]
    G, nodes = s.topology.gpus_per_node, s.topology.nodes
    need = math.lcm(s.etp * D * s.pp, s.tp * s.pp * s.cp)
    if (nodes * G) % need:
        nodes = math.lcm(need, G) // G * -(-nodes * G // math.lcm(need, G))  # the next world size that holds them
        say += [f"parallelism.nodes={nodes}", f"parallelism.world_size={nodes * G}"]
    return ", ".join(say[:-1]) + " and " + say[-1]


def _check_trace(trace, path) -> np.ndarray:
    """int64 [I, Y, D, E] of a trace array-like: integer (or integer-valued), non-negative, 4-D, non-empty;
    SimError naming `trace` (and its file) otherwise."""
    from ..core.workloads import WorkloadError, validate_counts

    where = f"trace {path}".rstrip()
    try:
        a = np.asarray(trace)
    except (ValueError, TypeError) as err:  # ragged nested lists
        raise SimError(f"{where}: not an array of counts [steps, layers, ranks, experts] ({reason(err)})") from None
    if a.ndim != 4 or 0 in a.shape:
        raise SimError(f"{where}: expected a non-empty 4-D array of counts [steps, layers, ranks, experts], "
                       f"got shape {a.shape}")
    if a.dtype.kind not in "iuf":
        raise SimError(f"{where}: counts must be integers, got dtype {a.dtype}")
    try:
        return validate_counts(a, where)
    except WorkloadError as err:
        raise SimError(str(err)) from None


@dataclass
class Workload:
    """counts_DE per (step, layer): synthetic (skew) or a trace [I', Y', D, E] replayed cyclically
    (step % I', layer % Y'), its rows rescaled to the config's tokens per rank unless raw."""

    setup: Setup
    skew: str = "zipf:1.2"
    seed: int = 0
    trace: np.ndarray | None = None
    trace_path: str = ""
    raw: bool = False
    spec: object = field(default=None, repr=False)

    def __post_init__(self):
        s = self.setup
        if not isinstance(s, Setup):
            raise SimError(f"setup must be a Setup (Setup.from_run_config), got {type(s).__name__}")
        if isinstance(self.raw, np.bool_):
            self.raw = bool(self.raw)
        if not isinstance(self.raw, bool):
            raise SimError(f"raw must be True or False, got {shown(self.raw)}")
        if not isinstance(self.trace_path, (str, os.PathLike)):
            raise SimError(f"trace_path must be a path (str), got {shown(self.trace_path)}")
        if self.trace is not None:
            self.trace = t = _check_trace(self.trace, self.trace_path)
            if t.shape[2] != s.ep or t.shape[3] != s.experts:
                raise SimError(f"trace {self.trace_path}: counts are [D={t.shape[2]}, E={t.shape[3]}], the config "
                               f"has expert-parallel size {s.ep} and {s.experts} experts; simulate a config with "
                               f"{_trace_overrides(s, t.shape[2], t.shape[3])} (KEY=VALUE overrides after the config)")
            if not t.any():  # every figure would compare idle ranks
                raise SimError(f"trace {self.trace_path}: every count is 0; there are no tokens to simulate")
            return
        from ..core.workloads import WorkloadError, WorkloadSpec

        try:
            self.spec = WorkloadSpec(s.ep, s.experts, s.topk, s.tokens_per_rank, self.skew, self.seed, s.layers)
            if self.spec.parsed_skew.kind == "file":  # its shape and contents, before any output
                self.counts(0, 0)
        except WorkloadError as err:
            raise SimError(str(err)) from None

    def describe(self) -> str:
        if self.trace is not None:
            I, Y = self.trace.shape[:2]
            return f"trace {self.trace_path} ({I} steps x {Y} layers{', raw' if self.raw else ', rescaled'})"
        return f"{self.spec.skew} (seed {self.seed})"

    def counts(self, step: int, layer: int) -> np.ndarray:
        if self.trace is None:
            from ..core.workloads import counts

            return counts(self.spec, step, layer)
        I, Y = self.trace.shape[:2]
        c = self.trace[step % I, layer % Y]
        return c.copy() if self.raw else rescale_rows(c, self.setup.tokens_per_rank * self.setup.topk)


# -- driver ---------------------------------------------------------------------------------------------------

def _names(value, flag: str) -> list[str]:
    """The names of a comma-separated string or an iterable of strings (a list, a tuple), stripped;
    SimError naming `flag` for anything else."""
    if isinstance(value, str):
        items = value.split(",")
    else:
        try:
            items = list(value)
        except TypeError:  # None, a number
            raise SimError(f"{flag} must be comma-separated names or a list of names, got {shown(value)}") from None
    for v in items:
        if not isinstance(v, str):
            raise SimError(f"{flag}: names must be strings, got {shown(v)} in {shown(value)}")
    names = [v.strip() for v in items]
    if not any(names):  # "" or ",": the caller says none is named
        return []
    if not all(names):  # "none," or "none,,fsep": a name left out, not a shorter list
        raise SimError(f"{flag} {shown(value)}: an empty name (a stray comma?)")
    seen = [v for i, v in enumerate(names) if v in names[:i]]
    if seen:
        raise SimError(f"{flag} {shown(value)}: {seen[0]!r} named twice")
    return names


def check_names(policies, comms) -> tuple[list[str], list[str]]:
    from ..core.policy import COMMS
    from ..core.planners import POLICIES

    pols, cms = _names(policies, "--policies"), _names(comms, "--comm")
    for p in pols:
        if p not in POLICIES:
            raise SimError(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    for c in cms:
        if c not in COMMS:
            raise SimError(f"unknown comm {c!r}; choose from {', '.join(COMMS)}")
    if not pols:
        raise SimError(f"--policies {policies!r}: no policy named; give one or more of {', '.join(POLICIES)}, "
                       "comma-separated")
    if not cms:
        raise SimError(f"--comm {comms!r}: no comm named; give one or more of {', '.join(COMMS)}, comma-separated")
    return list(dict.fromkeys(pols)), list(dict.fromkeys(cms))


def planners_for(setup: Setup, policies, slots_flag: bool = False):
    """A planner per policy for the setup's EP group; SimError for a policy its slots cannot serve,
    blaming --slots where it set them (slots_flag), else the config's balancer."""
    import dataclasses

    from ..core.planners import PlannerError, make_planner
    from ..core.policy import ConfigError

    out = {}
    for pol in policies:
        try:
            pc = dataclasses.replace(setup.policy, policy=pol)
        except ConfigError as err:  # the slots do not suit this policy
            why = str(err).partition(": ")[2].split(" (")[0]
            if slots_flag:
                raise SimError(f"--slots {setup.policy.slots}: policy {pol} cannot run with it ({why}): give "
                               f"--slots 1 or more, or leave {pol} out of --policies") from None
            raise SimError(f"policy {pol} cannot run with the config's {setup.policy.slots} redundant slot(s) "
                           f"({why}): give --slots, or leave {pol} out of --policies") from None
        try:
            out[pol] = make_planner(pol, pc.planner_config(setup.ep, setup.experts))
        except PlannerError as err:
            raise SimError(f"policy {pol!r} cannot serve EP{setup.ep} with {setup.experts} experts and "
                           f"{setup.policy.slots} slot(s): {err}") from None
    return out


MAX_STEPS = 10000  # simulate_run's steps (and --steps): each plans every layer with every policy, kept in memory
PROGRESS_S = 10.0  # within a step, progress is reported at most this often


def simulate_run(setup: Setup, opts: SimOptions, policies, comms, steps: int, workload: Workload,
                 progress=None) -> dict:
    """{"setup", "options", "workload", "assumptions", "rows", "force_balanced"}: one row per requested
    (policy, comm) with iteration_ms (mean over steps), its breakdown, speedup over none/direct,
    fraction of the force-balanced ideal and balance figures; force_balanced: the ideal per comm.
    progress(steps done, steps, seconds so far, layers done in the step or None) after each step, and
    every PROGRESS_S within a long one."""
    if not isinstance(setup, Setup):
        raise SimError(f"setup must be a Setup (Setup.from_run_config), got {type(setup).__name__}")
    if not isinstance(opts, SimOptions):
        raise SimError(f"opts must be a SimOptions, got {type(opts).__name__}")
    if not isinstance(workload, Workload):
        raise SimError(f"workload must be a Workload, got {type(workload).__name__}")
    if (workload.setup.ep, workload.setup.experts) != (setup.ep, setup.experts):
        raise SimError(f"workload: made for expert-parallel size {workload.setup.ep} and {workload.setup.experts} "
                       f"experts, the setup has {setup.ep} and {setup.experts}; build it from this setup")
    if progress is not None and not callable(progress):
        raise SimError(f"progress must be a callable or None, got {shown(progress)}")
    if isinstance(steps, np.integer):
        steps = int(steps)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise SimError(f"--steps must be a positive integer (at most {MAX_STEPS}), got {shown(steps)}")
    policies, comms = check_names(policies, comms)
    run_pols = list(dict.fromkeys([BASELINE[0], *policies]))
    run_comms = list(dict.fromkeys([BASELINE[1], *comms]))
    planners = planners_for(setup, run_pols)
    states = {p: [planners[p].initial_state() for _ in range(setup.layers)] for p in run_pols}
    comm = CommModel(setup.ep_topo, opts.a2a_model, float(setup.policy.rails_tolerance))
    pp, Y = setup.pp, setup.layers
    per = Y // pp
    plan_us = {p: [] for p in run_pols}
    plan_us[IDEAL] = [0.0]
    keys = ("dense_ms", "expert_compute_ms", "token_a2a_ms", "weights_ms")
    cases = [(p, c) for p in [*run_pols, IDEAL] for c in run_comms]
    acc = {k: np.zeros((steps, pp, len(keys))) for k in cases}  # per step and stage, summed over its layers
    extra = {k: {"weights_total_ms": 0.0, "weight_bytes": 0.0, "max_over_mean": 0.0, "internode_bytes": 0.0,
                 "internode_bytes_dedup": 0.0, "fanout_bytes": 0.0} for k in cases}
    before = 0.0
    t_start = t_told = time.perf_counter()

    def add(case, stage, step, cost):
        acc[case][step, stage] += [cost[k] for k in keys]
        for k in extra[case]:
            extra[case][k] += cost[k]

    for step in range(steps):
        for layer in range(Y):
            counts_DE = workload.counts(step, layer)
            stage = layer // per
            ideal = balanced_traffic(setup, opts, counts_DE)
            for c in run_comms:
                add((IDEAL, c), stage, step, force_balanced_cost(setup, opts, counts_DE, comm, c, ideal))
            for pol in run_pols:
                t0 = time.perf_counter_ns()
                plan, states[pol][layer] = planners[pol].plan(counts_DE, states[pol][layer])
                plan_us[pol].append((time.perf_counter_ns() - t0) / 1e3)
                if pol == "none":
                    before += plan.max_over_mean
                traffic = plan_traffic(setup, opts, plan)
                for c in run_comms:
                    add((pol, c), stage, step, layer_cost(setup, opts, plan, comm, c, traffic))
            if progress and layer + 1 < Y and time.perf_counter() - t_told >= PROGRESS_S:  # a long step
                t_told = time.perf_counter()
                progress(step, steps, t_told - t_start, layer + 1)
        if progress:
            t_told = time.perf_counter()
            progress(step + 1, steps, t_told - t_start, None)
    head = head_ms(setup, opts)
    m, n = setup.microbatches, steps * Y
    rows = {}
    for pol, c in cases:
        plan_ms = float(np.median(plan_us[pol])) / 1e3 * setup.fwd_passes
        a = acc[pol, c].copy()                       # [I, stages, 4]
        a[:, -1, 0] += head                          # LM head on the last stage
        a = np.concatenate([a, np.full((steps, pp, 1), plan_ms * per)], axis=2)  # [I, stages, 5]
        stage_tot = a.sum(axis=2)                    # [I, stages]
        k = stage_tot.argmax(axis=1)                 # the slowest stage of every step
        worst, tot = a[np.arange(steps), k], stage_tot[np.arange(steps), k]
        iters = (m + pp - 1) * tot
        parts = np.concatenate([m * worst, ((pp - 1) * tot)[:, None]], axis=1).mean(axis=0)
        rows[pol, c] = {
            "policy": pol, "comm": c, "iteration_ms": float(iters.mean()),
            "breakdown": dict(zip(COMPONENTS, map(float, parts))),
            "iteration_ms_steps": iters.tolist(),
            "layer_ms": float(tot.mean() / per), "planner_us_median": plan_ms / setup.fwd_passes * 1e3,
            "weights_total_ms_per_layer": extra[pol, c]["weights_total_ms"] / n,
            "weight_bytes_per_layer": extra[pol, c]["weight_bytes"] / n,
            "max_over_mean": extra[pol, c]["max_over_mean"] / n, "max_over_mean_stock": before / n,
            "internode_bytes_per_layer": extra[pol, c]["internode_bytes"] / n,
            "internode_bytes_dedup_per_layer": extra[pol, c]["internode_bytes_dedup"] / n,
            "fanout_bytes_per_layer": extra[pol, c]["fanout_bytes"] / n,
        }
    base = rows[BASELINE]["iteration_ms"]
    for (pol, c), r in rows.items():
        r["speedup"] = base / r["iteration_ms"] if r["iteration_ms"] > 0 else 0.0
        r["of_force_balanced"] = rows[IDEAL, c]["iteration_ms"] / r["iteration_ms"] if r["iteration_ms"] else 0.0
    return {"setup": setup.describe(), "options": opts.__dict__ | {"steps": steps},
            "workload": workload.describe(),
            "assumptions": ASSUMPTIONS | {"overlap": OVERLAP_TEXT[opts.overlap], "weight_sync": SYNC_TEXT[opts.weight_sync],
                                          "dedup": DEDUP_TEXT[opts.dedup]},
            "rows": [rows[p, c] for p in policies for c in comms],
            "force_balanced": [rows[IDEAL, c] for c in comms]}


SYNC_TEXT = {
    "iteration": "replica / FSEP slot weights fetched once per iteration and kept for all its microbatches, "
                 "grads returned once (our dispatcher)",
    "microbatch": "weights fetched and grads returned every microbatch (a dispatcher without resident slots)",
}
DEDUP_TEXT = {
    True: "node dedup (the dispatcher's two stages): a token crosses to a remote node once, to the entry rank on its "
          "sender's rail there, which forwards it over NVLink to the node's ranks serving its pairs (combine: summed "
          "there, back once); timed as simulate a2a --dedup (fluid: the fan-out joins the NVLink ports, one more "
          "hop; phased: a fourth phase); distinct (token, node) pairs expected under a conditional Poisson model "
          "of top-k routing from the per-rank expert counts (analytic, not sampled)",
    False: "no dedup: a token routed to k experts on a remote node crosses the network once per pair",
}
OVERLAP_TEXT = {
    "none": "nothing overlaps: planner, weight movement, token all-to-all and expert compute run in sequence",
    "weights": "weight movement hidden behind the same layer's attention/dense compute, up to its duration",
}
ASSUMPTIONS = {
    "expert_flops": "SwiGLU: 3 GEMMs of hidden x ffn per routed token (6HF forward FLOPs), x3 for fwd+bwd, "
                    "on the EP rank with the largest load",
    "dense_flops": "QKV + output projection + causal attention core + router, x3 for fwd+bwd, / TP; "
                   "LM head on the last pipeline stage",
    "gemm_rate": "topology gpu_tflops x mfu for every GEMM",
    "all_to_all": "megatron_rails.sim.rails on the EP group's slice of the topology; tokens hidden x 2 bytes; "
                  "dispatch + combine, forward and backward; rails sends an exchange direct when the direct "
                  "exchange's busiest rail is within the policy's rails_tolerance of even (the dispatcher's rule)",
    "weights": "owner layout: each replica with tokens fetched whole from its owner, grads back (fp32); "
               "fsep: shard all-gather of every slot with tokens, grad reduce-scatter back",
    "planner": "median measured planner.plan wall time on this CPU, per layer and microbatch",
    "microbatches": "one counts matrix per layer and step, shared by the step's microbatches",
    "internode_bytes": "token bytes crossing nodes in one dispatch of one layer (forward; the combine and the "
                       "backward move as many), without dedup (one row per token-expert pair) and with it",
    "pipeline": "1F1B: (microbatches + stages - 1) x the slowest stage's microbatch time",
    "not_modeled": "DP gradient reduction, optimizer, TP/CP/PP communication, counts all-gather, launch overheads",
}
