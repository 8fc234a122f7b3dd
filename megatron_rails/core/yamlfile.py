"""Reading a YAML config file (run, policy or topology) so that whatever the file holds, the caller
gets its data or one `error(message)` naming the file: not a file, not UTF-8 text, not YAML, nested
too deeply, a key given twice in one mapping (PyYAML keeps the last silently: `policy: fsep` then
`policy: eplb` would run eplb), a key that is not a string (`1: 2`, `true: x`: no config has such a
name, and the code that reports unknown keys expects names), aliases expanding to more values than
any config holds (a "billion laughs" file), empty, or not a mapping at the top level."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from .errors import check_file, cut

MAX_BYTES = 1 << 20  # configs are a few KB; beyond, a wrong file (a checkpoint, a log)
# values (scalars, lists, mappings) a document may hold with its aliases expanded: a run config
# holds a few hundred; PyYAML shares an alias's value, but whatever walks or prints it does not
MAX_VALUES = 10_000
STR, MERGE = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"
# what a key of each YAML type is, in words (for "key 1 (an integer) is not a name")
KEY_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "null": "YAML's null",
             "timestamp": "a date", "seq": "a list", "map": "a mapping", "binary": "binary data"}


class YamlShapeError(ValueError):
    """YAML that parses but cannot be a config's data; the message names the key path, not the file."""


@functools.cache
def _loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader refusing a key written twice in one mapping. Keys a merge (`<<: *base`) brings
        in may be overridden, as YAML intends: only the mapping's own keys are compared."""

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    continue  # SafeLoader itself reports an unhashable key
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (first on line {seen[key] + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    _yaml12_scalars(UniqueKeyLoader)
    return UniqueKeyLoader


BOOL, INT, FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def _yaml12_scalars(loader) -> None:
    """Booleans and numbers read strictly, as a user means them, not as YAML 1.1 (PyYAML) does: `yes`,
    `no`, `on`, `off` stay text and only true/false are booleans; an integer is decimal digits
    (`010` is ten, not 1.1's octal eight), and `0x10`, `0o10`, `0b101`, `1_000` and `2:00` (1.1: 16,
    8, 5, 1000 and sexagesimal 120) stay text; a number is YAML 1.2's (`0.5`, `1e-3`, `.inf`; not
    `1_0.5` or `1:30.5`). A config that says `slots: 0x10` is then refused as not an integer, never
    read silently as another number. (An explicit tag, `!!int 0x10`, is the file's own choice and
    read as tagged.)"""
    import re

    import yaml

    loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (BOOL, INT, FLOAT)]
        for first, resolvers in loader.yaml_implicit_resolvers.items()}
    # INT first: a scalar both match (`12`) is the integer
    loader.add_implicit_resolver(INT, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    loader.add_implicit_resolver(FLOAT, re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
    loader.add_implicit_resolver(BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))

    def construct_int(self, node):
        text = self.construct_scalar(node)
        try:  # an explicit !!int may hold anything
            return int(text, 0) if re.match(r"^[-+]?0[box]", text) else int(text, 10)
        except ValueError:
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer",
                                                    node.start_mark) from None

    loader.add_constructor(INT, construct_int)


def _where(path: list) -> str:
    """'balancer.slots: ', 'layers[2]: ' or '' (the top level), to prefix a message."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return f"{text}: " if text else ""


def _key_problem(key, path: list) -> str:
    """'' for a string key (or a merge); else why this key cannot be a config key, where it is."""
    if key.tag in (STR, MERGE):
        return ""
    kind = KEY_KINDS.get(key.tag.rsplit(":", 1)[-1], key.tag)
    text = key.value if isinstance(key.value, str) else ("[...]" if kind == "a list" else "{...}")
    text = cut(text, 40)
    return (f"{_where(path)}{f'key {text}' if text else 'an empty key'} ({kind}, line {key.start_mark.line + 1}) "
            "is not a name; keys are strings")


def check_nodes(root) -> None:
    """YamlShapeError for a mapping key that is not a string (at any depth) or aliases expanding past
    MAX_VALUES values or into themselves. Walks the composed node graph, where an alias is the node it
    names: each node is visited once and its expanded size remembered, so a bomb costs its own size."""
    import yaml

    sizes: dict[int, int] = {}
    open_: set[int] = set()
    aliased = [False]  # a node reached twice: only aliases make the expanded size exceed the text's

    def size(node, path: list) -> int:
        if id(node) in sizes:
            aliased[0] = True
            return sizes[id(node)]
        if id(node) in open_:
            raise YamlShapeError(f"{_where(path)}an alias (*name) inside the value it names; a config holds no "
                                 "self-referencing values")
        open_.add(id(node))
        n = 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                problem = _key_problem(key, path)
                if problem:
                    raise YamlShapeError(problem)
                n += 1 + size(value, path + ([key.value] if key.tag == STR else []))
        elif isinstance(node, yaml.SequenceNode):
            n += sum(size(item, path + [i]) for i, item in enumerate(node.value))
        open_.discard(id(node))
        sizes[id(node)] = n
        if n > MAX_VALUES and aliased[0]:  # a long list written out is the file's own size: fine
            raise YamlShapeError(f"{_where(path)}aliases (*name) expand to more than {MAX_VALUES} values; no config "
                                 "holds that many: write the values out")
        return n

    size(root, [])


def parse(text: str):
    """The data of one YAML document `text`, after check_nodes; yaml.YAMLError for text that is not
    YAML, YamlShapeError for YAML no config holds, RecursionError for nesting without end."""
    loader = _loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_nodes(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_mapping(path, error: Callable[[str], Exception], kind: str, empty_hint: str) -> dict:
    """The top-level mapping of the YAML file `path`; raises error(message) for anything else.
    kind: what the file should be ("policy config", "topology"; "YAML": any config); empty_hint:
    what an empty file lacks."""
    import yaml

    if not str(path).strip():  # Path("") is ".", a directory: say what is wrong instead
        raise error(f"an empty path; give a {kind} file")
    p = Path(path)
    check_file(p, kind, error, error(f"{p}: file not found") if kind == "YAML" else None)
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise error(f"{p}: {size} bytes; a {kind} file is a small YAML file (at most {MAX_BYTES} bytes)")
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise error(f"{p}: not UTF-8 text (byte {err.start}); expected a YAML file") from None
    try:
        data = parse(text)
    except yaml.MarkedYAMLError as err:  # where, in the file's own lines (the text has no file name)
        mark = err.problem_mark or err.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        what = " ".join(str(err.problem or err.context or type(err).__name__).split())
        raise error(f"{p}: not valid YAML: {what}{where}") from None
    except yaml.YAMLError as err:
        raise error(f"{p}: not valid YAML: {' '.join(str(err).split())}") from None
    except YamlShapeError as err:
        raise error(f"{p}: {err}") from None
    except RecursionError:
        raise error(f"{p}: nested too deeply to be a config") from None
    if data is None:  # an empty file is a mistake, not "all defaults": the same error everywhere
        raise error(f"{p}: the file is empty; {empty_hint}")
    if not isinstance(data, dict):
        raise error(f"{p}: expected a mapping of keys to values at the top level")
    return data
