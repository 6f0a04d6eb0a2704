"""The YAML configs that ship with specheads (package data `specheads.configs`), found by path or by name.

`--config configs/gen/smollm2-demo.yaml` names a file; outside a source checkout the same path, or just
`--config smollm2-demo`, finds the copy installed with the package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from specheads.errors import UsageError

SUFFIXES = (".yaml", ".yml")


def packaged_configs() -> Path:
    """The folder of the configs installed with specheads (the repository's configs/ in an editable install)."""
    return Path(str(files("specheads.configs")))


def resolve_config(value: str, kind: str) -> str:
    """A `--config` value as a file path: an existing file as given; else, among the packaged configs, `value` as a
    path under configs/ (`configs/gen/x.yaml`, `gen/x.yaml`) or a name of `kind`'s configs (`x`, `x.yaml`)."""
    if Path(value).is_file():
        return value
    root = packaged_configs()
    name = value if value.endswith(SUFFIXES) else f"{value}.yaml"
    relative = name[len("configs/"):] if name.startswith("configs/") else name
    for candidate in (root / relative, root / kind / name):
        if candidate.is_file():
            return str(candidate)
    known = sorted(path.stem for path in (root / kind).glob("*.yaml")) if (root / kind).is_dir() else []
    raise UsageError(f"no config {value!r}: it is not a file, nor one of the {kind} configs that ship with specheads"
                     + (f" ({', '.join(known)})" if known else "") + "; give a path to a YAML file or one of those names")


def with_configs_resolved(argv: list[str], kind: str) -> list[str]:
    """`argv` with the value of every `--config` (or `--config=`) resolved by `resolve_config`."""
    resolved = list(argv)
    for position, arg in enumerate(argv):
        if arg == "--config" and position + 1 < len(argv):
            resolved[position + 1] = resolve_config(argv[position + 1], kind)
        elif arg.startswith("--config="):
            resolved[position] = "--config=" + resolve_config(arg.split("=", 1)[1], kind)
    return resolved
