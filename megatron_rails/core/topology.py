"""Rail-optimized cluster topology: nodes of G GPUs, J NICs per node, NIC i of every node on rail i.

GPU g of a node attaches to NIC/rail `g * J // G` (G must be a multiple of J; a DGX has G = J = 8).
Bandwidths are per direction, in Gb/s for both NICs and NVLink so they compare directly
(NVLink of an H100: 450 GB/s per direction = 3600 Gb/s). `latency_us` is the fixed cost of one
message on one hop. `gpu_tflops` (dense bf16 throughput) is used by the iteration-time simulator,
`gpu_memory_gib` (per GPU, 2^30 bytes: HBM's "80 GB" is 80 GiB) by its memory table.

Presets ship as package data (presets/topology/*.yaml, configs/topology in the repository); `load_topology` takes a preset name or a YAML path.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import presets as _presets
from .errors import is_integer, shown
from .policy import ConfigError, from_mapping
from .yamlfile import read_mapping

PRESET_DIR = _presets.TOPOLOGY_DIR
# (key, lowest, highest): bounds far beyond any machine, so a typo fails here, not in the simulator's arrays
INT_RANGES = (("gpus_per_node", 1, 1024), ("rails_per_node", 1, 1024), ("nodes", 0, 1 << 20))
NUMBERS = (("nic_gbps", True), ("nvlink_gbps", True), ("gpu_tflops", True), ("gpu_memory_gib", True),
           ("latency_us", False))  # (key, > 0)


@dataclass(frozen=True)
class Topology:
    name: str = "custom"
    gpus_per_node: int = 8
    rails_per_node: int = 8
    nic_gbps: float = 400.0
    nvlink_gbps: float = 3600.0
    latency_us: float = 2.0
    gpu_tflops: float = 989.0
    gpu_memory_gib: float = 80.0  # 2^30 bytes per GPU, for the memory table of `simulate run`
    nodes: int = 0  # 0: not fixed here; set by the world size or --nodes (`with_nodes`)
    description: str = ""

    def __post_init__(self):
        for k, _, _ in INT_RANGES:  # numpy scalars (sizes computed with numpy) as the Python numbers they are
            v = getattr(self, k)
            if isinstance(v, np.integer):
                object.__setattr__(self, k, int(v))
        for k, _ in NUMBERS:
            v = getattr(self, k)
            if isinstance(v, (np.integer, np.floating)):
                object.__setattr__(self, k, v.item())
        # every problem at once: a topology file is usually written in one go, so fix it in one go
        errors = [e for e in (self._int_error(k, lo, hi) for k, lo, hi in INT_RANGES) if e]
        errors += [e for e in (self._number_error(k, pos) for k, pos in NUMBERS) if e]
        if not errors and self.gpus_per_node % self.rails_per_node:
            errors.append(f"rails_per_node: {self.rails_per_node} does not divide gpus_per_node "
                          f"{self.gpus_per_node} (every rail must serve the same number of GPUs)")
        if errors:
            err = ConfigError("\n".join(errors))
            err.errors = errors  # config/schema.build prefixes each with the file
            raise err

    def _int_error(self, key: str, lo: int, hi: int) -> str:
        v = getattr(self, key)
        if not isinstance(v, bool) and isinstance(v, int) and lo <= v <= hi:
            return ""
        zero = " (0 = set by the world size)" if lo == 0 else ""
        return f"{key}: expected an integer in [{lo}, {hi}]{zero}, got {shown(v)}"

    def _number_error(self, key: str, positive: bool) -> str:
        v = getattr(self, key)
        number = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if number and (v > 0 if positive else v >= 0):
            return ""
        return f"{key}: expected a finite {'positive' if positive else 'non-negative'} number, got {shown(v)}"

    # -- shape -----------------------------------------------------------------------------------
    @property
    def gpus_per_rail(self) -> int:
        return self.gpus_per_node // self.rails_per_node

    @property
    def world_size(self) -> int:
        if not self.nodes:
            raise ConfigError(f"topology {self.name!r}: the number of nodes is not set")
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> "Topology":
        return dataclasses.replace(self, nodes=nodes)  # checked there: 2.7 nodes is an error, not 2

    def for_world(self, world_size: int) -> "Topology":
        """This topology sized for `world_size` ranks; a clear error if it cannot hold them."""
        G = self.gpus_per_node
        if not is_integer(world_size) or world_size < 1:
            raise ConfigError(f"topology {self.name!r}: world size must be a positive integer, got "
                              f"{shown(world_size)}")
        if world_size % G:
            raise ConfigError(f"topology {self.name!r}: world size {world_size} is not a multiple of "
                              f"gpus_per_node {G}")
        if self.nodes and self.nodes * G != world_size:
            raise ConfigError(f"topology {self.name!r}: nodes {self.nodes} x gpus_per_node {G} = "
                              f"{self.nodes * G} ranks, but the world size is {world_size}")
        return self.with_nodes(world_size // G)

    def node_of(self, rank):
        return np.asarray(rank) // self.gpus_per_node

    def rail_of(self, rank):
        """The rail of a global rank (GPU g of a node -> rail g // gpus_per_rail)."""
        return (np.asarray(rank) % self.gpus_per_node) // self.gpus_per_rail

    def rail_gpu(self, node, rail, like):
        """The GPU of `node` on `rail` that stands in for local GPU index `like` (same position
        within its rail), as a global rank: the forwarding / landing GPU of a sprayed chunk."""
        return (np.asarray(node) * self.gpus_per_node + np.asarray(rail) * self.gpus_per_rail
                + (np.asarray(like) % self.gpus_per_node) % self.gpus_per_rail)

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, where: str = "<dict>") -> "Topology":
        return from_mapping(cls, data, where)


def presets() -> list[str]:
    return _presets.names(PRESET_DIR)


def load_topology(name_or_path) -> Topology:
    """A preset name (presets/topology/NAME.yaml) or a path to a topology YAML."""
    if isinstance(name_or_path, Topology):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"topology: expected a preset name or a path to a YAML file, got {shown(name_or_path)}")
    if not str(name_or_path).strip():
        raise ConfigError(f"an empty topology; presets: {', '.join(presets())} (or give a path to a YAML file)")
    p = _presets.meant(PRESET_DIR, name_or_path) or Path(name_or_path)
    if not p.suffix and not p.exists():
        raise ConfigError(f"unknown topology {name_or_path!r}; presets: {', '.join(presets())} "
                          f"(or give a path to a YAML file)")
    data = read_mapping(p, ConfigError, "topology", "a topology sets at least one of its keys (gpus_per_node, "
                                                    "rails_per_node, nic_gbps, ...; each has a default)")
    kind = "run" if set(data) & {"model", "parallelism", "training"} else \
        "policy" if "policy" in data and "gpus_per_node" not in data else None
    if kind:  # one line instead of every key it does not know
        raise ConfigError(f"{p}: this is a {kind} config; a topology is needed here (a run config's topology: "
                          f"section is one; e.g. configs/topology/dgx-h100.yaml, or a preset name)")
    data.setdefault("name", p.stem)
    return Topology.from_dict(data, str(p))
