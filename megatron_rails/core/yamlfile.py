"""Reading a YAML config file (run, policy or topology) so that whatever the file holds, the caller
gets its data or one `error(message)` naming the file: not a file, not UTF-8 text, not YAML, nested
too deeply, a key given twice in one mapping (PyYAML keeps the last silently: `policy: fsep` then
`policy: eplb` would run eplb), empty, or not a mapping at the top level."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from .errors import check_file

MAX_BYTES = 1 << 20  # configs are a few KB; beyond, a wrong file (a checkpoint, a log)


@functools.cache
def _loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader refusing a key written twice in one mapping. Keys a merge (`<<: *base`) brings
        in may be overridden, as YAML intends: only the mapping's own keys are compared."""

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
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

    return UniqueKeyLoader


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
        data = yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as err:  # where, in the file's own lines (the text has no file name)
        mark = err.problem_mark or err.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        what = " ".join(str(err.problem or err.context or type(err).__name__).split())
        raise error(f"{p}: not valid YAML: {what}{where}") from None
    except yaml.YAMLError as err:
        raise error(f"{p}: not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise error(f"{p}: nested too deeply to be a config") from None
    if data is None:  # an empty file is a mistake, not "all defaults": the same error everywhere
        raise error(f"{p}: the file is empty; {empty_hint}")
    if not isinstance(data, dict):
        raise error(f"{p}: expected a mapping of keys to values at the top level")
    return data
