"""Megatron-LM command-line flags for megatron-rails.

    parser = add_arguments(parser)          # Megatron's extra_args_provider convention
    ...                                     # Megatron parses and validates its args
    install_from_args(args)                 # before the model is built

| flag                      | PolicyConfig key | default (None = not given) |
|---------------------------|------------------|----------------------------|
| `--moe-balancer P`        | policy           | the YAML's, else stock Megatron (nothing installed) |
| `--moe-balancer-slots R`  | slots            | the YAML's, else PolicyConfig's |
| `--moe-rails-comm C`      | comm             | the YAML's, else PolicyConfig's |
| `--rails-trace F.npz`     | trace            | the YAML's, else none (megatron/trace_log.py) |
| `--rails-config F.yaml`   | (whole file)     | none |

Precedence: PolicyConfig defaults < `--rails-config` YAML < the flags above.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

from ..core.errors import check_file
from ..core.policy import COMMS, ConfigError, PolicyConfig
from ..core.planners import POLICIES

GROUP_TITLE = "megatron-rails"
# dest -> (flag, PolicyConfig key); the key is None for --rails-config (the whole file)
FLAGS = {
    "moe_balancer": ("--moe-balancer", "policy"),
    "moe_balancer_slots": ("--moe-balancer-slots", "slots"),
    "moe_rails_comm": ("--moe-rails-comm", "comm"),
    "rails_trace": ("--rails-trace", "trace"),
    "rails_config": ("--rails-config", None),
}
DISPATCHER_FLAG = "--moe-token-dispatcher-type alltoall"

_last_logged: PolicyConfig | None = None


def _slots(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _yaml_file(text: str) -> str:
    check_file(text, "policy config", argparse.ArgumentTypeError)  # names a directory or a pipe as such
    return text


def _trace_file(text: str) -> str:
    """A .npz path whose directory exists: refused at the first parse, not when the model is built."""
    from pathlib import Path

    if not text.lower().endswith(".npz"):
        raise argparse.ArgumentTypeError(f"expected a .npz file to record the routing trace into, got {text!r}")
    if not Path(text).parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: directory {str(Path(text).parent)!r} does not exist")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "megatron-rails" argument group to `parser` and return it. Adding twice is a no-op
    (the patched pretrain_gpt.py run through the launcher chains it twice)."""
    if not isinstance(parser, argparse.ArgumentParser):  # Megatron-LM's extra_args_provider gets its parser
        raise TypeError(f"add_arguments: expected an argparse.ArgumentParser, got {type(parser).__name__}")
    if "--moe-balancer" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(
        GROUP_TITLE, "skew-aware expert parallelism (needs --moe-token-dispatcher-type alltoall); "
        "precedence: built-in defaults < --rails-config < the other flags")
    group.add_argument("--moe-balancer", choices=POLICIES, default=None, metavar="{" + ",".join(POLICIES) + "}",
                       help="expert balancing policy; not given (and no --rails-config): stock Megatron")
    group.add_argument("--moe-balancer-slots", type=_slots, default=None, metavar="R",
                       help="redundant expert slots per rank (policy key `slots`)")
    group.add_argument("--moe-rails-comm", choices=COMMS, default=None,
                       help="token all-to-all backend (policy key `comm`)")
    group.add_argument("--rails-trace", type=_trace_file, default=None, metavar="FILE.npz",
                       help="record every training forward's token counts per microbatch and MoE layer into this "
                            "trace (policy key `trace`; pipeline stage s > 0 writes FILE.stage{s}.npz); rewritten "
                            "after every checkpoint save and at exit")
    group.add_argument("--rails-config", type=_yaml_file, default=None, metavar="FILE.yaml",
                       help="policy YAML (configs/policies/*.yaml); the flags above override its keys")
    return parser


class _FlagError(argparse.ArgumentParser):
    """A parser of our flags alone whose errors raise ConfigError (one line) instead of exiting."""

    def error(self, message):
        raise ConfigError(message)


def check_flags(argv: list[str]) -> PolicyConfig | None:
    """Our flags among a Megatron-LM command line `argv` (the script's arguments; the rest is left to
    Megatron-LM), checked as Megatron's parser and policy_from_args would check them, before
    anything imports Megatron: ConfigError for a bad one. Returns the PolicyConfig they ask for
    (None: stock). Megatron-LM's parser takes no abbreviations, and neither does this one."""
    parser = add_arguments(_FlagError(prog="megatron-rails", add_help=False, allow_abbrev=False))
    known, _ = parser.parse_known_args(argv)
    return policy_from_args(known)


def chain_extra_args(provider=None):
    """An extra_args_provider applying Megatron's own `provider` (if any), then add_arguments."""
    def extra_args_provider(parser):
        if provider is not None:
            parser = provider(parser)
        return add_arguments(parser)

    return extra_args_provider


def _namespace(args):
    """`args`, or a mapping of Megatron's argument names as the namespace it would be."""
    return argparse.Namespace(**{str(k): v for k, v in args.items()}) if isinstance(args, Mapping) else args


def policy_from_args(args) -> PolicyConfig | None:
    """The PolicyConfig the flags on `args` ask for (YAML first, then flag overrides), or None when
    neither --moe-balancer nor --rails-config is given. Missing attributes count as not given; a
    mapping of the same names counts as the namespace it would be."""
    args = _namespace(args)
    given = {dest: getattr(args, dest, None) for dest in FLAGS}
    if given["moe_balancer"] is None and given["rails_config"] is None:
        stray = [FLAGS[d][0] for d in ("moe_balancer_slots", "moe_rails_comm", "rails_trace")
                 if given[d] is not None]
        if stray:
            raise ConfigError(f"{' and '.join(stray)} given without --moe-balancer or --rails-config: "
                              "name a policy with one of them")
        return None
    cfg = PolicyConfig()
    if given["rails_config"] is not None:
        if not isinstance(given["rails_config"], (str, os.PathLike)):
            raise ConfigError(f"--rails-config: expected a YAML path or a preset name, got {given['rails_config']!r}")
        try:
            cfg = PolicyConfig.from_yaml(given["rails_config"])
        except ConfigError as err:
            raise ConfigError(f"--rails-config: {err}") from None
    flags = {dest: (flag, key) for dest, (flag, key) in FLAGS.items() if key is not None and given[dest] is not None}
    try:  # all at once: the file's policy none (no slots) with --moe-balancer ultraep --moe-balancer-slots 2 is fine
        return dataclasses.replace(cfg, **{key: given[dest] for dest, (_, key) in flags.items()})
    except ConfigError as err:
        named = " ".join(f"{flag} {given[dest]!r}" for dest, (flag, _) in flags.items())
        raise ConfigError(f"{named}: {err}") from None


def check_megatron_args(args, cfg: PolicyConfig) -> None:
    """The Megatron-LM settings the balancer needs (checked only where `args` carries them).
    The expert-parallel size is not read here: the dispatcher takes it from its process group."""
    dispatcher = getattr(args, "moe_token_dispatcher_type", "alltoall")
    if dispatcher != "alltoall":
        raise ConfigError(f"--moe-balancer {cfg.policy} replaces Megatron-Core's alltoall token dispatcher: "
                          f"pass {DISPATCHER_FLAG} (got --moe-token-dispatcher-type {dispatcher})")
    if hasattr(args, "num_experts") and args.num_experts is None:
        raise ConfigError(f"--moe-balancer {cfg.policy} needs an MoE model: pass --num-experts")
    # Megatron-LM's validation sets a missing expert TP size to the TP size; the dispatcher would
    # refuse it when the model is built, after minutes of start-up
    given = getattr(args, "expert_tensor_parallel_size", None)
    etp = int(given or getattr(args, "tensor_model_parallel_size", 1) or 1)
    if etp != 1:
        src = "" if given else ", Megatron's default: --tensor-model-parallel-size"
        raise ConfigError(f"--moe-balancer {cfg.policy} moves whole experts: pass --expert-tensor-parallel-size 1 "
                          f"(got {etp}{src}); expert-parallel groups may span tensor-parallel ranks")
    from .settings import unsupported  # the dispatcher's own refusals, named before the model is built

    why = unsupported(args, cfg)
    if why:
        raise ConfigError(why)


def install_from_args(args, *, quiet: bool = False) -> PolicyConfig | None:
    """Build the PolicyConfig from parsed Megatron args, check it against them and install the
    dispatcher (megatron_rails.install). Returns None, installing nothing, when neither
    --moe-balancer nor --rails-config was given: Megatron stays stock."""
    args = _namespace(args)  # check_megatron_args reads it as policy_from_args does
    cfg = policy_from_args(args)
    if cfg is None:
        return None
    check_megatron_args(args, cfg)
    from .install import install

    install(cfg)
    global _last_logged
    if not quiet and cfg != _last_logged and int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron-rails: installed policy={cfg.policy} slots={cfg.slots} comm={cfg.comm}"
              + (f" trace={cfg.trace}" if cfg.trace else "")
              + (f" (from {args.rails_config})" if getattr(args, "rails_config", None) else ""), flush=True)
    _last_logged = cfg
    return cfg
