"""The YAML configs that ship with specheads (package data `specheads.configs`), found by path or by name.

`--config configs/gen/smollm2-demo.yaml` names a file; outside a source checkout the same path, or just
`--config smollm2-demo`, finds the copy installed with the package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from specheads.plumbing.errors import UsageError

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


def refuse_empty(path: str) -> str:
    """`path`, refused when the YAML file holds no options (empty, or only blank lines, comments and document
    markers): the parsers would say only "Unexpected config"."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return path  # unreadable: the parser names the problem
    if all(not line.strip() or line.strip().startswith("#") or line.strip() in ("---", "...") for line in lines):
        raise UsageError(f"--config {path} is empty (no options, only blanks or comments); write the options in it "
                         "(see a config under configs/), or leave --config out")
    return path


def with_configs_resolved(argv: list[str], kind: str) -> list[str]:
    """`argv` with the value of every `--config` (or `--config=`) resolved by `resolve_config`, an empty file
    refused."""
    resolved = list(argv)
    for position, arg in enumerate(argv):
        if arg == "--config" and position + 1 < len(argv):
            resolved[position + 1] = refuse_empty(resolve_config(argv[position + 1], kind))
        elif arg.startswith("--config="):
            resolved[position] = "--config=" + refuse_empty(resolve_config(arg.split("=", 1)[1], kind))
    return resolved
