"""Parse a config dataclass from a YAML file plus flags with jsonargparse (`gen`, `eval` and `export` use it).

Flags accept dashes or underscores (`--num-prompts` = `--num_prompts`) and `--help` shows the dashes, a bare
boolean switch means true (`--overwrite`), and a parse error becomes one UsageError line naming the problem.
An option's help is its field's docstring: a string right below the field, or its line under `Args:` in the
class docstring (jsonargparse reads both through docstring-parser).

jsonargparse does the parsing (`ArgumentParser.add_class_arguments`, types, ranges, YAML, nesting); what is written
here is what neither it nor its `auto_cli` does: accept `--num-prompts` for a field `num_prompts` (it registers the
field's own name only; vLLM's `FlexibleArgumentParser` does the same by hand), bare boolean switches, and one-line
errors.
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import fields
from typing import Any, TypeVar

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter, set_parsing_settings

from specheads.plumbing.errors import UsageError

Config = TypeVar("Config")


FLAG_NAME = re.compile(r"(?<![\w-])--\w[\w.]*")


def dashed(text: str) -> str:
    """Every flag name in `text` in its dash spelling: `--sampling.max_new_tokens` -> `--sampling.max-new-tokens`."""
    return FLAG_NAME.sub(lambda flag: flag.group(0).replace("_", "-"), text)


class DashedHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help with the flags of the usage line and option list in their dash spelling (`--num-prompts`),
    the one the README uses."""

    def _format_usage(self, *args: Any, **kwargs: Any) -> str:
        return dashed(super()._format_usage(*args, **kwargs))

    def _format_action_invocation(self, action: Any) -> str:
        return dashed(super()._format_action_invocation(action))

    def _split_lines(self, text: str, width: int) -> list[str]:  # never wrap inside `--max-new-tokens`
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


def spelling_note(cls: type, shorthands: dict[str, str] | None) -> str:
    """The help's closing note: both spellings (shown on one of `cls`'s fields), bare switches, and any shorthands."""
    example = next((f"--{f.name}" for f in fields(cls) if "_" in f.name), None)
    spellings = f" ({dashed(example)} = {example})" if example else ""
    note = f"Flags take dashes or underscores{spellings}; a boolean flag alone means true."
    if shorthands:
        note += " Shorthands: " + ", ".join(f"{dashed(short)} = {dashed(full)}" for short, full in shorthands.items())
    return note


def build_parser(cls: type, prog: str, description: str, shorthands: dict[str, str] | None = None) -> ArgumentParser:
    """`--config FILE` then every field of the dataclass `cls` (nested ones dotted: `--sampling.temperature`)."""
    parser = ArgumentParser(prog=prog, description=description, epilog=spelling_note(cls, shorthands), exit_on_error=False,
                            default_env=False, formatter_class=DashedHelpFormatter)
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a YAML file of these options; flags after it override its values")
    # fields' own docstrings are read for our dataclasses only: left on, they cost LightningCLI's parser a second
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        parser.add_class_arguments(cls, None, as_group=False)
    finally:
        set_parsing_settings(docstring_parse_attribute_docstrings=False)  # jsonargparse's default
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
    """jsonargparse's error in one short line, its flags in their dash spelling: a value outside a constrained type's
    range is said plainly."""
    text = " ".join(message.split())
    key = re.search(r'Parser key "([^"]+)"', text)
    restriction = re.search(r"Not of type (\w+): (.*?) ?does not conform to restriction (.+?)(?: - |$)", text)
    if key and restriction:
        given = re.search(r"Given value: (.+)$", text)
        value = restriction.group(2) or (given.group(1) if given else "the value")
        return dashed(f"--{key.group(1)}: {value} is not a {restriction.group(1)} ({restriction.group(3).strip()})")
    return dashed(re.sub(r'Parser key "([^"]+)"', r"--\1", text))[:400]


def parse_script(cls: type[Config], prog: str, description: str, argv: list[str] | None = None) -> Config:
    """`parse_dataclass` for a script's own `main` (the benchmarks), checked before the script loads anything
    (`check_script_config`): a bad flag ends the process in one line."""
    try:
        config = parse_dataclass(cls, sys.argv[1:] if argv is None else argv, prog, description)
        check_script_config(config)
        return config
    except UsageError as error:
        raise SystemExit(f"{prog}: error: {error}") from None


def check_script_config(config: Any, prefix: str = "") -> None:
    """The check every script's flags get before any model loads: no number anywhere in them (nested settings,
    lists, pairs) is NaN or infinite; then the config's own `check()`, where its class has one (a benchmark's
    rules, counts and files)."""
    import dataclasses
    import math

    def finite(value: Any, flag: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{dashed(flag)} holds {value}; give a finite number")
        if isinstance(value, (list, tuple)):
            for item in value:
                finite(item, flag)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_script_config(value, f"{flag}.")

    for item in fields(config):
        finite(getattr(config, item.name), f"--{prefix}{item.name}")
    if not prefix and callable(getattr(config, "check", None)):
        config.check()


def parse_dataclass(cls: type[Config], argv: list[str], prog: str, description: str,
                    shorthands: dict[str, str] | None = None) -> Config:
    """The dataclass `cls` from flags (and the YAML they name); bad values become a one-line UsageError."""
    parser = build_parser(cls, prog, description, shorthands)
    switches = {f"--{f.name}" for f in fields(cls) if f.type in ("bool", bool)}
    try:
        namespace = parser.parse_args(normalise_flags(argv, switches, shorthands))
    except Exception as error:  # jsonargparse raises ArgumentError and friends
        raise UsageError(parse_error_line(str(error)) + f"; see `{prog} --help`") from error
    namespace.pop("config", None)
    instantiated: Any = parser.instantiate(namespace)
    return cls(**{f.name: getattr(instantiated, f.name) for f in fields(cls)})
