"""Run Megatron-LM's own training script with megatron-rails, without forking or patching it:

    python -m megatron_rails.launch PATH/TO/pretrain_gpt.py [Megatron-LM args...] --moe-balancer ultraep
    torchrun --nproc-per-node 8 -m megatron_rails.launch PATH/TO/pretrain_gpt.py ...

The script runs as `python PATH/TO/pretrain_gpt.py ...` would, with the megatron-rails flags added to
Megatron's parser and the dispatcher installed once Megatron has validated its arguments
(megatron_rails/megatron/launch_hooks.py knows where, per Megatron-LM version).
"""
from __future__ import annotations

import sys

USAGE = """usage: python -m megatron_rails.launch SCRIPT [ARGS...]
  SCRIPT  Megatron-LM's pretrain_gpt.py (or another script built on megatron.training)
  ARGS    Megatron-LM's arguments plus --moe-balancer, --moe-balancer-slots, --moe-rails-comm and
          --rails-config (listed by `SCRIPT --help` under "megatron-rails"; docs/megatron-lm.md)
megatron.training comes from a Megatron-LM checkout: the script's directory, PYTHONPATH or MEGATRON_LM_DIR."""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from .core.policy import ConfigError
    from .megatron.launch_hooks import LaunchError, run_script

    try:
        run_script(argv[0], argv[1:])
    except (LaunchError, ConfigError) as err:
        print(f"megatron_rails.launch: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
