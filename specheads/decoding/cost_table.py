"""Cost tables: the JSON file of forward costs that `specheads profile` writes and `specheads eval --serving-costs`
reads, measured on a device or modelled by a roofline from a model's shape and an accelerator's bandwidth and peak.

It lives in the decoding core, beside `costs.py` whose `CostCurve` it stores, because more than one stage uses it:
eval prices served rounds with a table, the profile command (`eval/profile.py`, in the stage that prices serving)
writes one, and the demo or an integration may price rounds with a roofline preset; the core imports no stage.

A table is `{draft: {tokens, seconds}, target: {tokens, seconds}}` (the format `--serving-costs` has always read) plus
what describes it: `source` (`measured` or `roofline`), `modelled`, `context`, the device, dtype, date, models and
repeats, and `curves`, one entry per context measured or modelled (the first is the top-level pair). A token count n
is the tokens of one forward, each a row of the batch with its own `context` cached tokens (n rows of one new token:
what `measure_cost_curve` times); a roofline table made for a batch size B counts min(n, B) rows instead. A served
round is priced on the rows live in it: a preset's curves (`RooflineCurve`) compute each forward on its own rows, a
measured or given curve prices a forward by its tokens (docs/decoding-core.md, "Cost curves: profiled and roofline").
A measured table may also hold `head`, an acceptance head's forward time against the tokens it scores
(`measure_head_curve`, `specheads profile --head`), with the head's weights digest under `models.head`, so that eval
prices that head's forwards with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from specheads import __version__
from specheads.decoding.companion import head_forward_cost
from specheads.decoding.costs import (
    CURVE_TOKENS,
    FALLING_FIX,
    CostCurve,
    ServingCosts,
    first_fall,
    measure_cost_curve,
    measure_head_curve,
)
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

TABLE_FORMAT = "specheads cost table"
TABLE_VERSION = 1
MEASURED_ROWS = "n rows of one new token each, every row reading its own `context` cached tokens"
MAX_TOKENS = 2**24
"""The most tokens a curve's point may count: more than any forward holds."""
SECONDS_RANGE = (1e-9, 1e6)
"""The times a curve's point may give: from a nanosecond (no forward is faster) to eleven days."""
TABLE_FIX = ("write the table with `specheads profile` (or `specheads profile --preset NAME`), or fix it: "
             "{draft: {tokens: [...], seconds: [...]}, target: {...}}, increasing whole token counts from 1 to "
             f"{MAX_TOKENS} with one time each, from {SECONDS_RANGE[0]:g} to {SECONDS_RANGE[1]:g} s, never falling")

# ---- the roofline

LAUNCH_PER_LAYER = 10e-6
"""Seconds of launch overhead per decoder layer per forward: about ten kernels a layer (two norms, the QKV projection,
rotary embedding, attention, the output projection, two residual adds, the gate/up projection with its activation,
the down projection) at about 1 µs each of launch gap and tail when a serving engine replays them from a CUDA graph;
a published decode step of Llama-3.1-8B on an H100 SXM with CUDA graphs (5.1 ms) exceeds its weights' read time at
3.35 TB/s (4.79 ms) by about 0.3 ms, 10 µs for each of its 32 layers."""


ROOFLINE_FORMULA = (
    "seconds = max(bytes / bandwidth, flops / peak) + layers x launch_per_layer (+ 2 x layers x all_reduce when gpus > 1); "
    "bytes = (params + rows x context x 2 x layers x kv_heads x head_dim) x dtype_bytes / gpus; "
    "flops = (2 x params + 4 x layers x hidden x context) x tokens / gpus; "
    "all_reduce = latency + 2 (gpus - 1) / gpus x tokens x hidden x dtype_bytes / link_bandwidth")


@dataclass(frozen=True)
class ModelShape:
    """What a roofline needs of a decoder-only transformer (all attention heads × head_dim = hidden, as in Llama)."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class Accelerator:
    """One GPU's memory bandwidth and dense peak in the weights' dtype, and its interconnect for tensor parallelism."""

    name: str
    bandwidth: float
    """bytes/s of its memory."""
    peak_flops: float
    """FLOP/s, dense, in the weights' dtype."""
    link_bandwidth: float
    """bytes/s one way per GPU between GPUs of a tensor-parallel group."""
    all_reduce_latency: float
    """seconds of one small all-reduce across the group."""


@dataclass(frozen=True)
class Placement:
    """A model on `gpus` GPUs, tensor parallel: each GPU reads 1/gpus of its weights and KV heads and does 1/gpus of
    its FLOPs, and each layer all-reduces twice (after attention and after the MLP)."""

    model: ModelShape
    gpus: int = 1


@dataclass(frozen=True)
class RooflinePreset:
    """A draft and a target placed on an accelerator."""

    description: str
    accelerator: Accelerator
    draft: Placement
    target: Placement
    dtype_bytes: int = 2
    launch_per_layer: float = LAUNCH_PER_LAYER
    default_context: int = 1024


def roofline_seconds(place: Placement, accelerator: Accelerator, tokens: int, context: int, rows: int | None = None,
                     dtype_bytes: int = 2, launch_per_layer: float = LAUNCH_PER_LAYER) -> float:
    """Modelled seconds of one forward of `tokens` new tokens over `rows` rows (default: one row per token), each row
    reading its own `context` cached tokens: `ROOFLINE_FORMULA`."""
    model, gpus = place.model, place.gpus
    rows = tokens if rows is None else min(rows, tokens)
    kv_per_row = context * 2 * model.layers * model.kv_heads * model.head_dim
    read = (model.params + rows * kv_per_row) * dtype_bytes / gpus
    flops = (2 * model.params + 4 * model.layers * model.hidden * context) * tokens / gpus
    seconds = max(read / accelerator.bandwidth, flops / accelerator.peak_flops) + model.layers * launch_per_layer
    if gpus > 1:
        moved = 2 * (gpus - 1) / gpus * tokens * model.hidden * dtype_bytes / accelerator.link_bandwidth
        seconds += 2 * model.layers * (accelerator.all_reduce_latency + moved)
    return seconds


def roofline_kinks(place: Placement, accelerator: Accelerator, context: int, batch_size: int | None,
                   dtype_bytes: int) -> list[int]:
    """The whole token counts on either side of where the curve bends (the forward turns compute-bound; the rows stop
    growing at the batch size), so that a table interpolating between its points is the roofline at every count."""
    model, gpus = place.model, place.gpus
    kv_per_row = context * 2 * model.layers * model.kv_heads * model.head_dim * dtype_bytes / gpus
    weights = model.params * dtype_bytes / gpus
    flops_per_token = (2 * model.params + 4 * model.layers * model.hidden * context) / gpus
    compute, memory = flops_per_token / accelerator.peak_flops, kv_per_row / accelerator.bandwidth
    limit = math.inf if batch_size is None else batch_size
    bends = [] if batch_size is None else [float(batch_size)]
    if compute > memory and weights / accelerator.bandwidth / (compute - memory) <= limit:  # while rows = tokens
        bends.append(weights / accelerator.bandwidth / (compute - memory))
    elif batch_size is not None:  # beyond the batch size the rows stop growing and the memory term is flat
        bends.append((weights + batch_size * kv_per_row) / accelerator.bandwidth / compute)
    return sorted({n for bend in bends for n in (math.floor(bend), math.ceil(bend)) if n >= 1})


PRESET_TOKENS = tuple(2**i for i in range(13))  # 1 .. 4096
H100_SXM = Accelerator("NVIDIA H100 SXM 80GB (HBM3)", bandwidth=3.35e12, peak_flops=989e12, link_bandwidth=450e9,
                       all_reduce_latency=10e-6)
LLAMA_3_1_8B = ModelShape("Llama-3.1-8B", params=8.03e9, layers=32, hidden=4096, kv_heads=8, head_dim=128, vocab=128256)
LLAMA_3_2_1B = ModelShape("Llama-3.2-1B", params=1.24e9, layers=16, hidden=2048, kv_heads=8, head_dim=64, vocab=128256)
LLAMA_3_1_70B = ModelShape("Llama-3.1-70B", params=70.6e9, layers=80, hidden=8192, kv_heads=8, head_dim=128,
                           vocab=128256)
PRESETS: dict[str, RooflinePreset] = {
    "h100-llama3.1-8b-llama3.2-1b": RooflinePreset(
        "Llama-3.1-8B target and Llama-3.2-1B draft on one H100 SXM, bf16", H100_SXM,
        draft=Placement(LLAMA_3_2_1B), target=Placement(LLAMA_3_1_8B)),
    "4xh100-llama3.1-70b-llama3.1-8b": RooflinePreset(
        "Llama-3.1-70B target tensor parallel over 4 H100 SXM (NVLink), Llama-3.1-8B draft on one of them, bf16",
        H100_SXM, draft=Placement(LLAMA_3_1_8B), target=Placement(LLAMA_3_1_70B, gpus=4)),
}
PRESET_NAMES = tuple(PRESETS)


def roofline_curve(preset: RooflinePreset, role: str, context: int, tokens: tuple[int, ...] = PRESET_TOKENS,
                   batch_size: int | None = None) -> CostCurve:
    """The `role` ("draft" or "target") model's modelled curve at `context`: `tokens` plus the counts where it bends."""
    place = getattr(preset, role)
    counts = sorted(set(tokens) | set(roofline_kinks(place, preset.accelerator, context, batch_size, preset.dtype_bytes)))
    return CostCurve(tuple(counts), tuple(roofline_seconds(place, preset.accelerator, n, context, batch_size,
                                                           preset.dtype_bytes, preset.launch_per_layer)
                                          for n in counts))


@dataclass(frozen=True)
class RooflineCurve(CostCurve):
    """A preset's curve for the `role` ("draft" or "target") model at `context`: its points (tabulated as
    `roofline_curve` makes them) price a forward by its tokens, `price` computes `roofline_seconds` on the forward's
    own rows, as a served round has them."""

    preset: RooflinePreset | None = None
    role: str = "target"
    context: int = 0

    def price(self, tokens: int, rows: int) -> float:
        """`roofline_seconds` of `tokens` new tokens over `rows` rows, each reading its `context` cached tokens."""
        if tokens <= 0 or self.preset is None:
            return super().price(tokens, rows)
        preset = self.preset
        return roofline_seconds(getattr(preset, self.role), preset.accelerator, tokens, self.context, max(rows, 1),
                                preset.dtype_bytes, preset.launch_per_layer)


def roofline_costs(preset: RooflinePreset, context: int, batch_size: int | None = None,
                   tabulated: ServingCosts | None = None) -> ServingCosts:
    """The preset's two curves at `context`, pricing each forward on its own rows; their points `tabulated` (a table
    the preset wrote) or modelled for `batch_size` (`roofline_curve`)."""
    def curve(role: str) -> RooflineCurve:
        points = getattr(tabulated, role) if tabulated else roofline_curve(preset, role, context, batch_size=batch_size)
        return RooflineCurve(points.tokens, points.seconds, preset=preset, role=role, context=context)
    return ServingCosts(curve("draft"), curve("target"))


def roofline_table(name: str, contexts: list[int] | None = None, tokens: tuple[int, ...] = PRESET_TOKENS,
                   batch_size: int | None = None) -> dict[str, Any]:
    """The cost table of preset `name` at each of `contexts` (default: the preset's), marked as modelled."""
    preset = PRESETS[name]
    contexts = [int(context) for context in contexts or [preset.default_context]]
    curves = [{"context": context, **{role: roofline_curve(preset, role, context, tokens, batch_size).as_dict()
                                      for role in ("draft", "target")}} for context in contexts]
    rows = (MEASURED_ROWS if batch_size is None else
            f"min(n, {batch_size}) rows (a batch of {batch_size} requests), every row reading its own `context` cached "
            "tokens once")
    shapes = {role: {**vars(getattr(preset, role).model), "gpus": getattr(preset, role).gpus} for role in ("draft", "target")}
    return {**table_header("roofline", curves, rows, batch_size), "preset": name, "description": preset.description,
            "device": preset.accelerator.name, "dtype": "bfloat16" if preset.dtype_bytes == 2 else f"{preset.dtype_bytes} bytes",
            "models": shapes,
            "roofline": {"formula": ROOFLINE_FORMULA, "accelerator": vars(preset.accelerator),
                         "dtype_bytes": preset.dtype_bytes, "launch_per_layer_s": preset.launch_per_layer},
            "repeats": None}


# ---- measured tables


def device_description(device: torch.device) -> str:
    """The device in words: a GPU's model name, or the CPU's with the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), name)
    except OSError:
        pass
    return f"CPU {name} ({torch.get_num_threads()} threads)"


def model_facts(name: str, model: torch.nn.Module) -> dict[str, Any]:
    """What a measured table says of a model: its name, dtype, decoder layers and parameters."""
    parameter = next(model.parameters())
    return {"name": name, "dtype": str(parameter.dtype).removeprefix("torch."),
            "layers": int(getattr(model.config, "num_hidden_layers", 0)),
            "parameters": int(sum(p.numel() for p in model.parameters()))}


def measured_table(draft: tuple[str, torch.nn.Module], target: tuple[str, torch.nn.Module], contexts: list[int],
                   tokens: tuple[int, ...] = CURVE_TOKENS, repeats: int = 3,
                   head: tuple[str, Any] | None = None) -> dict[str, Any]:
    """Each model's forward time on its device against the tokens in the forward (`measure_cost_curve`: the median of
    `repeats`, after one untimed warm-up pass), at each of `contexts`; `draft` and `target` are (name, model). With
    `head` (name, acceptance head), the head's forward time against the tokens it scores too (`measure_head_curve`, on
    the draft's device: it reads no cache, so one curve serves every context)."""
    models = {"draft": draft, "target": target}
    for _, model in models.values():  # first forwards allocate and pick kernels: not timed
        measure_cost_curve(model, contexts[0], (tokens[0], tokens[-1]), repeats=1)
    curves = [{"context": int(context), **{role: measure_cost_curve(model, context, tokens, repeats).as_dict()
                                           for role, (_, model) in models.items()}} for context in contexts]
    device = next(target[1].parameters()).device
    facts = {role: model_facts(name, model) for role, (name, model) in models.items()}
    timed_head = {}
    if head is not None:
        name, module = head
        module.to(next(draft[1].parameters()).device).eval()
        timed_head = {"head": measure_head_curve(module, tokens, repeats).as_dict()}
        facts["head"] = {"name": name, "head_type": module.head_type, "parameters": module.num_parameters(),
                         "weights_digest": module.weights_digest(), "forward_cost": head_forward_cost(module, draft[1])}
    raised = [{"context": entry["context"], "model": role, "tokens": entry[role]["raised"]}
              for entry in curves for role in models if entry[role].get("raised")]
    return {**table_header("measured", curves, MEASURED_ROWS, None), **timed_head, "device": device_description(device),
            "dtype": facts["target"]["dtype"], "models": facts, "repeats": repeats,
            "statistic": "median of the repeats, raised to the running maximum where it fell (`raised`)",
            "raised": raised}


def table_header(source: str, curves: list[dict[str, Any]], rows: str, batch_size: int | None) -> dict[str, Any]:
    """The fields every table starts with: the first context's curves at the top level (what `--serving-costs` reads)."""
    return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "source": source, "modelled": source != "measured",
            "draft": curves[0]["draft"], "target": curves[0]["target"], "context": curves[0]["context"],
            "contexts": [entry["context"] for entry in curves], "rows": rows, "batch_size": batch_size, "curves": curves,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "specheads_version": __version__}


def write_cost_table(path: Path, table: dict[str, Any]) -> None:
    """Write `table` atomically (a reader never sees half of it), after checking that it reads back."""
    check_table(table, str(path))
    write_json_atomic(path, table)


# ---- reading


@dataclass(frozen=True)
class CostTable:
    """A cost table as read: the top-level curves, and what the file says of them; `roofline`, the preset whose formula
    prices them (a preset named in eval, or a table it wrote, unchanged), None for a measured or given table;
    `sha256`, the hash of the file's bytes as read (None for a preset's name)."""

    path: str
    costs: ServingCosts
    source: str
    modelled: bool
    context: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    roofline: RooflinePreset | None = None
    sha256: str | None = None

    @property
    def head_digest(self) -> str | None:
        """The weights digest of the head whose curve the table holds (None: no head curve)."""
        if self.costs.head is None:
            return None
        head = (self.fields.get("models") or {}).get("head")
        return head.get("weights_digest") if isinstance(head, dict) else None

    def describe(self) -> str:
        """Where the curves come from, in words, marked as modelled where they are."""
        facts = [self.fields.get("device"), f"context {self.context}" if self.context else None,
                 self.path if self.path != self.fields.get("preset") else None]
        said = ", ".join(fact for fact in facts if fact)
        if self.source == "roofline":
            return f"modelled by the roofline preset {self.fields.get('preset')} ({said})"
        if self.source == "measured":
            return f"measured by specheads profile ({said})"
        return f"given in {self.path}" + (" (modelled)" if self.modelled else "")

    @property
    def view(self) -> str:
        """The serving table's name for a view priced with these curves (a preset's view carries its name, so that two
        presets in one table are told apart)."""
        if self.source == "roofline":
            return f"roofline {self.fields.get('preset') or self.path} (modelled)"
        return {"measured": "measured"}.get(self.source, "given")

    def at_batch_size(self, size: int) -> ServingCosts:
        """The curves that price a round of `size` requests: a preset's (`roofline`) are tabulated for that batch (a
        forward of n tokens reads min(n, size) rows' caches, `roofline_table(batch_size=)`) and price every forward on
        the rows live in it (`RooflineCurve.price`); a measured or given table's are the same at every batch size, as
        written, and price a forward by its tokens."""
        if self.roofline is None:
            return self.costs
        return roofline_costs(self.roofline, self.roofline.default_context if self.context is None else self.context,
                              size)


def whole(value: Any) -> bool:
    """Whether `value` is a whole number (an int, not a bool or a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def short(value: Any) -> Any:
    """`value` as a message shows it: a whole number beyond 10^12 by its size alone."""
    return f"a number of {value.bit_length()} bits" if whole(value) and abs(value) > 10**12 else value


def check_curve(values: Any, name: str, where: str) -> None:
    """Refuse a curve that is not increasing whole token counts (1 to `MAX_TOKENS`) with one time each (in
    `SECONDS_RANGE`), never falling, or whose `raised` names counts it does not have."""
    if not isinstance(values, dict):
        raise UsageError(f"{where}: `{name}` is not a curve {{tokens: [...], seconds: [...]}}; {TABLE_FIX}")
    for key in ("tokens", "seconds"):
        if not isinstance(values.get(key), list):
            raise UsageError(f"{where}: `{name}` has no `{key}` list; {TABLE_FIX}")
    tokens, seconds = values["tokens"], values["seconds"]
    if len(tokens) < 2 or len(tokens) != len(seconds):
        raise UsageError(f"{where}: `{name}` needs two or more token counts with one time each, got {len(tokens)} "
                         f"token counts and {len(seconds)} times; {TABLE_FIX}")
    if any(not whole(n) or not 1 <= n <= MAX_TOKENS for n in tokens) or any(b <= a for a, b in zip(tokens, tokens[1:])):
        shown = [short(n) for n in tokens]
        raise UsageError(f"{where}: `{name}.tokens` {shown} are not increasing whole numbers from 1 to {MAX_TOKENS}; "
                         f"{TABLE_FIX}")
    low, high = SECONDS_RANGE
    for n, s in zip(tokens, seconds):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not low <= s <= high:
            raise UsageError(f"{where}: `{name}.seconds` gives {s!r} at {n} tokens, not a time from {low:g} to "
                             f"{high:g} s; {TABLE_FIX}")
    raised = values.get("raised", [])
    if not isinstance(raised, list) or any(not whole(n) for n in raised) or not set(raised) <= set(tokens):
        raise UsageError(f"{where}: `{name}.raised` is {raised!r}, not a list of the curve's token counts; {TABLE_FIX}")
    fall = first_fall(seconds)
    if fall is not None:
        raise UsageError(f"{where}: `{name}.seconds` falls from {seconds[fall - 1]!r} s at {tokens[fall - 1]} tokens to "
                         f"{seconds[fall]!r} s at {tokens[fall]}, but a forward over more tokens takes no less time; "
                         f"{FALLING_FIX}")


def check_table(table: Any, where: str) -> None:
    """Refuse a table without its draft and target curves, with a bad curve, or with a describing field of the wrong
    kind; `where` names the file in the message."""
    if not isinstance(table, dict):
        raise UsageError(f"{where}: holds {type(table).__name__}, not a cost table; {TABLE_FIX}")
    for role in ("draft", "target"):
        if role not in table:
            raise UsageError(f"{where}: has no `{role}` curve; {TABLE_FIX}")
        check_curve(table[role], role, where)
    if table.get("head") is not None:
        check_curve(table["head"], "head", where)
    if "modelled" in table and not isinstance(table["modelled"], bool):
        raise UsageError(f"{where}: `modelled` is {table['modelled']!r}, not true or false; {TABLE_FIX}")
    curves = table.get("curves", [])
    if not isinstance(curves, list) or not all(isinstance(entry, dict) for entry in curves):
        raise UsageError(f"{where}: `curves` is not a list of {{context, draft, target}}; {TABLE_FIX}")
    for name, context in [("context", table.get("context")),
                          *((f"curves[{number}].context", entry.get("context")) for number, entry in enumerate(curves))]:
        if context is not None and (not whole(context) or not 0 <= context <= MAX_TOKENS):
            raise UsageError(f"{where}: `{name}` is {short(context)!r}, not a whole number of cached tokens from 0 to "
                             f"{MAX_TOKENS}; {TABLE_FIX}")
    for number, entry in enumerate(curves):
        for role in ("draft", "target"):
            check_curve(entry.get(role), f"curves[{number}].{role}", where)


def read_cost_table(source: str, flag: str = "--serving-costs") -> CostTable:
    """The table in file `source`, or the roofline preset of that name at its default context (when no such file
    exists); a bad one is refused in one line naming `flag`, the file and the fix."""
    path, sha256 = Path(source), None
    if not path.exists() and source in PRESETS:
        table = roofline_table(source)
    else:
        where = f"{flag} {source}"
        if not path.is_file():
            raise UsageError(f"{where} is not a file; give a cost table (`specheads profile --out FILE` writes one) or "
                             f"a roofline preset: {', '.join(PRESET_NAMES)}")
        try:
            data = path.read_bytes()  # read once: parsed and hashed
            table, sha256 = json.loads(data.decode("utf-8")), hashlib.sha256(data).hexdigest()
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise UsageError(f"{where}: not readable JSON ({str(error).splitlines()[0]}); {TABLE_FIX}") from None
        check_table(table, where)
    head = CostCurve.from_dict(table["head"]) if table.get("head") is not None else None
    costs = ServingCosts(CostCurve.from_dict(table["draft"]), CostCurve.from_dict(table["target"]), head)
    source_kind = table.get("source") if table.get("source") in ("measured", "roofline") else "given"
    preset = written_by_preset(table, costs) if source_kind == "roofline" else None
    if preset is not None:
        costs = roofline_costs(preset, table["context"], tabulated=costs)
    return CostTable(source, costs, source_kind, bool(table.get("modelled", source_kind == "roofline")),
                     table.get("context"), {k: v for k, v in table.items() if k not in ("draft", "target", "head", "curves")},
                     preset, sha256)


def written_by_preset(table: dict[str, Any], costs: ServingCosts) -> RooflinePreset | None:
    """The preset that wrote `table`, when the table names it and its curves are the preset's, point for point, at
    its context and batch size; None otherwise (a table changed by hand is priced as written, by its tokens)."""
    preset = PRESETS.get(table.get("preset")) if isinstance(table.get("preset"), str) else None
    context, size = table.get("context"), table.get("batch_size")
    if preset is None or not whole(context) or not (size is None or (whole(size) and 1 <= size <= MAX_TOKENS)):
        return None
    for role in ("draft", "target"):
        written = getattr(costs, role)
        modelled = roofline_curve(preset, role, context, written.tokens, size)
        if modelled.tokens != written.tokens or not all(
                math.isclose(a, b, rel_tol=1e-9) for a, b in zip(modelled.seconds, written.seconds)):
            return None
    return preset
