"""`specheads gen`: the YAML config plus flag overrides, parsed by jsonargparse into `GenConfig`."""

from __future__ import annotations

from dataclasses import fields

from jsonargparse import ActionConfigFile, ArgumentParser

from data_gen.config import GenConfig
from specheads.errors import UsageError


def build_parser() -> ArgumentParser:
    """The parser: `--config FILE` then any field of `GenConfig` (`--num_prompts`, `--sampling.temperature`...)."""
    parser = ArgumentParser(prog="specheads gen", description="Label token mixes from a draft/target pair.",
                            exit_on_error=False, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (configs/gen/*.yaml)")
    parser.add_class_arguments(GenConfig, None, as_group=False)
    return parser


SHORTHANDS = {f"--{name}": f"--sampling.{name}" for name in ("max_new_tokens", "temperature", "top_k", "top_p")}


SWITCHES = {f"--{f.name}" for f in fields(GenConfig) if f.type in ("bool", bool)}


def normalise_flags(argv: list[str]) -> list[str]:
    """Accept `--num-prompts` for `--num_prompts`, `--max-new-tokens` for `--sampling.max_new_tokens`,
    and a bare switch (`--overwrite`) for `--overwrite true`."""
    normalised = []
    for position, arg in enumerate(argv):
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            name = "--" + name[2:].replace("-", "_")
            arg = SHORTHANDS.get(name, name) + sep + value
            following = argv[position + 1] if position + 1 < len(argv) else "--"
            if name in SWITCHES and not sep and following.startswith("--"):
                normalised += [arg, "true"]
                continue
        normalised.append(arg)
    return normalised


def parse_config(argv: list[str]) -> GenConfig:
    """Parse flags (and the YAML they name) into a `GenConfig`; bad values become a one-line UsageError."""
    parser = build_parser()
    try:
        namespace = parser.parse_args(normalise_flags(argv))
    except Exception as error:  # jsonargparse raises ArgumentError and friends
        raise UsageError(" ".join(str(error).split())[:400] + "; see `specheads gen --help`") from error
    namespace.pop("config", None)
    instantiated = parser.instantiate(namespace)
    return GenConfig(**{f.name: getattr(instantiated, f.name) for f in fields(GenConfig)})


def main(argv: list[str]) -> int:
    """Entry point for `specheads gen`."""
    from data_gen.run import run

    config = parse_config(argv)
    summary = run(config)
    if summary is not None:
        print(summary.text())
    return 0
