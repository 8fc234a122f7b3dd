"""Run configs: one YAML for a whole training run, and the one loader for every config kind.

A run config has a `model`, `parallelism`, `training` and `data` section (keys are Megatron-LM argument
names: `num_layers` is `--num-layers`), a `balancer` (a policy YAML path, a policy preset name, or an
inline mapping of PolicyConfig keys) and a `topology` (a preset name from configs/topology/, a path, or an
inline mapping). `load_run_config(path, overrides)` validates all of it together; every error names the
file and the key. `load_any(path)` loads a run, policy or topology YAML, telling the kind by its
directory or its keys. Overrides are `key.sub=value` with a YAML-parsed value (`training.train_iters=10`,
`balancer.policy=ultraep`, `topology=dgx-a100`), the same on the command line and here.

Float keys also accept strings such as `3e-4`: YAML 1.1 (PyYAML) reads an exponent without a dot as text.
The reference of every key is docs/configuration.md, generated from these dataclasses (config/docs.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import cut, shown
from ..core.policy import ConfigError, PolicyConfig, as_policy
from .schema import build, parse_override, raise_errors, read_yaml, resolve_ref, suggest
from ..core import presets
from ..core.topology import PRESET_DIR as TOPOLOGY_DIR
from ..core.topology import Topology

POLICY_DIR = presets.POLICY_DIR
# a source checkout's root, where paths like configs/mini/... in a run config resolve as a last
# resort; None in an installed package (there only the cwd and the config's own directory count)
_ROOT = Path(__file__).resolve().parents[2]
REPO_DIR = _ROOT if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "configs").is_dir() else None


def _f(default=dataclasses.MISSING, doc: str = "", *, megatron: bool = True, choices=None, minimum=None, below=None,
       number_text: bool = False):
    """below: values must stay under it (Adam's betas, dropout: torch refuses 1 after minutes of start-up).
    number_text: a string key that also takes a YAML number, as its text (`split: 100`)."""
    return field(default=default, metadata={"doc": doc, "megatron": megatron, "choices": choices, "min": minimum,
                                            "below": below, "number_text": number_text})


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Model shape: Megatron-LM arguments (each key `k` is the flag `--k` with dashes)."""

    num_layers: int = _f(doc="transformer layers", minimum=1)
    hidden_size: int = _f(doc="model width", minimum=1)
    ffn_hidden_size: int = _f(doc="dense FFN width (also the expert width unless moe_ffn_hidden_size)", minimum=1)
    num_attention_heads: int = _f(doc="attention heads", minimum=1)
    num_query_groups: int | None = _f(None, "GQA key/value groups (emits --group-query-attention); null: MHA",
                                      minimum=1)
    seq_length: int = _f(doc="training sequence length", minimum=1)
    max_position_embeddings: int | None = _f(None, "null: seq_length; at least seq_length", minimum=1)
    num_experts: int = _f(doc="experts per MoE layer (TransformerConfig.num_moe_experts)", minimum=1)
    moe_router_topk: int = _f(2, "experts per token", minimum=1)
    moe_ffn_hidden_size: int | None = _f(None, "expert FFN width; null: ffn_hidden_size", minimum=1)
    moe_router_load_balancing_type: str = _f("aux_loss", "router-side balancing (Megatron)",
                                             choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"))
    moe_aux_loss_coeff: float = _f(0.0, "load-balancing loss weight", minimum=0)
    moe_z_loss_coeff: float | None = _f(None, "router z-loss weight; null: off", minimum=0)
    moe_token_dispatcher_type: str = _f("alltoall", "must be alltoall when a balancer is set (it replaces "
                                        "that dispatcher)", choices=("allgather", "alltoall", "flex"))
    moe_grouped_gemm: bool = _f(False, "grouped GEMM experts (GPU)")
    normalization: str = _f("RMSNorm", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = _f(1e-5, minimum=0)
    position_embedding_type: str = _f("rope", choices=("rope", "learned_absolute", "none"))
    rotary_base: int = _f(10000, "RoPE base", minimum=1)
    swiglu: bool = _f(True, "gated SiLU FFN")
    disable_bias_linear: bool = _f(True, "no biases in linear layers")
    untie_embeddings_and_output_weights: bool = _f(True)
    init_method_std: float = _f(0.02, minimum=0)
    hidden_dropout: float = _f(0.0, minimum=0, below=1)
    attention_dropout: float = _f(0.0, minimum=0, below=1)
    transformer_impl: str = _f("transformer_engine", "layer implementation; local needs no Transformer Engine",
                               choices=("transformer_engine", "local"))
    router_skew: float = _f(0.0, "demo trainer only (not a Megatron argument): logit bias of the hottest "
                            "expert, bias_e = skew / rank_e^1.2, to make routing skewed on purpose",
                            megatron=False, minimum=0)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout. world size = nodes x topology.gpus_per_node."""

    tensor_model_parallel_size: int = _f(1, minimum=1)
    pipeline_model_parallel_size: int = _f(1, minimum=1)
    expert_model_parallel_size: int = _f(1, "EP: the group the balancer plans over", minimum=1)
    expert_tensor_parallel_size: int | None = _f(
        None, "null: Megatron's default (= tensor_model_parallel_size); 1 with a balancer", minimum=1)
    context_parallel_size: int = _f(1, minimum=1)
    sequence_parallel: bool = _f(False)
    nodes: int = _f(1, "nodes of the topology (for CPU runs: virtual nodes)", megatron=False, minimum=1)
    world_size: int | None = _f(None, "null: nodes x topology.gpus_per_node; if given it must equal that",
                                megatron=False, minimum=1)
    backend: str = _f("nccl", "torch.distributed backend (--distributed-backend); gloo = CPU mode",
                      choices=("nccl", "gloo"))


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Optimizer, schedule, precision, logging and checkpoints (Megatron-LM arguments)."""

    micro_batch_size: int = _f(1, minimum=1)
    global_batch_size: int | None = _f(None, "null: micro_batch_size x data-parallel size", minimum=1)
    train_iters: int = _f(doc="optimizer steps", minimum=1)
    optimizer: str = _f("adam", choices=("adam", "sgd"))
    lr: float = _f(1e-4, minimum=0)
    min_lr: float = _f(0.0, "at most lr", minimum=0)
    lr_decay_style: str = _f("cosine", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_warmup_iters: int = _f(0, minimum=0)
    weight_decay: float = _f(0.1, minimum=0)
    clip_grad: float = _f(1.0, minimum=0)
    adam_beta1: float = _f(0.9, minimum=0, below=1)
    adam_beta2: float = _f(0.95, minimum=0, below=1)
    seed: int = _f(1234, minimum=0)
    bf16: bool = _f(False)
    fp16: bool = _f(False)
    use_distributed_optimizer: bool = _f(False)
    recompute_granularity: str | None = _f(None, "activation recomputation; null: off",
                                           choices=("full", "selective"))
    log_interval: int = _f(1, minimum=1)
    eval_interval: int | None = _f(None, minimum=1)
    eval_iters: int | None = _f(None, minimum=0)
    save_interval: int | None = _f(None, "required with save", minimum=1)
    save: str | None = _f(None, "checkpoint directory to write")
    load: str | None = _f(None, "checkpoint directory to resume from")


# the choices of Megatron-LM's --tokenizer-type (megatron/training/arguments.py, core_v0.16.1)
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                   "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Data and tokenizer (Megatron-LM arguments). Set exactly one of mock_data and data_path."""

    mock_data: bool = _f(False, "synthetic data (no files)")
    data_path: list[str] | None = _f(None, "Megatron --data-path entries (weights and prefixes)")
    split: str | None = _f(None, "train,valid,test weights: 1 to 3 numbers, e.g. 969,30,1", number_text=True)
    tokenizer_type: str | None = _f(None, "tokenizer class", choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = _f(None, "tokenizer file or name")
    vocab_size: int | None = _f(None, "NullTokenizer's vocabulary (also the CPU demo's)", minimum=1)


@dataclass(frozen=True)
class RunConfig:
    """One training run. `balancer` None: stock Megatron-Core, megatron-rails not installed."""

    model: ModelConfig
    parallelism: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    balancer: PolicyConfig | None
    topology: Topology
    description: str = ""
    source: str = ""

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def data_parallel_size(self) -> int:
        p = self.parallelism
        return p.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                * p.context_parallel_size)

    def to_dict(self) -> dict:
        """The resolved config as plain data; loading it again gives an equal RunConfig."""
        out = {"description": self.description}
        for name in ("model", "parallelism", "training", "data"):
            out[name] = dataclasses.asdict(getattr(self, name))
        out["balancer"] = dataclasses.asdict(self.balancer) if self.balancer else None
        out["topology"] = dataclasses.asdict(self.topology)
        return out

    def megatron_args(self) -> list[str]:
        """Megatron-LM command-line flags for pretrain_gpt.py (the balancer is installed separately)."""
        args = []
        for name in ("model", "parallelism", "training", "data"):
            section = getattr(self, name)
            for f in dataclasses.fields(section):
                v = getattr(section, f.name)
                if f.name == "max_position_embeddings" and v is None:
                    v = self.model.seq_length  # null means seq_length; Megatron-LM requires the flag
                if not f.metadata["megatron"] or v is None or v is False:
                    continue
                flag = "--distributed-backend" if f.name == "backend" else "--" + f.name.replace("_", "-")
                if f.name == "num_query_groups":
                    args.append("--group-query-attention")
                args += [flag] if v is True else [flag, *map(str, v if isinstance(v, list) else [v])]
        return args


SECTIONS = {"model": ModelConfig, "parallelism": ParallelConfig, "training": TrainingConfig, "data": DataConfig}
RUN_KEYS = ("description", *SECTIONS, "balancer", "topology")
NESTED = {"balancer": PolicyConfig, "topology": Topology}


def _elsewhere() -> dict:
    """Section of every section key, to point a key written in the wrong section to the right one."""
    return {k: s for s, c in SECTIONS.items() for k in (f.name for f in dataclasses.fields(c))}


# -- overrides --------------------------------------------------------------------------------------
def _check_path(kind: str, parts: list[str], text: str) -> None:
    """Reject overrides that name no key of this kind of config (with a suggestion)."""
    top = {"run": RUN_KEYS, "policy": [f.name for f in dataclasses.fields(PolicyConfig)],
           "topology": [f.name for f in dataclasses.fields(Topology)]}[kind]
    if parts[0] not in top:
        # a run config's section name before a key of this file (topology.gpus_per_node=4 on a
        # topology, balancer.slots=2 on a policy): its keys are top-level here
        section = {"topology": "topology", "policy": "balancer"}.get(kind)
        if len(parts) == 2 and parts[0] == section and parts[1] in top:
            raise ConfigError(f"override {text!r}: this is a {kind} config, whose keys are top-level: write "
                              f"{parts[1]}={text.partition('=')[2]}")
        raise ConfigError(f"override {text!r}: unknown key '{parts[0]}'"
                          + suggest(parts[0], top, "", _elsewhere() if kind == "run" else None))
    cls = (SECTIONS.get(parts[0]) or NESTED.get(parts[0])) if kind == "run" else None
    if len(parts) == 1:
        return
    if cls is None or len(parts) > 2:
        raise ConfigError(f"override {text!r}: '{'.'.join(parts[:-1])}' takes a value, not sub-keys")
    names = [f.name for f in dataclasses.fields(cls)]
    if parts[1] not in names:
        raise ConfigError(f"override {text!r}: unknown key '{parts[0]}.{parts[1]}'" + suggest(
            parts[1], names, parts[0] + ".", _elsewhere() if parts[0] in SECTIONS else None))


def apply_overrides(data: dict, overrides, kind: str, expand=None) -> tuple[dict, dict]:
    """A copy of `data` with each override set; returns (data, origin: dotted key -> override text).
    `expand(key, value)` turns a string balancer/topology into its mapping before a sub-key is set."""
    import copy

    data, origin = copy.deepcopy(data), {}
    given = overrides
    overrides = [] if given is None or isinstance(given, (str, bytes, dict)) else list(given)
    if isinstance(given, (str, bytes, dict)) or not all(isinstance(t, str) for t in overrides):
        raise ConfigError(f"overrides must be a list of KEY=VALUE strings, got {shown(given)}")
    for text in overrides:
        parts, value = parse_override(text)
        _check_path(kind, parts, text)
        node = data
        if len(parts) == 2:
            sub = node.get(parts[0])
            if isinstance(sub, str) and expand:
                sub = expand(parts[0], sub)
            if sub is None:
                sub = {}
            if not isinstance(sub, dict):
                raise ConfigError(f"override {text!r}: '{parts[0]}' is {shown(sub)}, not a mapping")
            node[parts[0]] = node = dict(sub)
        node[parts[-1]] = value
        origin[".".join(parts)] = text
    return data, origin


# -- files ------------------------------------------------------------------------------------------
KIND_HINT = ("a run config has model/parallelism/training, a policy has 'policy', a topology only topology keys "
             "(gpus_per_node, nic_gbps, ...)")


def _kind_by_keys(data: dict) -> str | None:
    if set(data) & {"model", "parallelism", "training"}:
        return "run"
    if "policy" in data:
        return "policy"
    # every topology key has a default (docs/rails.md), so a file of some of them is a topology; one with
    # its node shape is one whatever else it holds (its misspelled keys are then named as such)
    if set(data) & {"gpus_per_node", "rails_per_node"} or set(data) - _LABELS and set(data) <= _TOPOLOGY_KEYS:
        return "topology"
    return None


_TOPOLOGY_KEYS = frozenset(f.name for f in dataclasses.fields(Topology))
_LABELS = {"name", "description"}  # alone they tell no kind (a run config has a description too)


def _top_keys() -> list[str]:
    """Every top-level key of every kind of config, for the did-you-mean of an unrecognized file."""
    return [*RUN_KEYS, *(f.name for cls in NESTED.values() for f in dataclasses.fields(cls))]


def kind_of(path, data: dict) -> str:
    parent = Path(path).resolve().parent
    if parent == POLICY_DIR.resolve() or parent.name == "policies":
        return "policy"
    if parent == TOPOLOGY_DIR.resolve() or parent.name == "topology":
        return "topology"
    kind = _kind_by_keys(data)
    if kind:
        return kind
    # name the key the user most likely misspelled (`polcy:` -> 'policy') rather than only the rule, or
    # the key a file of this kind also needs where its other keys are right (a policy file of `slots: 2`)
    known = set(_top_keys())
    hints = [f"unknown key '{cut(str(k))}'{h}" for k in data
             if k not in known and (h := suggest(k, _top_keys())).startswith("; did you mean")]
    stray = [cut(str(k)) for k in data if k not in _TOPOLOGY_KEYS]
    needs = {"balancer": "and a policy file names its policy (policy: fsep)",
             "topology": f"but '{stray[0]}' is not" if stray else "and a topology file sets more than its name"}
    hints += [f"'{k}' is a {'policy' if section == 'balancer' else section} key, {needs[section]}"
              for k in data for section, cls in NESTED.items() if k in {f.name for f in dataclasses.fields(cls)}]
    raise ConfigError(f"{path}: cannot tell the kind of config: " + (hints[0] + " (" + KIND_HINT + ")" if hints
                                                                      else KIND_HINT))


def _check_is_run(path, data: dict) -> None:
    """One line for a policy or topology file given where a run config belongs (instead of a dozen
    'required key is missing' errors)."""
    kind = _kind_by_keys(data)
    if kind not in (None, "run"):
        raise ConfigError(f"{path}: this is a {kind} config; a run config is needed here (model, parallelism, "
                          f"training, data, balancer, topology; see configs/mini/mini-mixtral.yaml)")


def load_any(path, overrides=(), name: str | None = None):
    """RunConfig, PolicyConfig or Topology from a YAML file, by its directory or keys. `name`: what
    the messages call a policy or topology file (a preset's name, not its path inside the package)."""
    data = read_yaml(path)
    kind = kind_of(path, data)
    if kind == "run":
        return load_run_config(path, overrides)
    data, origin = apply_overrides(data, overrides, kind)
    errors = []
    if kind == "topology":
        data.setdefault("name", Path(path).stem)
    obj = build(PolicyConfig if kind == "policy" else Topology, data, name or str(path), "", errors, origin)
    raise_errors(errors)
    return obj


def _build_checked(cls, data: dict, where: str):
    errors = []
    obj = build(cls, data, where, "", errors)
    raise_errors(errors)
    return obj


def load_policy(ref) -> PolicyConfig:
    """A policy from a preset name or a YAML path, checked and worded as `config validate` words a
    policy file's problems (did-you-mean hints for misspelled keys, every problem on its own line)."""
    return as_policy(ref, _build_checked)


def load_run_config(path, overrides=()) -> RunConfig:
    """A validated RunConfig from a run YAML and `key.sub=value` overrides; ConfigError lists every
    problem, each naming the file and the key."""
    from .checks import check_run

    where, base = str(path), Path(path).resolve().parent
    raw = read_yaml(path)
    _check_is_run(path, raw)

    def expand(key, ref):
        found = resolve_ref(ref, base, POLICY_DIR if key == "balancer" else TOPOLOGY_DIR, REPO_DIR)
        if found is None:
            kind, pdir = ("policy", POLICY_DIR) if key == "balancer" else ("topology", TOPOLOGY_DIR)
            if Path(ref).is_dir():
                raise ConfigError(f"{where}: {key}: {ref!r} is a directory; give a {kind} file or a preset name "
                                  f"({', '.join(presets.names(pdir))})")
            if Path(ref).exists():  # a pipe or a device (/dev/null): there, but no file to read
                raise ConfigError(f"{where}: {key}: {ref!r} is not a regular file (a pipe or a device); give a "
                                  f"{kind} file or a preset name ({', '.join(presets.names(pdir))})")
            raise ConfigError(f"{where}: {key}: {kind} file {ref!r} not found (a preset name: "
                              f"{', '.join(presets.names(pdir))}; or a path relative to the working "
                              f"directory, {base}" + (f" or {REPO_DIR})" if REPO_DIR else ")"))
        try:
            data = read_yaml(found)
        except ConfigError as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
        if key == "topology":
            data.setdefault("name", found.stem)
        return data

    raw, origin = apply_overrides(raw, overrides, "run", expand)
    errors = []
    for k in raw:
        if k not in RUN_KEYS:
            errors.append(f"{where}: {cut(str(k))}: unknown key" + suggest(k, RUN_KEYS, "", _elsewhere()))
    parts = {name: build(cls, raw.get(name, {}) or {}, where, f"{name}.", errors, origin, _elsewhere())
             for name, cls in SECTIONS.items()}
    nested = {}
    for key, cls in NESTED.items():
        value = raw.get(key)
        if value is None and key == "topology":
            errors.append(f"{where}: topology: required key is missing (a preset such as dgx-h100, or a path)")
            continue
        if value is None:
            nested[key] = None
            continue
        if isinstance(value, str):
            try:
                value = expand(key, value)
            except ConfigError as e:
                errors.append(str(e))
                continue
        nested[key] = build(cls, value, where, f"{key}.", errors, origin)
    desc = raw.get("description", "")
    if not isinstance(desc, str):
        errors.append(f"{where}: description: expected string, got {shown(desc)}")
    raise_errors(errors)
    return check_run(RunConfig(**parts, **nested, description=desc or "", source=where), where, origin)
