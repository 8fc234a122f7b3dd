"""Zero-fork hooks into Megatron-LM's training entry points (for `python -m megatron_rails.launch`).

Megatron-LM's pretrain_gpt.py has no plugin hook. Where its arguments are parsed (read from the
Megatron-LM source, 2026-08; all names are module attributes under `megatron.training`):

| Megatron-LM          | pretrain_gpt.py calls                                     | parser built by | args final when this returns |
|----------------------|-----------------------------------------------------------|-----------------|------------------------------|
| core_v0.15 .. v0.17  | `pretrain(..., extra_args_provider=)`                     | `initialize.parse_args` (from-import of `arguments.parse_args`), called by `initialize.initialize_megatron` | `training.initialize_megatron` (the name `pretrain` looks up) |
| core_v0.18 .. main   | `arguments.parse_and_validate_args(extra_args_provider=)` | `arguments.parse_args` | `arguments.parse_and_validate_args` |
| both                 | `inprocess_restart.maybe_wrap_for_inprocess_restart` first calls `arguments.parse_args(ignore_unknown_args=True)`: this is the call that answers `--help` | | |

For the duration of the run we wrap:
* every `parse_args` binding (`arguments`, and `initialize` where it has one): our flags are chained
  into each parser Megatron builds, so they are accepted and listed by `--help`;
* `parse_and_validate_args` (>= 0.18), else `initialize_megatron` (<= 0.17, in `training`,
  `initialize` and the package): when it returns, `install_from_args(args)` runs, after Megatron
  validated its arguments and before any model is built;
* `save_checkpoint` (in `checkpointing`, and the name `training` imported from it): when a save
  returns, every routing trace being recorded is rewritten (`--rails-trace`, trace_log.flush_all).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import os
import runpy
import sys
from pathlib import Path

from .args import FLAGS, add_arguments, chain_extra_args, check_megatron_args, install_from_args, policy_from_args

CHECKOUT_HINT = "put a Megatron-LM checkout on PYTHONPATH or set MEGATRON_LM_DIR"


class LaunchError(RuntimeError):
    """The launcher cannot run the given script (missing file, no Megatron-LM, unknown version)."""


def import_megatron_training():
    """The `megatron.training` modules we hook: (package, arguments, initialize, training).
    MEGATRON_LM_DIR, when set, is put on sys.path first."""
    lm_dir = os.environ.get("MEGATRON_LM_DIR")
    if lm_dir and lm_dir not in sys.path:
        sys.path.insert(1 if sys.path else 0, lm_dir)
    try:
        found = importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron package at all
        found = False
    if not found:
        raise LaunchError("megatron.training is not importable: the megatron-core pip package does not contain "
                          f"it, it comes from a Megatron-LM checkout; {CHECKOUT_HINT}")
    try:
        import megatron.training as package
        from megatron.training import arguments, initialize, training
    except ImportError as err:
        missing = getattr(err, "name", None) or ""
        if missing.startswith("megatron.core"):
            core = sys.modules.get("megatron.core")  # imported already: the adapter runs on it
            where = (f"{os.path.dirname(getattr(core, '__file__', '') or '?')}, "
                     f"version {getattr(core, '__version__', '?')}")
            raise LaunchError(f"megatron.training needs {missing}, which the megatron.core in use lacks "
                              f"({where}): "
                              "the Megatron-LM checkout and megatron-core differ in version; use the checkout's "
                              "own megatron/core or the pip release of its tag") from err
        raise LaunchError(f"megatron.training (Megatron-LM) failed to import: {err}; install Megatron-LM's "
                          "requirements into this environment") from err
    return package, arguments, initialize, training


def _with_our_provider(parse_args):
    """`parse_args(extra_args_provider=None, ...)` with add_arguments chained after the provider."""
    sig = inspect.signature(parse_args)
    if "extra_args_provider" not in sig.parameters:
        raise LaunchError(f"{parse_args.__module__}.{parse_args.__qualname__}{sig} takes no extra_args_provider: "
                          "this Megatron-LM version is not supported by the launcher; use the patches in "
                          "patches/megatron-lm/")

    @functools.wraps(parse_args)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = chain_extra_args(bound.arguments.get("extra_args_provider"))
        parsed = parse_args(*bound.args, **bound.kwargs)
        # our flags, --rails-config's content and the Megatron settings they need checked now, at the
        # first parse (before Megatron's CUDA check and distributed start-up); the dispatcher is
        # installed once the args are final, and they are checked again then
        ours = with_our_flags(argparse.Namespace(**vars(parsed)))
        cfg = policy_from_args(ours)
        if cfg is not None:
            check_megatron_args(ours, cfg)
        _define_te_general_gemm()
        return parsed

    return wrapper


def _define_te_general_gemm() -> None:
    """Stock runs too: without it Megatron-Core 0.16 cannot run an MoE model without Transformer
    Engine at all (the NameError is Megatron's, the model math unchanged). Done at the first parse,
    after our flags are checked: it imports Megatron-Core, which a refused flag need not wait for."""
    from .compat import define_te_general_gemm

    if define_te_general_gemm() and os.environ.get("RANK", "0") == "0":
        print("megatron-rails: defined megatron.core moe_utils.te_general_gemm = None (Megatron-Core "
              "without Transformer Engine leaves it undefined; the router uses its torch GEMM)",
              file=sys.stderr, flush=True)


def _flush_traces_after(fn):
    """`fn` (a checkpoint save) followed by trace_log.flush_all()."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        from .trace_log import flush_all

        flush_all()
        return result

    return wrapper


def _install_after(fn, final_args):
    """`fn` followed by install_from_args(final_args(result))."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        install(final_args(result))
        return result

    return wrapper


def install(args) -> None:
    """install_from_args on Megatron's final args (with_our_flags)."""
    install_from_args(with_our_flags(args))


def with_our_flags(args):
    """`args` with our flags as the command line gives them. `--yaml-cfg` replaces Megatron's
    namespace with one read from its YAML: our flags on the command line then win over the YAML's
    (docs/megatron-lm.md), which count where the command line has none."""
    from_yaml = getattr(args, "yaml_cfg", None) is not None or \
        any(a == "--yaml-cfg" or a.startswith("--yaml-cfg=") for a in sys.argv[1:])
    if from_yaml or any(not hasattr(args, dest) for dest in FLAGS):
        parser = add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
        ours, _ = parser.parse_known_args(sys.argv[1:])
        for dest in FLAGS:
            if getattr(ours, dest) is not None or not hasattr(args, dest):
                setattr(args, dest, getattr(ours, dest))
    return args


@contextlib.contextmanager
def megatron_lm_hooks():
    """Within this context, Megatron-LM parses our flags and installs the dispatcher (see above)."""
    package, arguments, initialize, training = import_megatron_training()
    saved: list[tuple[object, str, object]] = []

    def patch(module, name, wrap):
        if hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrap(getattr(module, name)))

    try:
        for module in (arguments, initialize):
            patch(module, "parse_args", _with_our_provider)
        if hasattr(arguments, "parse_and_validate_args"):        # core_v0.18 and later
            patch(arguments, "parse_and_validate_args", lambda fn: _install_after(fn, lambda args: args))
        elif hasattr(training, "initialize_megatron"):          # core_v0.17 and earlier
            for module in (training, initialize, package):
                patch(module, "initialize_megatron", lambda fn: _install_after(fn, lambda _: package.get_args()))
        else:
            raise LaunchError("megatron.training has neither arguments.parse_and_validate_args nor "
                              "training.initialize_megatron: unsupported Megatron-LM version; use the patches in "
                              "patches/megatron-lm/")
        checkpointing = sys.modules.get("megatron.training.checkpointing")  # training imported it
        for module in (training, checkpointing):
            if module is not None:
                patch(module, "save_checkpoint", _flush_traces_after)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def run_script(script, argv) -> None:
    """Run Megatron-LM's `script` as `python script argv...` would, with the hooks in place."""
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"{script}: no such file (give the path to Megatron-LM's pretrain_gpt.py)")
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [str(path), *argv]
    script_dir = str(path.resolve().parent)
    if sys.flags.safe_path:  # `python -P SCRIPT` adds no directory (megatron_rails.launch.checkout_first)
        script_dir = None
    elif sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    try:
        with megatron_lm_hooks():
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path and sys.path[0] == script_dir:
            sys.path[0] = saved_path0
