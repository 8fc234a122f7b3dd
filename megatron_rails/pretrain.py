"""A run config as a Megatron-LM run: `python -m megatron_rails.launch pretrain_gpt.py FLAGS` built from it.

    torchrun ... -m megatron_rails.pretrain --run-config configs/mixtral/mixtral-8x7b.yaml \\
        [KEY=VALUE ...] [-- EXTRA MEGATRON FLAGS]
    python -m megatron_rails.pretrain --run-config FILE.yaml --print-args    # the command, nothing run

The model/parallelism/training/data sections become pretrain_gpt.py flags (RunConfig.megatron_args);
flags after `--` are appended (Megatron's parser keeps the last value of a repeated flag). The resolved
balancer is written as a policy YAML named by its content (under $RUN_DIR, else a directory of the
user's in the temp directory) and passed as `--rails-config`, so megatron_rails.launch installs it once
Megatron has validated its arguments and checks it against them; `balancer: null` passes none and
Megatron stays stock. The Megatron-LM checkout (the directory holding pretrain_gpt.py) comes from
--megatron-lm or MEGATRON_LM_DIR.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
from pathlib import Path


def balancer_file(balancer) -> str:
    """The resolved PolicyConfig as a YAML file for --rails-config, named by its content, under $RUN_DIR,
    else a directory of this user's in the temp directory (a name others can predict must not be in a
    directory they can write). Every process of a run, and every --print-args of the same config, passes
    the same file: written once (to a new temporary name, renamed over a link rather than through it),
    left alone where it already holds this content, as it does for a run's other ranks."""
    import hashlib

    import yaml

    text = "# resolved from the run config by megatron_rails.pretrain\n" + \
        yaml.safe_dump(dataclasses.asdict(balancer), sort_keys=False)
    where = Path(os.environ["RUN_DIR"]) if os.environ.get("RUN_DIR") else _private_temp_dir()
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"balancer-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    if not path.is_symlink() and path.is_file() and path.read_text(errors="replace") == text:
        return str(path)
    tmp = where / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(path)


def _private_temp_dir() -> Path:
    """TMPDIR/megatron-rails-UID, made 0700 where missing; refused unless a directory of this user's."""
    import stat

    d = Path(tempfile.gettempdir()) / f"megatron-rails-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{d} is not a directory of this user's; set RUN_DIR")
    return d


def launch_argv(rc, script: str, extra=()) -> list[str]:
    """The arguments of `python -m megatron_rails.launch` for run config `rc`."""
    rails = ["--rails-config", balancer_file(rc.balancer)] if rc.balancer is not None else []
    return [script, *rc.megatron_args(), *rails, *extra]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m megatron_rails.pretrain", description=__doc__.splitlines()[0])
    ap.add_argument("--run-config", required=True, help="run config YAML")
    ap.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_DIR"),
                    help="Megatron-LM checkout holding pretrain_gpt.py (default: $MEGATRON_LM_DIR)")
    ap.add_argument("--print-args", action="store_true", help="print the command and exit")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    from .cli.args import error_text
    from .config.run import load_run_config
    from .core.errors import reason
    from .core.policy import ConfigError

    def fail(msg: str) -> int:
        print(error_text("megatron_rails.pretrain", msg), file=sys.stderr)
        return 2

    try:
        rc = load_run_config(args.run_config, args.overrides)
    except ConfigError as err:
        return fail(str(err))
    if rc.parallelism.backend != "nccl":
        return fail(f"{args.run_config}: parallelism.backend is {rc.parallelism.backend}; CPU (gloo) run configs "
                    "run with megatron_rails.demo.train")
    script = str(Path(args.megatron_lm or "Megatron-LM") / "pretrain_gpt.py")
    world = os.environ.get("WORLD_SIZE")
    if not args.print_args and world is not None:
        if not (world.strip().isascii() and world.strip().isdigit()):
            return fail(f"WORLD_SIZE={world!r} is not a rank count (torchrun sets it; unset it or fix it)")
        if int(world) != rc.world_size:
            return fail(f"{args.run_config}: the run config is for {rc.world_size} ranks (parallelism.nodes x "
                        f"topology.gpus_per_node), torchrun started {world}")
    if not args.print_args and not Path(script).is_file():
        return fail(f"{script} not found: pass --megatron-lm DIR or set MEGATRON_LM_DIR to a Megatron-LM checkout")
    try:
        launch_args = launch_argv(rc, script, extra)
    except OSError as err:  # RUN_DIR a file, unwritable, ...
        where = f"RUN_DIR={os.environ['RUN_DIR']}" if os.environ.get("RUN_DIR") else "the temp directory"
        return fail(f"cannot write the balancer's policy file under {where}: {reason(err)}")
    if args.print_args:
        print(shlex.join(["python", "-m", "megatron_rails.launch", *launch_args]))
        return 0
    from .launch import main as launch

    return launch(launch_args)


if __name__ == "__main__":
    raise SystemExit(main())
