"""Run Megatron-LM's own training script with megatron-rails, without forking or patching it:

    python -m megatron_rails.launch PATH/TO/pretrain_gpt.py [Megatron-LM args...] --moe-balancer ultraep
    torchrun --nproc-per-node 8 -m megatron_rails.launch PATH/TO/pretrain_gpt.py ...

The script runs as `python PATH/TO/pretrain_gpt.py ...` would, with the megatron-rails flags added to
Megatron's parser and the dispatcher installed once Megatron has validated its arguments
(megatron_rails/megatron/launch_hooks.py knows where, per Megatron-LM version).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = """usage: python -m megatron_rails.launch SCRIPT [ARGS...]
  SCRIPT  Megatron-LM's pretrain_gpt.py (or another script built on
          megatron.training)
  ARGS    Megatron-LM's arguments plus --moe-balancer, --moe-balancer-slots,
          --moe-rails-comm and --rails-config (listed by `SCRIPT --help` under
          "megatron-rails"; docs/megatron-lm.md)
megatron.training comes from a Megatron-LM checkout: the script's directory,
PYTHONPATH or MEGATRON_LM_DIR."""
MAX_SCRIPT_BYTES = 16 << 20  # a file without .py beyond this is not compiled to see whether it is Python
NO_CUDA = "Megatron requires CUDA."  # initialize_megatron's assertion where torch sees no GPU (core_v0.15 .. main)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from .cli.args import error_text
    from .core.errors import reason
    from .core.policy import ConfigError

    def error(why: str) -> int:
        print(error_text("megatron_rails.launch", why), file=sys.stderr)
        return 2

    script = Path(argv[0])
    if argv[0].startswith("-"):
        return error(f"SCRIPT comes first, then its arguments (got the flag {argv[0]}); " + USAGE.splitlines()[0])
    why = not_a_script(argv[0])
    if why:
        return error(why)
    try:  # ours first: a bad flag of ours is the user's to fix whatever the environment lacks
        from .megatron.args import check_flags

        check_flags(argv[1:])
    except ConfigError as err:
        return error(str(err))
    # before anything imports megatron: the checkout's megatron.core must win over the pip package's,
    # as under `python SCRIPT` (sys.path[0] is the script's directory), else its megatron.training
    # would run against another megatron.core than it does without us
    checkout_first(script)
    try:  # the adapter imports megatron.core (and torch): the checkout's, where it has one
        from .megatron.launch_hooks import LaunchError, run_script
    except ImportError as err:
        return error(f"megatron.core is not importable ({reason(err)}): install megatron-core, or use a "
                     "Megatron-LM checkout whose megatron/core matches its megatron/training")

    try:
        run_script(argv[0], argv[1:])
    except (LaunchError, ConfigError) as err:
        return error(str(err))
    except AssertionError as err:
        if str(err) != NO_CUDA:
            raise
        # initialize_megatron's own check: the machine, not the script, is what is wrong
        return error(f"Megatron-LM's training loop needs a CUDA GPU ({NO_CUDA!r}: initialize_megatron) and "
                     "torch sees none here; `megatron-rails demo` trains with the balancer on CPU")
    return 0


def not_a_script(path: str) -> str | None:
    """Why `path` cannot be the training script (one line), or None: missing, a directory or a
    device, a config file, a file that is not Python source. A .py file's own syntax errors are
    left to Python, whose traceback points at the line."""
    from .core.errors import check_file

    try:
        check_file(path, "Python script", missing=ValueError(f"{path}: no such file (give the path to "
                                                             "Megatron-LM's pretrain_gpt.py)"))
    except ValueError as err:  # InputError is one
        return str(err)
    suffix = Path(path).suffix.lower()
    if suffix in (".yaml", ".yml", ".json"):
        return (f"{path} is a config file, not a Python script: a run config runs with `python -m "
                "megatron_rails.pretrain --run-config FILE`, a policy config with SCRIPT ... --rails-config FILE")
    if suffix != ".py":
        if Path(path).stat().st_size > MAX_SCRIPT_BYTES:  # a checkpoint or a dataset, not worth compiling
            return f"{path}: not a Python script (over {MAX_SCRIPT_BYTES >> 20} MiB)"
        try:
            compile(Path(path).read_bytes(), path, "exec")
        except (SyntaxError, ValueError) as err:  # ValueError: NUL bytes; SyntaxError: not Python, or not text
            return f"{path}: not a Python script ({type(err).__name__}: {str(err).splitlines()[0]})"
    return None


def checkout_first(script: Path) -> None:
    """sys.path as `python SCRIPT` has it, plus MEGATRON_LM_DIR (when set) right after the script's
    directory: the places megatron.training, and the megatron.core beside it, come from. Under
    `python -P` (PYTHONSAFEPATH) `python SCRIPT` adds no directory, and sys.path[0] is PYTHONPATH's."""
    safe = sys.flags.safe_path
    if not safe:
        script_dir = str(script.resolve().parent)
        if sys.path:
            sys.path[0] = script_dir
        else:
            sys.path.insert(0, script_dir)
    lm_dir = os.environ.get("MEGATRON_LM_DIR")
    if lm_dir and lm_dir not in sys.path:
        sys.path.insert(0 if safe else 1, lm_dir)


if __name__ == "__main__":
    sys.exit(main())
