"""Policy configuration: which planner, its slot budget, and the communication backend.

Loaded from YAML (`PolicyConfig.from_yaml`, or a preset name through `as_policy`) or built
directly; unknown keys and wrong types raise `ConfigError` naming the file and key.

The product default is defined here once: `PolicyConfig()` (ultraep's exact-load quota planning
over the owner layout, one replica slot per rank, the RailS all-to-all; `bench step` chose it over
fsep, docs/benchmarks.md). The `default` preset (presets/policies/default.yaml) spells out the same values, and
a dispatcher built without a policy takes `PolicyConfig()`.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import presets
from .errors import InputError, cut, shown
from .limits import MAX_EXPERTS, MAX_SLOTS, MAX_WINDOW

COMMS = ("direct", "rails")
# (lowest, highest) of the integer keys; 0 ranks_per_node = the launcher's ranks per node. The bounds
# keep a typo (slots: 99999999999999999999) from reaching the planners' arrays
INT_RANGES = {"slots": (0, MAX_SLOTS), "ranks_per_node": (0, 1 << 16), "window": (1, MAX_WINDOW),
              "interval": (1, MAX_WINDOW), "replica_cost_tokens": (0, 1 << 40)}


LISTED_KEYS = 8  # a section with more keys than this is not listed whole in an error line: config docs has it


class ConfigError(InputError):
    """A configuration file or value is invalid."""


def suggest(key, valid, prefix: str = "", elsewhere: dict | None = None, synonyms: dict | None = None) -> str:
    """'; did you mean ...?' for an unknown key or value (a synonym, else the closest spelling), else
    the section it belongs in (`elsewhere`: key -> section), else the valid keys where they are few,
    else the closest few of them and where all are listed: an error stays one readable line."""
    import difflib

    key, valid = str(key), [str(v) for v in valid]
    if synonyms and synonyms.get(key) in valid:
        return f"; did you mean '{prefix}{synonyms[key]}'?"
    by_lower = {v.lower(): v for v in valid}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{by_lower[close[0]]}'?"
    if elsewhere and key in elsewhere:
        return f"; '{key}' belongs in the {elsewhere[key]} section ('{elsewhere[key]}.{key}')"
    if len(valid) <= LISTED_KEYS:
        return f"; valid keys: {', '.join(sorted(valid))}"
    near = [prefix + by_lower[v] for v in difflib.get_close_matches(key.lower(), list(by_lower), n=3, cutoff=0.3)]
    docs = "`megatron-rails config docs` lists"
    return f"; nearest valid keys: {', '.join(near)} ({docs} all {len(valid)})" if near else \
        f"; {docs} the {len(valid)} valid keys"


def from_mapping(cls, data: dict, where: str = "<dict>"):
    """Build the config dataclass `cls` from a mapping; ConfigError naming `where` and the key for
    unknown keys (with a did-you-mean hint, one line each) and for every value the dataclass rejects."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__}'s keys, got {shown(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((str(k) for k in data if k not in names))
    if unknown:
        lines = [f"{where}: {cut(k)}: unknown key{suggest(k, names)}" for k in unknown]
        out = ConfigError("\n".join(lines))
        out.errors = lines
        raise out
    try:
        return cls(**_floats_read(cls, data))
    except (ConfigError, TypeError) as err:
        lines = [f"{where}: {line}" for line in getattr(err, "errors", None) or [str(err)]]
        out = ConfigError("\n".join(lines))
        out.errors = lines
        raise out from None


def number_text(text: str) -> float | None:
    """The number a YAML string writes, else None: YAML 1.1 takes `4e2` or `1e-3` (no dot) for a
    string. Every loader of float keys reads them through this (run-config sections too)."""
    try:
        return float(text)
    except ValueError:
        return None


def _floats_read(cls, data: dict) -> dict:
    """data with the float keys of `cls` that YAML left as strings read as numbers (number_text);
    a string that writes none is left for the class to refuse."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for k, v in data.items():
        if hints.get(k) is float and isinstance(v, str):
            f = number_text(v)
            out[k] = v if f is None else f
    return out


@dataclass(frozen=True)
class PolicyConfig:
    """policy: none | eplb | fsep | ultraep | lp.  slots: R (see PlannerConfig).  ranks_per_node: G
    (also the node size of RailS's node and rail groups; 0 = the launcher's ranks per node, see
    `node_size`).  comm: direct |
    rails.  tolerance: owner-layout policies move no weights while the stock max/mean tokens per
    rank is within 1 + tolerance (PlannerConfig).  rails_tolerance: comm rails sprays an exchange
    over all rails only when the rail-matched direct all-to-all would load its busiest rail more
    than 1 + rails_tolerance times the even spread; otherwise it sends it direct.  check_plan: validate the plan and all-reduce its
    digest every layer, raise on every rank on any invalid or differing plan (debug mode).
    replica_cost_tokens: within an optimizer step a replica is added to the resident placement only
    when the tokens it takes off the busiest rank, over the step's remaining microbatches, reach
    this (0: derived from the weights' dtype for a 400 Gb/s NIC and a 989 TFLOPS GPU,
    core/planners/step.replica_cost_tokens).  dedup: when the EP group spans nodes, a token crosses
    the network once per remote node it has pairs on and fans out inside the node; its outputs
    there are summed before they come back (runtime/dedup.py; the output is the same bits either
    way).  trace: a .npz file that records every training forward's all-gathered token counts, per
    microbatch and layer ("": none; megatron/trace_log.py; `--rails-trace`), for `simulate run
    --trace` and `bench step --trace`."""

    policy: str = "ultraep"
    slots: int = 1
    ranks_per_node: int = 0
    window: int = 10
    interval: int = 10
    placement: str = "ultraep"
    comm: str = "rails"
    check_plan: bool = False
    tolerance: float = 0.05
    rails_tolerance: float = 0.05
    replica_cost_tokens: int = 0
    dedup: bool = True
    trace: str = ""

    def __post_init__(self):
        from .planners import POLICIES

        self._plain_numbers()
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: unknown policy {shown(self.policy)}; choose one of {', '.join(POLICIES)}")
        if self.comm not in COMMS:
            raise ConfigError(f"comm: must be one of {', '.join(COMMS)}, got {shown(self.comm)}")
        for key, (lo, hi) in INT_RANGES.items():
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{key}: expected a {'non-negative' if lo == 0 else 'positive'} integer "
                                  f"(at most {hi}), got {shown(v)}")
        from .planners.lp import PLACEMENTS

        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement: must be one of {', '.join(PLACEMENTS)} (the placement lp schedules on), "
                              f"got {shown(self.placement)}")
        if self.slots == 0 and (self.policy in ("eplb", "ultraep")
                                or (self.policy == "lp" and self.placement != "fsep")):
            raise ConfigError(f"slots: {self.policy} balances through redundant replica slots and needs slots >= 1 "
                              f"(0 leaves it stock expert parallelism; use policy none for that)")
        from .planners.base import valid_tolerance

        if not valid_tolerance(self.tolerance):
            raise ConfigError(f"tolerance: expected a number in [0, 1] (max/mean tokens per rank - 1 that owner-layout "
                              f"policies leave as is), got {shown(self.tolerance)}")
        if not valid_tolerance(self.rails_tolerance):
            raise ConfigError(f"rails_tolerance: expected a number in [0, 1] (busiest rail over the even spread - 1 "
                              f"that comm rails sends direct instead of spraying), got {shown(self.rails_tolerance)}")
        if not isinstance(self.trace, str) or (self.trace and not self.trace.lower().endswith(".npz")):
            raise ConfigError(f"trace: expected the path of a .npz file to record routing counts into (or \"\" for "
                              f"none), got {shown(self.trace)}")
        for key in ("check_plan", "dedup"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}: expected true or false, got {shown(getattr(self, key))}")

    def _plain_numbers(self) -> None:
        """numpy scalars (a sweep's np.arange, a tolerance from np.linspace) as the built-in values they
        stand for, so that checks, equality, hashes and YAML dumps treat them alike."""
        import numpy as np

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            plain = bool(v) if isinstance(v, np.bool_) else int(v) if isinstance(v, np.integer) else \
                float(v) if isinstance(v, np.floating) else v
            if plain is not v:
                object.__setattr__(self, f.name, plain)

    @classmethod
    def from_dict(cls, data: dict, where: str = "<dict>") -> "PolicyConfig":
        return from_mapping(cls, data, where)

    @classmethod
    def from_yaml(cls, path, build=from_mapping) -> "PolicyConfig":
        """The policy of a YAML file; `build(cls, data, where)` makes it from the file's mapping (the
        config package passes its own, whose messages `config validate` shares)."""
        from .yamlfile import read_mapping

        data = read_mapping(path, ConfigError, "policy config", "a policy config needs at least 'policy: NAME'")
        kind = "run" if set(data) & {"model", "parallelism", "training"} else \
            "topology" if "gpus_per_node" in data and "policy" not in data else None
        if kind:  # one line instead of every key it does not know
            raise ConfigError(f"{Path(path)}: this is a {kind} config; a policy config is needed here (a run "
                              f"config's balancer: section is one; e.g. configs/policies/default.yaml)")
        return build(cls, data, str(Path(path)))

    @property
    def sharded(self) -> bool:
        """Whether the experts live as FSEP shards (fsep, or lp scheduling on an fsep placement)."""
        return self.policy == "fsep" or (self.policy == "lp" and self.placement == "fsep")

    def node_size(self, num_ranks: int, local_world_size: int = 0) -> int:
        """G for an EP group of `num_ranks`: ranks_per_node, else (0) the launcher's ranks per node
        `local_world_size` (torchrun's LOCAL_WORLD_SIZE; the runtime passes it), else all ranks on
        one node; at most num_ranks."""
        return min(self.ranks_per_node or local_world_size or num_ranks, num_ranks)

    def planner_config(self, num_ranks: int, num_experts: int, local_world_size: int = 0):
        from .planners import PlannerConfig

        G = self.node_size(num_ranks, local_world_size)
        return PlannerConfig(num_ranks, num_experts, G, self.slots, window=self.window,
                             interval=self.interval, placement=self.placement, tolerance=float(self.tolerance))


def as_policy(cfg, build=from_mapping) -> PolicyConfig:
    """A PolicyConfig from a PolicyConfig, a dict of its keys, a YAML path or a preset name (`build`:
    see PolicyConfig.from_yaml)."""
    if isinstance(cfg, PolicyConfig):
        return cfg
    if isinstance(cfg, dict):
        return build(PolicyConfig, cfg, "<dict>")
    if isinstance(cfg, (str, Path)):
        if not str(cfg).strip():  # Path("") is ".", the working directory
            raise ConfigError(f"an empty policy; presets: {', '.join(presets.names(presets.POLICY_DIR))} "
                              "(or give a path to a YAML file)")
        preset = presets.meant(presets.POLICY_DIR, cfg)
        if preset is None and not Path(cfg).suffix and not Path(cfg).exists():
            raise ConfigError(f"unknown policy preset {shown(str(cfg))}; presets: "
                              f"{', '.join(presets.names(presets.POLICY_DIR))} (or give a path to a YAML file)")
        return PolicyConfig.from_yaml(preset if preset is not None else cfg, build)
    raise ConfigError(f"a policy is a PolicyConfig, a dict, a YAML path or a preset name "
                    f"({', '.join(presets.names(presets.POLICY_DIR))}), got {type(cfg).__name__}")
