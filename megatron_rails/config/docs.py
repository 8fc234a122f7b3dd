"""docs/configuration.md, generated from the config dataclasses so the reference cannot drift.

    megatron-rails config docs --out docs/configuration.md

tests/test_runconfig.py checks that the committed file equals `generate()`. PolicyConfig and Topology
carry their documentation in their class docstrings; their per-key lines live here, and `generate`
refuses to run while a field lacks one.
"""
from __future__ import annotations

import dataclasses
import typing

POLICY_DOCS = {
    "policy": "none \\| eplb \\| fsep \\| ultraep \\| lp (docs/policies.md)",
    "slots": "R: expert-sized slots per rank beyond ceil(E/D), 0..1024; owner layouts use them for replicas "
             "(eplb, ultraep and lp on those need >= 1), fsep materializes ceil(E/D) + R",
    "ranks_per_node": "G: EP ranks sharing a node (same-node replicas are preferred). Policy files: 0 = the "
                      "launcher's ranks per node (torchrun's LOCAL_WORLD_SIZE; without it all EP ranks on one "
                      "node). In a run config 0 means derive it from the topology and layout, and a "
                      "non-zero value must match that",
    "window": "eplb: steps in the moving load window, 1..2^20",
    "interval": "eplb: re-plan period in steps, 1..2^20",
    "placement": "lp: the placement it schedules tokens on (static \\| eplb \\| ultraep \\| fsep)",
    "comm": "direct \\| rails: token all-to-all backend (rails: RailS multi-phase over rail groups)",
    "tolerance": "owner-layout policies (ultraep, eplb, lp on those) move no weights while the stock max/mean tokens "
                 "per rank is at most 1 + tolerance; above it they balance fully (a trigger, not a target). fsep "
                 "materializes one replica per loaded expert where that keeps max/mean within 1 + tolerance, "
                 "else every slot",
    "rails_tolerance": "comm rails: spray an exchange over all rails only when the rail-matched direct all-to-all "
                       "would load its busiest rail more than 1 + rails_tolerance times the even spread; else "
                       "send it direct (one all-to-all instead of three phases)",
    "replica_cost_tokens": "within an optimizer step the placement fixed by its first microbatch grows by a "
                           "replica only when the tokens it takes off the busiest rank over the step's remaining "
                           "microbatches reach this, its weights' and gradient's network time in tokens of expert "
                           "compute; 0: derived from the weights' dtype for a 400 Gb/s NIC and a 989 TFLOPS GPU "
                           "(about 13,000 in bf16), 0..2^40",
    "dedup": "node dedup, when the EP group spans nodes: a token crosses the network once per remote node "
             "holding one of its experts and fans out over NVLink there; its outputs are summed in that node "
             "before they come back (the same bits either way). false: a row per token-expert pair. "
             "`simulate run` prices it the same way (`--dedup` overrides)",
    "trace": "a .npz file recording every training forward's all-gathered token counts per microbatch and layer, "
             "with each row's optimizer step (\"\": none): one writer per pipeline stage (stage s > 0: "
             "FILE.stage{s}.npz), rewritten at every checkpoint and at exit; replay with `simulate run --trace` "
             "and `bench step --trace`. The launcher's flag: `--rails-trace`",
    "check_plan": "validate the plan and all-reduce its digest every layer; raise on every rank on a mismatch (debug)",
}
TOPOLOGY_DOCS = {
    "name": "preset name (defaults to the file name)",
    "gpus_per_node": "GPUs (ranks) per node, 1..1024",
    "rails_per_node": "NICs per node, 1..1024; NIC i of every node is on rail i; must divide gpus_per_node",
    "nic_gbps": "per NIC, per direction, Gb/s (finite, > 0)",
    "nvlink_gbps": "per GPU, per direction, Gb/s (450 GB/s = 3600; finite, > 0)",
    "latency_us": "fixed cost of one message on one hop (finite, >= 0)",
    "gpu_tflops": "dense bf16 TFLOP/s, for the iteration-time simulator (finite, > 0)",
    "gpu_memory_gib": "memory per GPU in GiB (2^30 bytes: an H100's 80 GB of HBM), for `simulate run`'s "
                      "per-GPU memory table (finite, > 0)",
    "nodes": "0..2^20; 0: set by the world size. In a run config it is filled from parallelism.nodes",
    "description": "free text",
}
RUN_DOCS = {
    "description": "free text",
    "model": "model shape and router (Megatron-LM arguments)",
    "parallelism": "parallel sizes, node count, backend",
    "training": "optimizer, schedule, precision, logging, checkpoints (Megatron-LM arguments)",
    "data": "data and tokenizer (Megatron-LM arguments)",
    "balancer": "a policy YAML path or preset name (configs/policies/NAME.yaml), an inline mapping of policy "
                "keys, or null for stock Megatron-Core without megatron-rails",
    "topology": "a preset name (configs/topology/NAME.yaml), a path, or an inline mapping of topology keys",
}

HEADER = """# Configuration reference

<!-- generated by `megatron-rails config docs --out docs/configuration.md` from megatron_rails/config/run.py,
     core/policy.py and core/topology.py; tests/test_runconfig.py fails when this file is out of date -->

Three kinds of YAML, one loader (`megatron_rails.config.run.load_any`, `megatron-rails config validate`):

| kind | where | recognized by |
|------|-------|---------------|
| run config | configs/mixtral/, configs/mini/, configs/deepseek/ | a `model`, `parallelism` or `training` key |
| policy | configs/policies/ | its directory, or a `policy` key |
| topology | configs/topology/ | its directory, a `gpus_per_node` or `rails_per_node` key, or only topology keys (each has a default) |

Every error names the file and the dotted key; unknown keys get a did-you-mean hint (also a misspelled key
that hides the kind of a file, such as `polcy:`), and a topology lists all its bad keys at once. An empty
file is an error for every kind, and so is a key that is not a name (`1:`, `true:`, `null:`: keys are
strings) or aliases (`*name`) that expand to more than 10000 values. Numbers such as `3e-4` are accepted for number keys (PyYAML reads an
exponent without a dot as a string); NaN and inf are not, and integer keys of the run sections are at most
2^31 - 1 (policy and topology keys have the ranges given below). Booleans and integers are read
strictly, as written: only `true` and `false` are booleans (`yes`, `no`, `on`, `off` are text, which a
boolean key refuses); an integer is decimal digits, so `010` is ten (not YAML 1.1's octal eight), and
`0x10`, `0o10`, `0b101`, `1_000` and `2:00` are text (1.1 reads 16, 8, 5, 1000 and sexagesimal 120),
which an integer key refuses; an explicit tag (`!!int 0x10`) is read as tagged.

**Overrides**, the same on every command line and in `load_run_config(path, overrides)`: `KEY=VALUE` or
`SECTION.KEY=VALUE`, the value parsed as YAML, applied in order before validation (an empty value is
refused: YAML's null is written out, `balancer=null` for stock Megatron-Core):

```bash
megatron-rails config show configs/mini/mini-mixtral.yaml balancer.policy=ultraep training.train_iters=10
megatron-rails config show configs/mixtral/mixtral-8x7b.yaml parallelism.nodes=8 topology=dgx-a100
```

`balancer.KEY=...` and `topology.KEY=...` also work when the file names a policy or topology file: the file
is loaded first, then the key is set. `megatron-rails config show FILE` prints the resolved config, which
loads again to the same result.

**Derived values** (filled in by the loader): `parallelism.world_size` = `parallelism.nodes` x
`topology.gpus_per_node`; `training.global_batch_size` defaults to micro-batch x data-parallel size;
`topology.nodes` = `parallelism.nodes`; `balancer.ranks_per_node` = the EP-group members that share a node
(gpus_per_node / expert tensor parallel size, at most the EP size).

**Cross-checks**: world size against nodes x gpus_per_node and against TP x PP x CP and ETP x EP x PP;
layers against PP; heads and query groups against TP; num_experts against the EP size (Megatron-Core's
MoELayer needs num_experts % EP == 0, and policy `none` says so itself); the global batch against
micro-batch x DP; the balancer's ranks_per_node against the layout; the policy against the EP group (the
planner's own checks); a balancer needs `moe_token_dispatcher_type: alltoall` and
`expert_tensor_parallel_size: 1` (EP groups may span TP ranks); TP > 1 needs `sequence_parallel: true`
(Megatron-Core's MoELayer refuses to train without it); exactly one of `data.mock_data` and
`data.data_path`.
"""


def _type(tp) -> str:
    from .schema import type_name

    try:
        return type_name(tp)
    except KeyError:
        return str(tp)


def _default(f) -> str:
    if f.default is dataclasses.MISSING:
        return "**required**"
    v = f.default
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else f"`{v}`" if v != "" else '`""`'


def _table(cls, docs: dict | None = None, megatron: bool = False) -> list[str]:
    hints = typing.get_type_hints(cls)
    head = "| key | type | default |" + (" Megatron flag |" if megatron else "") + " meaning |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in dataclasses.fields(cls):
        if docs is not None and f.name not in docs:
            raise KeyError(f"{cls.__name__}.{f.name} has no documentation: add it to config/docs.py")
        doc = docs[f.name] if docs is not None else f.metadata.get("doc", "")
        choices = f.metadata.get("choices")
        if choices:
            doc = (doc + "; " if doc else "") + "one of " + ", ".join(f"`{c}`" for c in choices)
        flag = ""
        if megatron:
            flag = ("`--distributed-backend`" if f.name == "backend" else
                    f"`--{f.name.replace('_', '-')}`" if f.metadata.get("megatron") else "(not Megatron)")
            flag = " " + flag + " |"
        rows.append(f"| `{f.name}` | {_type(hints[f.name])} | {_default(f)} |{flag} {doc} |")
    return rows


def generate() -> str:
    from ..core.policy import PolicyConfig
    from ..core.topology import Topology
    from .run import RUN_KEYS, SECTIONS

    out = [HEADER, "## Run config", "", "Top-level keys:", "", "| key | meaning |", "|---|---|"]
    out += [f"| `{k}` | {RUN_DOCS[k]} |" for k in RUN_KEYS]
    for name, cls in SECTIONS.items():
        out += ["", f"### `{name}`", "", cls.__doc__.strip().splitlines()[0], "", *_table(cls, megatron=True)]
    out += ["", "## Policy config (`balancer`, configs/policies/*.yaml)", "", *_table(PolicyConfig, POLICY_DOCS),
            "", "## Topology config (`topology`, configs/topology/*.yaml)", "", *_table(Topology, TOPOLOGY_DOCS), ""]
    return "\n".join(out)
