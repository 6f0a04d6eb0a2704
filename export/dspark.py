"""`specheads export --into-dspark CHECKPOINT`: a copy of a DSpark drafter's folder whose confidence head is ours.

Engines read `confidence_head.proj.{weight,bias}` of a speculators DSpark checkpoint (heads.dspark) and apply σ;
SGLang divides the logit by a per-position temperature read from the JSON file given as
`--speculative-dspark-confidence-sts-path` (`{"temperatures": [T_1 .. T_γ]}`, γ the drafted positions per block);
vLLM and llama.cpp read no temperature. So a `dspark_confidence` head is written as one affine map of
[hidden ; markov_w1[previous token]]: its standardisation and class-weight correction folded in, and its calibration
σ(s_k · z + t_k) folded where an engine can apply it: one map for every drafted position goes into the weight and bias;
maps that differ only by a temperature (t_k / s_k the same at every position) put position 1's map into the weight and
bias and T_k = s_1 / s_k into SGLang's table (`dspark_sts.json` beside the weights). Any other calibration, or a head
of another form, is refused before anything is written. Every other tensor and file is copied unchanged; the folder
appears whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specheads import __version__
from specheads.artifacts.checkpoint import TrainedHead
from specheads.export.card import metrics_rows
from specheads.export.config import ExportConfig
from specheads.export.identity import check_drafter, lineage_sha256
from specheads.export.safety import (
    LOCK_NAMES,
    check_empty,
    check_finite,
    check_not_holding,
    check_tree,
    export_lock,
    inside,
)
from specheads.heads.calibration import METHOD, PositionCalibration
from specheads.heads.dspark import DSparkConfidenceHead
from specheads.heads.roles import EXPECTED_ACCEPTANCE
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder, replace_folder, usual_permissions

CONFIG_FILE, SINGLE_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
WEIGHT, BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"
MARKOV, NORM = "markov_head.markov_w1.weight", "norm.weight"
STS_FILE = "dspark_sts.json"
"""SGLang's per-position temperature table (`--speculative-dspark-confidence-sts-path`), written when one is needed."""
PROVENANCE_FILE = "specheads_confidence_head.json"
CARD_START, CARD_END = "<!-- specheads confidence head -->", "<!-- /specheads confidence head -->"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
SAME = 1e-9
"""Relative tolerance within which two calibration numbers are one (a refit writes the same map as floats)."""


@dataclass(frozen=True)
class DSparkCheckpoint:
    """What export needs of a speculators DSpark folder: its sizes, the form its confidence head will have (with the
    Markov embedding or not), the drafted positions per block, and where and in which dtype the head is stored."""

    folder: Path
    config: dict[str, Any]
    hidden_size: int
    markov_rank: int
    with_markov: bool
    had_head: bool
    drafted_positions: int
    shard: str
    dtype: torch.dtype

    @property
    def width(self) -> int:
        """The confidence head's input width: hidden size, plus the Markov rank when it reads the embedding."""
        return self.hidden_size + (self.markov_rank if self.with_markov else 0)


@dataclass(frozen=True)
class EngineHead:
    """The head as engines run it: σ(weight · x + bias) (SGLang: σ((weight · x + bias) / T_k) with `temperatures`)."""

    weight: torch.Tensor  # [1, width], float64
    bias: torch.Tensor  # [1], float64
    temperatures: tuple[float, ...] | None
    folded: str  # the calibration folded, in words


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (dtype, shape) in a safetensors file, from its header."""
    try:
        with safe_open(str(path), framework="pt") as weights:
            return {name: (weights.get_slice(name).get_dtype(), tuple(weights.get_slice(name).get_shape()))
                    for name in weights.keys()}
    except Exception as error:  # safetensors raises its own error types on a file that is not its format
        raise UsageError(f"{path} is not a safetensors file ({' '.join(str(error).split())[:120]}); give the DSpark "
                         "folder speculators wrote") from None


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it (one file, or the shards an index names)."""
    if (folder / INDEX_FILE).is_file():
        try:
            shards = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{folder / INDEX_FILE} is no safetensors index (no weight_map); give the folder "
                             "speculators wrote") from None
        if not isinstance(shards, dict):
            raise UsageError(f"{folder / INDEX_FILE}'s weight_map is no map of tensor names to files; give the folder "
                             "speculators wrote")
        return {name: shard for shard in sorted(set(shards.values()), key=str)
                for name in header(inside(folder, shard, str(folder / INDEX_FILE))) if shards.get(name) == shard}
    if not (folder / SINGLE_FILE).is_file():
        raise UsageError(f"{folder} holds no {SINGLE_FILE} (nor {INDEX_FILE}); a DSpark checkpoint in speculators' "
                         "format keeps its weights in safetensors")
    return dict.fromkeys(header(folder / SINGLE_FILE), SINGLE_FILE)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a speculators DSpark folder; refused when it is not one."""
    if not folder.is_dir():
        raise UsageError(f"--into-dspark {folder} is not a folder; give a DSpark checkpoint folder (config.json and "
                         "safetensors, speculators' format)")
    check_tree(folder, "--into-dspark")  # before any file is read: a FIFO or a link to a device would never end
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{folder / CONFIG_FILE} cannot be read as JSON ({type(error).__name__}); give a DSpark "
                         "checkpoint folder in speculators' format") from None
    if not isinstance(config, dict) or config.get("speculators_model_type") != "dspark":
        found = config.get("speculators_model_type") if isinstance(config, dict) else None
        raise UsageError(f"{folder} is not a DSpark checkpoint (speculators_model_type {found!r}, not 'dspark'); "
                         "--into-dspark writes into a speculators DSpark drafter's folder")
    return config


def read_checkpoint(path: str | Path) -> DSparkCheckpoint:
    """The DSpark folder at `path`, its sizes read from config.json and checked against its tensors' shapes."""
    folder = Path(path).expanduser()
    config = read_config(folder)
    files = weight_map(folder)
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in sorted(set(files.values())):
        shapes.update(header(folder / shard))
    layer = config.get("transformer_layer_config") or {}
    hidden = layer.get("hidden_size", config.get("hidden_size"))
    rank = shapes[MARKOV][1][1] if MARKOV in shapes else 0
    where = folder / CONFIG_FILE
    if not isinstance(hidden, int) or (NORM in shapes and shapes[NORM][1] != (hidden,)):
        raise UsageError(f"{where}: hidden_size {hidden!r} does not fit {NORM} {list(shapes.get(NORM, ('', []))[1])}; "
                         "the folder's config and weights do not belong together")
    if config.get("markov_rank", rank) != rank:
        raise UsageError(f"{where}: markov_rank {config.get('markov_rank')} but {MARKOV} has rank {rank}; the folder's "
                         "config and weights do not belong together")
    had_head = WEIGHT in shapes
    with_markov = bool(config.get("confidence_head_with_markov", True)) if had_head else rank > 0
    if with_markov and not rank:
        raise UsageError(f"{where}: confidence_head_with_markov is true but the drafter has no Markov head; the "
                         "folder's config and weights do not belong together")
    block = int(config.get("block_size", 8))
    stored = next((name for name in (WEIGHT, MARKOV, NORM) if name in shapes), None)
    dtype = shapes[stored][0] if stored else "F32"
    if dtype not in DTYPES:
        raise UsageError(f"{folder}: {stored} is stored as {dtype}, and export writes the head in the checkpoint's own "
                         f"dtype, one of {', '.join(DTYPES)}; give a checkpoint in one of those (a quantised drafter "
                         "is not one)")
    checkpoint = DSparkCheckpoint(
        folder=folder, config=config, hidden_size=hidden, markov_rank=rank, with_markov=with_markov,
        had_head=had_head, drafted_positions=block if config.get("sample_from_anchor", True) else block - 1,
        shard=files.get(WEIGHT) or files.get(MARKOV) or sorted(set(files.values()))[-1],
        dtype=DTYPES[dtype])
    expected = {WEIGHT: (1, checkpoint.width), BIAS: (1,)}
    wrong = [f"{name} {list(shapes[name][1])} (expected {list(shape)})" for name, shape in expected.items()
             if name in shapes and shapes[name][1] != shape]
    if wrong or had_head != (BIAS in shapes):
        raise UsageError(f"{folder}: the confidence head's tensors do not fit config.json (hidden {hidden}, Markov rank "
                         f"{rank}, with_markov {with_markov}): {'; '.join(wrong) or 'weight or bias missing'}")
    return checkpoint


def check_form(trained: TrainedHead, checkpoint: DSparkCheckpoint) -> DSparkConfidenceHead:
    """Refuse, in one line, a head engines cannot run as this checkpoint's confidence head: another form, another
    hidden size or Markov rank, or a head trained for something else than drafted positions."""
    head = trained.head
    if not isinstance(head, DSparkConfidenceHead):
        raise UsageError(f"{trained.source} holds a head of type {head.head_type}; engines run a DSpark confidence head as one "
                         "linear layer over [the drafter's last state after its final norm ; markov_w1[previous token]], "
                         "which this head is not: train a dspark_confidence head (--model.head dspark_confidence)")
    trained.check_role((EXPECTED_ACCEPTANCE,), "specheads export --into-dspark (engines read it at every drafted "
                                               "position)")
    if head.hidden_size != checkpoint.hidden_size:
        raise UsageError(f"{trained.source} reads a state of width {head.hidden_size} but the drafter in "
                         f"{checkpoint.folder} has hidden size {checkpoint.hidden_size}; train the head on that "
                         "drafter's states")
    if head.markov_rank and (head.markov_rank != checkpoint.markov_rank or not checkpoint.with_markov):
        has = (f"a Markov rank of {checkpoint.markov_rank}" if checkpoint.with_markov else
               "a confidence head that reads no Markov embedding (confidence_head_with_markov false)")
        raise UsageError(f"{trained.source} reads a Markov embedding of rank {head.markov_rank} but {checkpoint.folder} "
                         f"has {has}; train the head on that drafter's Markov embeddings, or with markov_rank 0")
    return head


def affine(scale: float, shift: float) -> str:
    """σ(s · z ± t) in words."""
    return f"σ({scale:.6g} · z {'-' if shift < 0 else '+'} {abs(shift):.6g})"


def same(first: float, second: float) -> bool:
    """Whether two calibration numbers are one (`SAME`)."""
    return math.isclose(first, second, rel_tol=SAME, abs_tol=SAME)


def engine_head(head: DSparkConfidenceHead, checkpoint: DSparkCheckpoint) -> EngineHead:
    """The head as engines run it in `checkpoint` (its Markov columns zero when the head reads no embedding but the
    checkpoint's head does), its calibration folded; a calibration no engine can apply is refused."""
    weight, bias = head.engine_linear()
    if checkpoint.with_markov and not head.markov_rank:
        weight = torch.cat([weight, weight.new_zeros(checkpoint.markov_rank)])
    calibration = head.calibration
    if calibration is None:
        return EngineHead(weight[None], bias[None], None, "none (the head carries no calibration)")
    if calibration.method != METHOD:
        raise UsageError(f"the head's calibration is {calibration.method!r}, not an affine map of the logit, which no "
                         "engine applies; refit it as sequential_affine_logit or export the head without it")
    maps = [(calibration.scale[index], calibration.bias[index])
            for index in range(min(checkpoint.drafted_positions, calibration.positions))]
    scale, shift = maps[0]
    if all(same(s, scale) and same(t, shift) for s, t in maps):
        return EngineHead(scale * weight[None], (scale * bias + shift)[None], None,
                          f"one map for every drafted position, {affine(scale, shift)}, in the weight and bias")
    offset = shift / scale
    if not all(same(t / s, offset) for s, t in maps):
        raise UsageError(f"the head's calibration shifts the logit differently at each drafted position (scale "
                         f"{[round(s, 4) for s, _ in maps]}, bias {[round(t, 4) for _, t in maps]}), which no engine "
                         "applies (vLLM and llama.cpp take σ(logit), SGLang σ(logit / T_k)); refit it with one map "
                         "(--model.calibrate_positions 1) and export again")
    temperatures = per_position(calibration, checkpoint.drafted_positions)
    return EngineHead(scale * weight[None], (scale * (bias + offset))[None], temperatures,
                      f"position 1's map {affine(scale, shift)} in the weight and bias, and temperatures "
                      f"T_k = s_1 / s_k for positions 1..{checkpoint.drafted_positions} in {STS_FILE} (SGLang)")


def per_position(calibration: PositionCalibration, positions: int) -> tuple[float, ...]:
    """SGLang's temperature of each drafted position 1..`positions`: s_1 / s_k (the last map beyond the fitted ones)."""
    scales = [calibration.scale[min(k, calibration.positions) - 1] for k in range(1, positions + 1)]
    return tuple(scales[0] / scale for scale in scales)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A short sha256 of tensors' names, dtypes, shapes and bytes."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        sha.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        sha.update(tensor.view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def stored_tensors(engine: EngineHead, checkpoint: DSparkCheckpoint) -> dict[str, torch.Tensor]:
    """The head's weight and bias as the checkpoint will store them (its dtype), refused when any is not finite
    (a zero input deviation, a value beyond the dtype's range)."""
    stored = {WEIGHT: engine.weight.to(checkpoint.dtype).contiguous(), BIAS: engine.bias.to(checkpoint.dtype).contiguous()}
    check_finite(stored, f"the head as {checkpoint.folder} stores it ({str(checkpoint.dtype).removeprefix('torch.')})")
    if engine.temperatures is not None and not all(math.isfinite(t) and t > 0 for t in engine.temperatures):
        raise UsageError(f"the head's calibration gives SGLang temperatures {list(engine.temperatures)}, not all finite "
                         "and positive; refit the calibration")
    return stored


def write_weights(staging: Path, checkpoint: DSparkCheckpoint, written: dict[str, torch.Tensor]) -> tuple[str | None, str]:
    """Replace (or add) the confidence head (`written`, `stored_tensors`) in its safetensors file in `staging`, every
    other tensor and the file's metadata as they were; keep a shard index's map and size right. Returns the digests of
    the replaced head (None: there was none) and of the written one."""
    path = checkpoint.folder / checkpoint.shard
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as weights:
        metadata = weights.metadata()
    before = digest({name: tensors[name] for name in (WEIGHT, BIAS)}) if checkpoint.had_head else None
    save_file({**tensors, **written}, str(staging / checkpoint.shard), metadata=metadata)
    if not checkpoint.had_head and (checkpoint.folder / INDEX_FILE).is_file():
        index = json.loads((checkpoint.folder / INDEX_FILE).read_text())
        index["weight_map"].update(dict.fromkeys(written, checkpoint.shard))
        if isinstance(index.get("metadata"), dict) and "total_size" in index["metadata"]:
            index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in written.values())
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return before, digest(written)


def card_section(provenance: dict[str, Any], metrics: dict[str, Any]) -> str:
    """The model card's section on the replaced confidence head, between markers a later export replaces."""
    head, replaced = provenance["head"], provenance["replaced"]
    sampling = head["sampling"] or {}
    table = provenance.get("sglang_sts_file")
    lines = [CARD_START, "## Confidence head written by specheads", "",
             f"`{WEIGHT}` and `{BIAS}` ({replaced['dtype']}, input width {replaced['width']}) were "
             + (f"replaced (were `{replaced['before']}`, now `{replaced['after']}`)" if replaced["before"] else
                f"added (`{replaced['after']}`); config.json now enables the confidence head")
             + ". Every other tensor is unchanged.", "",
             f"- Head: `{head['head_type']}` from `{head['source']}` (weights `{head['weights_digest']}`, Markov rank "
             f"{head['markov_rank']}), trained for draft `{head['draft']}` on data `{head['data_fingerprint']}`, "
             f"sampling temperature {sampling.get('temperature')}, top-k {sampling.get('top_k')}, top-p "
             f"{sampling.get('top_p')}; specheads {provenance['specheads_version']}.",
             "- Folded into the weight and bias: the state's standardisation and the class-weight correction. "
             f"Calibration: {provenance['calibration_folded']}.",
             *([f"- SGLang applies the per-position temperatures with `--speculative-dspark-confidence-sts-path "
                f"{table}` (γ = {len(provenance['temperatures'])} drafted positions); vLLM and llama.cpp read no table "
                "and apply position 1's map at every position."] if table else []),
             f"- Written with: `{provenance['command']}`", ""]
    if metrics:
        lines += ["### Metrics of the head (specheads eval)", "", *metrics_rows(metrics), ""]
    return "\n".join([*lines, CARD_END])


def updated_card(folder: Path, section: str) -> str:
    """The folder's README.md with `section` in place of an earlier one (else appended); a short card when none."""
    path = folder / "README.md"
    text = path.read_text(encoding="utf-8") if path.is_file() else "# DSpark drafter\n"
    if CARD_START in text and CARD_END in text:
        start, end = text.index(CARD_START), text.index(CARD_END) + len(CARD_END)
        return text[:start] + section + text[end:]
    return text.rstrip("\n") + "\n\n" + section + "\n"


def write_folder(out: Path, checkpoint: DSparkCheckpoint, head: tuple[EngineHead, dict[str, torch.Tensor]],
                 provenance: dict[str, Any], metrics: dict[str, Any], overwrite: bool) -> None:
    """Copy the checkpoint beside `out`, write the head (`head`: as engines run it, and its tensors as stored), config,
    table, provenance and card into the copy, and move it into place in one rename (nothing half-written), holding
    `out`'s export lock throughout; the copy is removed however the export ends."""
    engine, written = head
    with export_lock(out):
        check_empty(out, overwrite)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            shutil.copytree(checkpoint.folder, staging, symlinks=True, dirs_exist_ok=True, ignore=lambda *_: LOCK_NAMES)
            before, after = write_weights(staging, checkpoint, written)
            provenance["replaced"].update(before=before, after=after)
            write_files(staging, checkpoint, engine, provenance, metrics)
            usual_permissions(staging)
            replace_folder(staging, out)
        finally:
            if staging.exists():
                shutil.rmtree(staging)


def write_files(staging: Path, checkpoint: DSparkCheckpoint, engine: EngineHead, provenance: dict[str, Any],
                metrics: dict[str, Any]) -> None:
    """config.json, SGLang's table, the card and the provenance (which records the digest of the folder so written,
    `identity.lineage_sha256`) into `staging`."""
    config = {**checkpoint.config, "enable_confidence_head": True, "confidence_head_with_markov": checkpoint.with_markov}
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (staging / STS_FILE).unlink(missing_ok=True)  # a table of an earlier export describes another head
    if engine.temperatures is not None:
        table = {"temperatures": list(engine.temperatures), "dataset": provenance["head"]["data_fingerprint"] or ""}
        (staging / STS_FILE).write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    (staging / "README.md").write_text(updated_card(checkpoint.folder, card_section(provenance, metrics)),
                                       encoding="utf-8")
    (staging / PROVENANCE_FILE).write_text("", encoding="utf-8")  # its content is left out of the digest, not its name
    provenance["drafter"]["folder_sha256"] = lineage_sha256(staging, PROVENANCE_FILE, cached=False)
    (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


def check_destination(config: ExportConfig) -> Path:
    """`--out` as a path export may fill: writable, not inside the checkpoint it copies, empty unless --overwrite."""
    out, source = Path(config.out).expanduser(), Path(config.into_dspark).expanduser()
    if config.weights_dtype != "float32":
        raise UsageError(f"--weights-dtype {config.weights_dtype} does not apply with --into-dspark: the head is stored "
                         "in the checkpoint's own dtype; drop the flag")
    check_output_folder(out, replaced=True)
    check_not_holding(out, [("--into-dspark", source), ("--ckpt", config.ckpt), ("--report", config.report)])
    if out.resolve().is_relative_to(source.resolve()):
        raise UsageError(f"--out {out} lies inside --into-dspark {source}, which is copied whole; write elsewhere")
    check_empty(out, config.overwrite)
    return out


def export_into_dspark(config: ExportConfig, out: Path, checkpoint: DSparkCheckpoint, trained: TrainedHead,
                       metrics: dict[str, Any]) -> dict[str, Any]:
    """Write `trained`'s head into a copy of `checkpoint` at `out` (`check_destination`), refused first when engines
    cannot run it there; `metrics` (the head's eval headline, may be empty) go into the card. Returns the provenance
    written beside the weights."""
    head = check_form(trained, checkpoint)
    drafter = check_drafter(trained, checkpoint.folder, PROVENANCE_FILE)
    engine = engine_head(head, checkpoint)
    written = stored_tensors(engine, checkpoint)
    command = (f"specheads export --ckpt {config.ckpt} --into-dspark {config.into_dspark} --out {config.out}"
               + (f" --report {config.report}" if config.report else ""))
    provenance = {
        "specheads_version": __version__, "command": command,
        "head": {"head_type": head.head_type, "source": trained.source, "weights_digest": head.weights_digest(),
                 "markov_rank": head.markov_rank, "draft": trained.draft, "target": trained.target,
                 "data_fingerprint": trained.data_fingerprint, "sampling": trained.sampling,
                 "calibration": None if head.calibration is None else head.calibration.as_dict()},
        "calibration_folded": engine.folded,
        "temperatures": None if engine.temperatures is None else list(engine.temperatures),
        "sglang_sts_file": STS_FILE if engine.temperatures is not None else None,
        "replaced": {"names": [WEIGHT, BIAS], "dtype": str(checkpoint.dtype).removeprefix("torch."),
                     "width": checkpoint.width, "file": checkpoint.shard},
        "metrics": metrics, "drafter": drafter,
    }
    write_folder(out, checkpoint, (engine, written), provenance, metrics, config.overwrite)
    return {**provenance, "into_dspark": str(checkpoint.folder), "out": str(out)}
