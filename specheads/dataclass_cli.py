"""Parse a config dataclass from a YAML file plus flags with jsonargparse (`gen`, `eval` and `export` use it).

Flags accept dashes or underscores (`--num-prompts` = `--num_prompts`), a bare boolean switch means
true (`--overwrite`), and a parse error becomes one UsageError line naming the problem.
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields
from typing import Any, TypeVar

from jsonargparse import ActionConfigFile, ArgumentParser

from specheads.errors import UsageError

Config = TypeVar("Config")


def build_parser(cls: type, prog: str, description: str) -> ArgumentParser:
    """`--config FILE` then every field of the dataclass `cls` (nested ones dotted: `--sampling.temperature`)."""
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config")
    parser.add_class_arguments(cls, None, as_group=False)
    return parser


def normalise_flags(argv: list[str], switches: set[str], shorthands: dict[str, str] | None = None) -> list[str]:
    """Dashes to underscores in flag names, `shorthands` expanded, and a bare switch given the value true."""
    normalised = []
    for position, arg in enumerate(argv):
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            name = "--" + name[2:].replace("-", "_")
            arg = (shorthands or {}).get(name, name) + sep + value
            following = argv[position + 1] if position + 1 < len(argv) else "--"
            if name in switches and not sep and following.startswith("--"):
                normalised += [arg, "true"]
                continue
        normalised.append(arg)
    return normalised


def parse_error_line(message: str) -> str:
    """jsonargparse's error in one short line: a value outside a constrained type's range is said plainly."""
    text = " ".join(message.split())
    key = re.search(r'Parser key "([^"]+)"', text)
    restriction = re.search(r"Not of type (\w+): (.*?) ?does not conform to restriction (.+?)(?: - |$)", text)
    if key and restriction:
        given = re.search(r"Given value: (.+)$", text)
        value = restriction.group(2) or (given.group(1) if given else "the value")
        return f"--{key.group(1)}: {value} is not a {restriction.group(1)} ({restriction.group(3).strip()})"
    return text[:400]


def parse_script(cls: type[Config], prog: str, description: str, argv: list[str] | None = None) -> Config:
    """`parse_dataclass` for a script's own `main` (the benchmarks): a bad flag ends the process in one line."""
    try:
        return parse_dataclass(cls, sys.argv[1:] if argv is None else argv, prog, description)
    except UsageError as error:
        raise SystemExit(f"{prog}: error: {error}") from None


def parse_dataclass(cls: type[Config], argv: list[str], prog: str, description: str,
                    shorthands: dict[str, str] | None = None) -> Config:
    """The dataclass `cls` from flags (and the YAML they name); bad values become a one-line UsageError."""
    parser = build_parser(cls, prog, description)
    switches = {f"--{f.name}" for f in fields(cls) if f.type in ("bool", bool)}
    try:
        namespace = parser.parse_args(normalise_flags(argv, switches, shorthands))
    except Exception as error:  # jsonargparse raises ArgumentError and friends
        raise UsageError(parse_error_line(str(error)) + f"; see `{prog} --help`") from error
    namespace.pop("config", None)
    instantiated: Any = parser.instantiate(namespace)
    return cls(**{f.name: getattr(instantiated, f.name) for f in fields(cls)})
