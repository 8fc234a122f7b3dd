"""`megatron-rails config validate | show | docs`: check, print and document config files.

    megatron-rails config validate configs/**/*.yaml          # OK per file; every error, exit 1
    megatron-rails config show configs/mini/mini-mixtral.yaml balancer.policy=ultraep training.train_iters=10
    megatron-rails config show FILE --get parallelism.backend   # one value (the Slurm launcher uses it)
    megatron-rails config show FILE --megatron-args             # pretrain_gpt.py flags, as shell lines
    megatron-rails config docs --out docs/configuration.md      # regenerate the reference
"""
from __future__ import annotations

import dataclasses
import shlex
import textwrap
import sys

from .args import error_text, escaped, out_file

WIDTH = 80  # the widest line normal output prints


def preset_list() -> str:
    """'policies: default, eplb, ...; topologies: cpu-2x2, ...': every shipped preset, for help texts."""
    from ..core import presets

    return (f"policies: {', '.join(presets.names(presets.POLICY_DIR))}; "
            f"topologies: {', '.join(presets.names(presets.TOPOLOGY_DIR))}")


def override_help(example: str) -> str:
    """Help of run-config KEY=VALUE overrides; `balancer=` and `topology=` take a preset name or a file."""
    return (f"run-config overrides KEY=VALUE, e.g. {example}; balancer=NAME and topology=NAME take a preset "
            f"({preset_list()}) or a YAML path")


def resolve_file(path: str) -> str:
    """`path`, or the shipped preset file of that name (a policy or topology preset given without a
    suffix where no such file exists), so `config show dgx-h100` works as `topology: dgx-h100` does."""
    from pathlib import Path

    from ..core import presets

    for d in (presets.POLICY_DIR, presets.TOPOLOGY_DIR):
        found = presets.meant(d, path)
        if found is not None:
            return str(found)
    if Path(path).suffix or Path(path).exists():
        return path
    from ..core.policy import ConfigError

    raise ConfigError(f"{path}: file not found, and no preset has that name ({preset_list()})")


def _as_dict(obj) -> dict:
    return obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj)


def _kind(obj) -> str:
    return {"RunConfig": "run", "PolicyConfig": "policy", "Topology": "topology"}[type(obj).__name__]


def _summary(obj) -> str:
    kind = _kind(obj)
    if kind == "run":
        m, p = obj.model, obj.parallelism
        bal = obj.balancer.policy if obj.balancer else "none (stock Megatron-Core)"
        return (f"run: {m.num_layers} layers, {m.num_experts} experts top-{m.moe_router_topk}, world {p.world_size} "
                f"= {p.nodes} x {obj.topology.gpus_per_node} ({obj.topology.name}), TP{p.tensor_model_parallel_size} "
                f"PP{p.pipeline_model_parallel_size} EP{p.expert_model_parallel_size}, balancer {bal}")
    if kind == "policy":
        return f"policy: {obj.policy}, slots {obj.slots}"
    return f"topology: {obj.gpus_per_node} GPUs x {obj.rails_per_node} rails per node"


def _after(lead: str, text: str, indent: str) -> str:
    """`lead` (a path: never broken, so the line can be searched for it whole), then `text`
    wrapped at WIDTH columns, its further lines indented by `indent`."""
    if not text.strip():
        return lead
    kw = dict(subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    if len(lead) + 1 + len(text.split(" ", 1)[0]) > WIDTH:  # a long path: the text below it
        return lead + "\n" + textwrap.fill(text, WIDTH, initial_indent=indent, **kw)
    return textwrap.fill(text, WIDTH, initial_indent=lead + " ", **kw)


def _load(path: str, overrides=()):
    """load_any of a file or preset name; messages call a preset by its name, not its package path."""
    from ..config.run import load_any

    found = resolve_file(path)
    return load_any(found, overrides, name=path if found != path else None)


def cmd_validate(args) -> int:
    from ..core.policy import ConfigError

    failed = 0
    prog = getattr(args, "command_prog", "megatron-rails config validate")
    for path in args.files:
        try:
            obj = _load(path)
        except (ConfigError, OSError) as err:  # OSError: a name no file can have (too long)
            failed += 1
            if isinstance(err, OSError):
                err = ConfigError(f"{path}: {err.strerror or err}")
            # a path with a newline in it cannot split a line
            text = escaped("\n".join(getattr(err, "errors", None) or [str(err)]), [path])
            for line in text.splitlines():
                print(error_text(prog, line), file=sys.stderr)
            continue
        print(_after(f"OK {escaped(path, [path])}", f"({_summary(obj)})", "  "))
    if failed:
        print(f"{failed} of {len(args.files)} file(s) invalid", file=sys.stderr)
    return 1 if failed else 0


def _get(data: dict, dotted: str):
    from ..config.schema import suggest
    from ..core.policy import ConfigError

    if not dotted.strip():
        raise ConfigError("--get: an empty key; give a dotted key of the config, e.g. parallelism.backend")
    node, seen = data, []
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            hint = suggest(part, node, "".join(f"{k}." for k in seen)) if isinstance(node, dict) else \
                f"; {'.'.join(seen)} is null, not a section" if node is None else \
                f"; {'.'.join(seen)} is a value, not a section"
            raise ConfigError(f"--get {dotted}: no such key in the resolved config{hint}")
        node = node[part]
        seen.append(part)
    return node


def shell_lines(words: list[str], width: int = WIDTH) -> str:
    """`words` (flags, each followed by its values) as shell text to paste after a command: each flag
    with its values on one line where they fit, lines packed to `width` columns and continued with
    ` \\`; one flag with a longer value gets a line of its own, however long."""
    groups: list[list[str]] = []
    for w in words:
        if w.startswith("--") or not groups:
            groups.append([])
        groups[-1].append(w)
    lines: list[str] = []
    for g in (shlex.join(g) for g in groups):
        if lines and len(lines[-1]) + 1 + len(g) + 2 <= width:  # 2: the " \\" that ends the line
            lines[-1] += " " + g
        else:  # continuation lines indented, as a pasted command shows them
            lines.append(("  " if lines else "") + g)
    return " \\\n".join(lines)


def cmd_show(args) -> int:
    import yaml

    if args.megatron_args and args.get:
        from ..core.policy import ConfigError

        raise ConfigError("--get and --megatron-args print different things: give one of them")
    obj = _load(args.file, args.overrides)
    data = _as_dict(obj)
    if args.megatron_args:
        if _kind(obj) != "run":
            from ..core.policy import ConfigError

            raise ConfigError(f"{args.file}: --megatron-args needs a run config, this is a {_kind(obj)} config")
        words = obj.megatron_args()
        # on a terminal, lines to read and paste; into a pipe or $(...), one line: a shell splits
        # command substitution on blanks and would pass the continuations' backslashes on as words
        print(shell_lines(words) if sys.stdout.isatty() else shlex.join(words))
        return 0
    if args.get:
        values = [_get(data, key) for key in args.get]  # every key found before any is printed
        for v in values:
            print(yaml.safe_dump(v, sort_keys=False).strip() if isinstance(v, (dict, list)) else
                  ("null" if v is None else str(v).lower() if isinstance(v, bool) else v))
        return 0
    print(_after(f"# {args.file}", f"({_kind(obj)} config, validated"
                 f"{', with ' + ' '.join(args.overrides) if args.overrides else ''})", "#   "))
    # yaml breaks long strings at the first space past `width`: leave room for the indent and the word
    print(yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=WIDTH - 20), end="")
    return 0


def cmd_docs(args) -> int:
    from ..config.docs import generate

    text = generate()
    if args.out:
        from ..core.outfile import write_text

        write_text(args.out, text)
    else:
        print(text, end="")
    return 0


def register(sub) -> None:
    """Add the `config` command to the top-level subparsers."""
    c = sub.add_parser("config", help="validate, show or document run/policy/topology YAML configs")
    csub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    v = csub.add_parser("validate", help="check files; prints OK per file, or every error naming file and key "
                                         "(exit 1 if any file is invalid)")
    v.add_argument("files", nargs="+", metavar="FILE",
                   help=f"run, policy or topology YAML files, or preset names ({preset_list()})")
    v.set_defaults(func=cmd_validate)
    s = csub.add_parser("show", help="print the merged, validated config as YAML")
    s.add_argument("file", metavar="FILE",
                   help=f"a run, policy or topology YAML file, or a preset name ({preset_list()})")
    s.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help=override_help("balancer.policy=ultraep") + " (a policy or topology file: its own keys, "
                        "e.g. slots=2)")
    s.add_argument("--get", action="append", metavar="KEY",
                   help="print only this dotted key (repeatable; default: the whole config)")
    s.add_argument("--megatron-args", action="store_true",
                   help="print the Megatron-LM flags of a run config: on a terminal as lines continued "
                        "with \\ (paste after pretrain_gpt.py \\), else one line (for $(...))")
    s.set_defaults(func=cmd_show)
    d = csub.add_parser("docs", help="print (or --out) docs/configuration.md, generated from the dataclasses")
    d.add_argument("--out", type=out_file("--out"), help="write here instead of stdout (default: stdout)")
    d.set_defaults(func=cmd_docs)
