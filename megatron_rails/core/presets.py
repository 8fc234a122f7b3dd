"""The shipped presets: policy and topology YAMLs, package data under megatron_rails/presets/
(the repository's configs/policies and configs/topology point there), so an installed package
finds `balancer: default` and `topology: dgx-h100` wherever it runs."""
from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
POLICY_DIR = PRESETS_DIR / "policies"
TOPOLOGY_DIR = PRESETS_DIR / "topology"


def names(preset_dir: Path) -> list[str]:
    """The preset names in `preset_dir` (file stems), sorted."""
    return sorted(p.stem for p in preset_dir.glob("*.yaml"))


def find(preset_dir: Path, name: str) -> Path | None:
    """The preset file for `name` (no suffix), or None."""
    p = preset_dir / f"{name}.yaml"
    return p if "/" not in name and p.is_file() else None


def meant(preset_dir: Path, ref) -> Path | None:
    """The preset `ref` names, or None where it is a path: a bare name without suffix that names a
    preset means it unless a regular file of that name is there (then the file is read); a directory
    of that name, as a run directory called `default` would be, never hides a preset."""
    p = Path(ref)
    return None if p.suffix or p.is_file() else find(preset_dir, str(ref))
