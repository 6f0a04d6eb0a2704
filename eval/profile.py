"""`specheads profile --out FILE`: a draft/target pair's forward time against the tokens in the forward, measured on
the device it runs on, or modelled by a roofline preset (`--preset`), written as the cost table that
`specheads eval --serving-costs FILE` reads (`specheads.decoding.cost_table`); with `--head` the acceptance head's
forward time against the tokens it scores too, the table's `head` curve, which eval prices that head's forwards with.

It belongs to the eval stage, which prices served rounds with these curves and already measures them when no table
is given; the table's format and the presets are in the core, which eval's serving table reads them through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jsonargparse.typing import PositiveInt

from specheads.decoding.cost_table import PRESET_NAMES, PRESET_TOKENS, PRESETS, measured_table, roofline_table, write_cost_table
from specheads.decoding.costs import CURVE_TOKENS
from specheads.eval.config import named_drafter
from specheads.pair.models import ModelSpec
from specheads.plumbing.dataclass_cli import parse_dataclass
from specheads.plumbing.errors import UsageError, refuse_above
from specheads.plumbing.files import check_output_file

MAX_TOKENS = 65_536
"""The most tokens a profiled forward may hold (and requests a preset's batch): 256 requests of 256 candidates."""
PRESET_CONTEXT = 131_072
"""Positions the presets' models hold (Llama-3.1 and 3.2: 128K)."""
MAX_CONTEXT = 1_048_576
"""The most cached tokens per row a measured curve may ask for before the models are loaded (their own context,
checked once they are, is usually far less)."""
MAX_REPEATS = 1_000


def default_target() -> ModelSpec:
    return ModelSpec(path="embedded:smollm2")


def default_draft() -> ModelSpec:
    return ModelSpec(skip_layers=[20, 21])


@dataclass
class ProfileConfig:
    """What `specheads profile` measures (or models) and where it writes the cost table."""

    out: str = "runs/profile/costs.json"
    """the cost table (JSON) to write; replaced atomically when it exists."""
    target: ModelSpec = field(default_factory=default_target)
    """the target model to measure (as `specheads gen` names it)."""
    draft: ModelSpec = field(default_factory=default_draft)
    """the draft model to measure; by default the target minus layers 20-21 (self-speculative)."""
    eagle3: str | None = None
    """an EAGLE-3 drafter folder (speculators' format, e.g. `specheads train drafter`'s DIR/drafter) measured as the
    draft instead of `--draft`: its forward reads the target's fused streams, projects them, runs its decoder layer
    and its head over the draft vocabulary (needs the eagle3 extra)."""
    dspark: str | None = None
    """a DSpark drafter folder (speculators' format) measured as the draft instead of `--draft`: its forward reads
    the tokens timed as block slots over the target's streams (needs the eagle3 extra); a round runs it once, on its
    block's `block_size` tokens."""
    preset: Literal[PRESET_NAMES] | None = None
    """write a roofline preset's modelled table instead of measuring (no model is loaded): an H100 SXM with a
    Llama-3.1-8B target and Llama-3.2-1B draft, or 4 H100s with Llama-3.1-70B (tensor parallel) and Llama-3.1-8B
    (docs/decoding-core.md gives the formula and every number)."""
    device: str = "auto"
    """where the models run while measured: `auto` (the first GPU when there is one), `cpu`, `cuda`, `cuda:1`."""
    contexts: list[PositiveInt] | None = None
    """cached tokens each row of a forward attends to, one curve per context (the first is the one `--serving-costs`
    prices with); default 32 measured (as eval measures), 1024 for a preset."""
    tokens: list[PositiveInt] | None = None
    """the token counts to time (rows of one new token each); default 1, 2, 4, ... 128 measured, 1 ... 4096 for a
    preset (a curve is linear between its points and beyond the last two)."""
    repeats: PositiveInt = 3
    """timed forwards per token count; the table keeps their median."""
    head: str | None = None
    """an acceptance head (a `.ckpt`, an exported folder or Hub id, or a shipped head's name, e.g. smollm2-ontime) to
    time beside the draft: its forward against the tokens it scores, written as the table's `head` curve (eval prices
    that head's forwards with it; without one, at its share of the draft's weights times the draft's curve)."""
    batch_size: PositiveInt | None = None
    """a preset only: model forwards of a batch of this many requests, so that n tokens read min(n, batch size) rows'
    caches (a verify forward's candidates share their row's cache); default: every token a row of its own, as measured."""

    def validate(self) -> None:
        """Refuse what cannot work before any model is loaded."""
        check_output_file(Path(self.out))
        self.check_bounds()
        if self.tokens is not None and len(set(self.tokens)) < 2:
            raise UsageError(f"--tokens {self.tokens} gives fewer than two token counts; a curve needs two or more, "
                             "e.g. [1, 8, 64]")
        if self.preset and (self.target != default_target() or self.draft != default_draft()):
            raise UsageError(f"--preset {self.preset} models its own pair ({PRESETS[self.preset].description}); drop "
                             "--target/--draft, or drop --preset to measure those models")
        drafter = named_drafter(self.eagle3, self.dspark)
        if drafter and self.preset:
            raise UsageError(f"--{drafter[0]} {drafter[1]} is measured; --preset {self.preset} models its own pair: "
                             "drop one of them")
        if self.head and self.preset:
            raise UsageError(f"--head is timed beside a measured draft; --preset {self.preset} models its own pair, "
                             "whose heads eval prices by their weights: drop --head, or drop --preset to measure")
        if self.batch_size is not None and not self.preset:
            raise UsageError("--batch-size shapes a roofline preset's curve; a measured curve times n rows of one token "
                             "each: drop --batch-size, or give --preset")


    def check_bounds(self) -> None:
        """Refuse counts beyond what a forward can hold: token counts, contexts (a preset's models hold
        PRESET_CONTEXT positions), repeats and a preset's batch size."""
        limits = [("--tokens", self.tokens or [], MAX_TOKENS, "the tokens of one forward"),
                  ("--contexts", self.contexts or [], PRESET_CONTEXT - 1 if self.preset else MAX_CONTEXT,
                   "cached tokens per row" + (f", and the preset's models hold {PRESET_CONTEXT:,} positions"
                                              if self.preset else "")),
                  ("--batch-size", [self.batch_size or 0], MAX_TOKENS, "requests in one batch"),
                  ("--repeats", [self.repeats], MAX_REPEATS, "timed forwards per token count")]
        for option, values, bound, what in limits:
            refuse_above(option, values, bound, what)


def parse_config(argv: list[str]) -> ProfileConfig:
    """Flags (and an optional `--config` YAML) into a `ProfileConfig`."""
    return parse_dataclass(ProfileConfig, argv, "specheads profile",
                           "Measure the draft's and the target's forward time against the tokens in the forward on "
                           "this device (or model it with a roofline preset) and write the cost table that "
                           "`specheads eval --serving-costs` reads.")


def profile(config: ProfileConfig) -> dict:
    """Measure (or model) the pair's curves (and the head's, with `--head`) and write the table; returns it."""
    config.validate()
    head = timed_head(config.head) if config.head else None  # a bad head is refused before the models load
    tokens = tuple(sorted(set(config.tokens))) if config.tokens else None
    if config.preset:
        table = roofline_table(config.preset, config.contexts, tokens or PRESET_TOKENS, config.batch_size)
    else:
        table = measure_pair(config, tokens or CURVE_TOKENS, head)
    write_cost_table(Path(config.out), table)
    return table


def timed_head(source: str) -> tuple[str, Any]:
    """(`source`, the head) of `--head`, refused when decoding could not run it (it reads the target's state)."""
    from specheads.artifacts.checkpoint import load_trained
    from specheads.decoding.engine import check_decodable_head

    head = load_trained(source).head
    check_decodable_head(head)
    return source, head


def measure_pair(config: ProfileConfig, tokens: tuple[int, ...], head: tuple[str, Any] | None = None) -> dict:
    """Load the pair onto `config.device` and measure both models at every context (and `head`, (name, head), beside
    the draft)."""
    from specheads.eval.run import decoding_device, place
    from specheads.pair.models import context_length, load_pair

    device = decoding_device(config.device)
    if config.eagle3 or config.dspark:  # the drafter reads the target's streams: no draft model of its own is loaded
        from specheads.pair.models import load_model

        target, target_name = load_model(config.target), config.target.describe()
        draft, draft_name = feature_draft(config, target)
    else:
        pair = load_pair(config.target, config.draft)
        target, target_name, draft, draft_name = pair.target, pair.target_name, pair.draft, pair.draft_name
    contexts = list(config.contexts or [32])
    room = min(context_length(target), context_length(draft))
    if max(contexts) + 1 > room:
        raise UsageError(f"--contexts {contexts} leaves no room for a new token: the models hold {room} positions; "
                         f"give contexts below {room}")
    for model in (target, draft):
        place(model, device)
    return measured_table((draft_name, draft), (target_name, target), contexts, tokens, config.repeats, head)


def feature_draft(config: ProfileConfig, target: Any) -> tuple[Any, str]:
    """(the drafter of `--eagle3` or `--dspark` as the round engine's draft, its name in the table)."""
    from specheads.decoding.drafters import DRAFTER_KINDS, load_feature_draft

    kind = "eagle3" if config.eagle3 else "dspark"
    folder = getattr(config, kind)
    return load_feature_draft(kind, folder, target), f"{DRAFTER_KINDS[kind]} {folder}"


def main(argv: list[str]) -> int:
    """Entry point for `specheads profile`."""
    config = parse_config(argv)
    table = profile(config)
    what = f"modelled by the roofline preset {table['preset']}" if table["modelled"] else f"measured on {table['device']}"
    print(f"cost table {what}; draft {table['models']['draft']['name']}, target {table['models']['target']['name']}:")
    for entry in table["curves"]:
        draft, target = entry["draft"], entry["target"]
        print(f"  context {entry['context']}: target {target['seconds'][0] * 1e3:.3g} ms at {target['tokens'][0]} "
              f"token(s), {target['seconds'][-1] * 1e3:.3g} ms at {target['tokens'][-1]}; draft "
              f"{draft['seconds'][0] * 1e3:.3g} ms and {draft['seconds'][-1] * 1e3:.3g} ms (t_draft/t_target at 1 "
              f"token: {draft['seconds'][0] / target['seconds'][0]:.3f})")
    if "head" in table:
        head, about = table["head"], table["models"]["head"]
        print(f"  head {about['name']}: {head['seconds'][0] * 1e3:.3g} ms at {head['tokens'][0]} token(s), "
              f"{head['seconds'][-1] * 1e3:.3g} ms at {head['tokens'][-1]} (by its weights, {about['forward_cost']:.3g} "
              "of a draft forward)")
    for entry in table.get("raised", []):
        print(f"  context {entry['context']}: the {entry['model']}'s time fell at {entry['tokens']} token(s) below an "
              "earlier count's (a busy machine, or on a CPU float32 matmuls that repack their weights below some "
              "row count: docs/benchmarks.md, 'Why a verify cost two target forwards'); raised to the running maximum "
              "and listed in the table's `raised`; for a clean curve re-run on a quiet machine")
    print(f"wrote {config.out} (use it with `specheads eval --serving-costs {config.out}`)")
    return 0
