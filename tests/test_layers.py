"""The package's layers only point down, and no module imports itself back through others.

Read from the source (every import statement, module-level or inside a function), not from what
happens to be imported at run time, so a function-level import cannot hide a cycle or an upward
edge. The layers (docs/architecture.md):

    6  cli, launch, pretrain, the package root (its install/uninstall forward to the adapter)
    5  bench, demo, reliability   (siblings: none imports another)
    4  sim       the what-if simulators (iteration time, rails)
    3  config
    2  megatron      the adapter: the only package importing megatron.*
    1  runtime       torch and torch.distributed (triton, optional, for a CUDA kernel), no megatron
    0  core          numpy (pulp, highspy and yaml where a file is read), no torch
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_rails"
LAYER = {"core": 0, "runtime": 1, "megatron": 2, "config": 3, "sim": 4, "bench": 5, "demo": 5, "reliability": 5,
         "cli": 6, "launch": 6, "pretrain": 6, "": 6}
SIBLINGS = 5  # the layer whose packages must not import each other
# third-party packages a layer may import (the standard library is always allowed)
THIRD_PARTY = {0: {"numpy", "yaml", "pulp", "highspy"}, 1: {"numpy", "torch", "triton"}}
STDLIB = {"__future__", "argparse", "ast", "bisect", "collections", "contextlib", "copy", "dataclasses", "difflib",
          "enum", "fractions", "functools", "hashlib", "heapq", "importlib", "inspect", "itertools", "json", "math", "os",
          "pathlib", "platform", "random", "re", "resource", "runpy", "shlex", "shutil", "signal", "statistics",
          "subprocess", "sys", "tempfile", "textwrap", "threading", "time", "types", "typing", "warnings",
          "weakref", "io", "reprlib", "zipfile", "struct", "traceback", "socket", "string", "errno", "atexit", "queue", "glob"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _imports(mod: str) -> tuple[set[str], set[str]]:
    """(package modules, third-party top-level names) that `mod` imports anywhere in its source."""
    tree = ast.parse(MODULES[mod].read_text())
    inner, outer = set(), set()
    base = mod.split(".") if mod else []
    if not _is_package(mod):
        base = base[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "megatron_rails" or a.name.startswith("megatron_rails."):
                    inner.add(_known(a.name[len("megatron_rails."):] if "." in a.name else ""))
                else:
                    outer.add(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(up + ([node.module] if node.module else []))
            elif node.module == "megatron_rails" or (node.module or "").startswith("megatron_rails."):
                target = node.module[len("megatron_rails."):] if "." in node.module else ""
            else:
                outer.add(node.module.split(".")[0])
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}" if target else a.name
                inner.add(sub if sub in MODULES else _known(target))
    inner.discard(mod)
    return inner, outer


def _known(name: str) -> str:
    if (PKG.joinpath(*name.split(".")).with_suffix(".c")).is_file():
        return name  # a compiled extension: a leaf
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _layer_name(mod: str) -> str:
    return mod.split(".")[0] if mod.split(".")[0] in LAYER else ""


def _layer(mod: str) -> int:
    return LAYER[_layer_name(mod)]


GRAPH = {m: _imports(m) for m in MODULES}
for _t in {t for inner, _ in list(GRAPH.values()) for t in inner} - set(GRAPH):
    GRAPH[_t] = (set(), set())  # compiled extensions: leaves of the graph


def test_every_module_has_a_layer():
    unplaced = [m for m in GRAPH if m and m.split(".")[0] not in LAYER]
    assert not unplaced, f"modules outside the known layers: {unplaced}"


def test_dependencies_point_down():
    up = [(m, t) for m, (inner, _) in GRAPH.items() for t in inner
          if _layer(t) > _layer(m) and not (m == "" and t.startswith("megatron."))]
    sideways = [(m, t) for m, (inner, _) in GRAPH.items() for t in inner
                if _layer(m) == SIBLINGS and _layer(t) == SIBLINGS and _layer_name(t) != _layer_name(m)]
    assert not up, "imports that point up a layer: " + ", ".join(f"{m} -> {t}" for m, t in up)
    assert not sideways, "tools importing sibling tools: " + ", ".join(f"{m} -> {t}" for m, t in sideways)


def test_no_import_cycles():
    """Depth-first search over module edges (a package's __init__ re-exporting its own submodules
    is not a cycle: the submodules must not import the package back)."""
    color, stack, cycles = {}, [], []

    def visit(m):
        color[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m][0]):
            if color.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in color:
                visit(t)
        stack.pop()
        color[m] = 2

    for m in sorted(GRAPH):
        if m not in color:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("layer", [0, 1])
def test_lower_layers_use_only_their_libraries(layer):
    bad = {m: sorted(o - STDLIB - THIRD_PARTY[layer]) for m, (_, o) in GRAPH.items()
           if m and _layer(m) == layer and o - STDLIB - THIRD_PARTY[layer]}
    assert not bad, f"layer {layer} imports outside its libraries: {bad}"


def test_only_the_adapter_imports_megatron():
    users = sorted(m for m, (_, o) in GRAPH.items() if "megatron" in o and _layer_name(m) != "megatron")
    assert not users, f"modules importing megatron.* outside megatron_rails/megatron: {users}"


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    """The graph reader resolves relative imports (the ones the package uses) to the right module."""
    assert "core.plan" in GRAPH["core.route"][0] or "core.route" in GRAPH["core.plan"][0]
    assert "runtime.layer" in GRAPH["megatron.dispatcher"][0]
    assert "runtime.comm.direct" in GRAPH["runtime.comm"][0]
    assert "torch" in GRAPH["runtime.local"][1] and "megatron" in GRAPH["megatron.dispatcher"][1]
