"""Checking YAML data against frozen dataclasses: types, choices, minimums, unknown keys with a
did-you-mean hint, `key.sub=value` overrides. Every message names the file and the dotted key.

Field metadata read here (set by config/run.py `_f`): doc, choices, min, below, number_text. Annotations understood: int, float,
bool, str, list[str] and `X | None`. Floats also accept strings such as "3e-4" (PyYAML reads an exponent
without a dot as text).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path

import numpy as np

from ..core import presets
from ..core.errors import cut, shown
from ..core.policy import ConfigError, number_text
from ..core.policy import suggest as _suggest
from ..core.yamlfile import YamlShapeError, parse, read_mapping

# integer keys of run-config sections are Megatron-LM arguments and tensor sizes: int32 in Megatron-Core and
# torch's kernels (policy and topology keys check their own, tighter, ranges)
INT_MAX = 2**31 - 1

# keys people try first; difflib cannot see that `steps` means `train_iters`
SYNONYMS = {"steps": "train_iters", "iters": "train_iters", "iterations": "train_iters", "layers": "num_layers",
            "hidden": "hidden_size", "heads": "num_attention_heads", "experts": "num_experts",
            "num_moe_experts": "num_experts", "topk": "moe_router_topk", "ffn": "ffn_hidden_size",
            "seq": "seq_length", "seq_len": "seq_length", "learning_rate": "lr", "tp": "tensor_model_parallel_size",
            "pp": "pipeline_model_parallel_size", "ep": "expert_model_parallel_size", "batch_size": "micro_batch_size",
            "vocab": "vocab_size", "world": "world_size", "num_nodes": "nodes", "policy_file": "balancer"}


def suggest(key, valid, prefix: str = "", elsewhere: dict | None = None) -> str:
    """core.policy.suggest with the run-config synonyms: '; did you mean ...?', else where the key
    belongs, else (a few of) the valid keys."""
    return _suggest(key, valid, prefix, elsewhere, SYNONYMS)


def type_name(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = next(a for a in args if a is not type(None))
        return f"{type_name(inner)} or null"
    if typing.get_origin(tp) is list:
        return "list of strings"
    return {int: "integer", float: "number", bool: "true or false", str: "string"}[tp]


def _coerce(tp, v):
    """(ok, value) for YAML value v against annotation tp."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if v is None:
            return True, None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        v = [v] if isinstance(v, str) else v
        return isinstance(v, list) and all(isinstance(x, str) for x in v), v
    if tp is float:
        if isinstance(v, str):
            f = number_text(v)
            return f is not None, (v if f is None else f)
        return isinstance(v, (int, float)) and not isinstance(v, bool), float(v) if isinstance(v, (int, float)) else v
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), v
    return isinstance(v, tp), v


def build(cls, data, where: str, prefix: str, errors: list, origin: dict | None = None, elsewhere=None):
    """An instance of dataclass `cls` from mapping `data`, or None with messages appended to `errors`.
    `prefix` names the section in messages ('training.'); `origin` maps dotted keys to the override
    that set them; `elsewhere` maps keys of other sections to their section, for hints."""
    origin = origin or {}
    n0 = len(errors)
    if not isinstance(data, dict):
        errors.append(f"{where}: {prefix.rstrip('.') or 'top level'}: expected a mapping of keys to values, "
                      f"got {shown(data)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    def err(key, msg):
        src = origin.get(f"{prefix}{key}")
        name = cut(str(key)) if str(key).strip() else repr(key)  # an empty key shows as ''
        errors.append(f"{where}: {prefix}{name}: {msg}" + (f" (from override '{src}')" if src else ""))

    for k in data:
        if k not in fields:
            err(k, "unknown key" + suggest(k, fields, prefix, elsewhere))
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                err(name, "required key is missing")
            continue
        ok, v = _coerce(hints[name], data[name])
        meta = f.metadata
        if not ok and meta.get("number_text") and isinstance(v, (int, float)) and not isinstance(v, bool):
            # YAML read `split: 100` as a number; Megatron-LM takes the text, written out (1e-05 would
            # read as the numbers 1 and 05 there)
            ok, v = True, str(v) if isinstance(v, int) else np.format_float_positional(v, trim="-")
        own = "min" in meta  # a run-section key (config/run.py `_f`); policy and topology keys check themselves
        if not ok:
            err(name, f"expected {type_name(hints[name])}, got {shown(data[name])}")
        elif own and isinstance(v, float) and not math.isfinite(v):  # --lr inf would reach Megatron-LM as is
            err(name, f"expected a finite number, got {shown(data[name])}")
        elif own and isinstance(v, int) and not isinstance(v, bool) and v > INT_MAX:
            err(name, f"must be <= {INT_MAX}, got {shown(v)}")
        elif v is not None and meta.get("choices") and v not in meta["choices"]:
            hint = suggest(v, meta["choices"])
            err(name, f"must be one of {', '.join(map(str, meta['choices']))}, got {shown(v)}"
                + (hint if "did you mean" in hint else ""))
        elif v is not None and meta.get("min") is not None and v < meta["min"]:
            err(name, f"must be >= {meta['min']}, got {shown(v)}")
        elif v is not None and meta.get("below") is not None and v >= meta["below"]:
            err(name, f"must be < {meta['below']}, got {shown(v)}")
        elif own and meta.get("megatron") and any(isinstance(x, str) and (not x.strip() or x.startswith("-"))
                                                  for x in (v if isinstance(v, list) else [v])):
            # it becomes a flag's value on Megatron-LM's command line: '' is no path, and '--load'
            # would be read as a flag of its own
            err(name, f"{shown(v)}: an empty value or one starting with '-' is no value for --"
                      f"{name.replace('_', '-')}")
        kwargs[name] = v
    if len(errors) > n0:
        return None
    try:
        return cls(**kwargs)
    except (ConfigError, TypeError) as e:  # the class's own checks name the key first ("slots: ...")
        for msg in getattr(e, "errors", None) or [str(e)]:  # a topology reports all its problems at once
            src = origin.get(prefix + msg.split(":", 1)[0])
            errors.append(f"{where}: {prefix}{msg}" + (f" (from override '{src}')" if src else ""))
        return None


def raise_errors(errors: list) -> None:
    if errors:
        e = ConfigError("\n".join(errors))
        e.errors = list(errors)
        raise e


def parse_override(text: str) -> tuple[list[str], object]:
    """'training.train_iters=10' -> (['training', 'train_iters'], 10); the value is parsed as YAML."""
    import yaml

    key, sep, raw = str(text).partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE or SECTION.KEY=VALUE, "
                          f"e.g. training.train_iters=10")
    if not raw.strip():  # YAML would read null: for `balancer=` that is stock Megatron, silently
        raise ConfigError(f"override {shown(text)}: an empty value; write {key.strip()}=null for none (YAML's "
                          "null), else give a value")
    try:  # the checks a file gets: string keys, bounded aliases
        return [p.strip() for p in parts], parse(raw)
    except yaml.YAMLError as e:
        why = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"override {shown(text)}: the value is not valid YAML ({why})") from None
    except YamlShapeError as e:
        raise ConfigError(f"override {shown(text)}: {e}") from None
    except RecursionError:
        raise ConfigError(f"override {shown(text)}: the value is nested too deeply to be a config value") from None


def read_yaml(path) -> dict:
    return read_mapping(path, ConfigError, "YAML",
                        "expected a run, policy or topology config (a mapping of keys to values)")


def resolve_ref(ref: str, base: Path, preset_dir: Path, root: Path | None) -> Path | None:
    """A referenced YAML: a preset name (no suffix), or a path relative to the cwd, the referring
    file's directory or `root` (a source checkout; None for none), in that order."""
    p = Path(ref)
    preset = presets.meant(preset_dir, ref)
    if preset is not None:
        return preset
    for cand in ([p] if p.is_absolute() else [p, base / p] + ([root / p] if root else [])):
        if cand.is_file():
            return cand
    return None
