"""`specheads gen` end to end: check every input, plan the rows, label them with Lightning, write the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from specheads import __version__
from specheads.data_gen.card import dataset_card
from specheads.data_gen.config import FREE_DRAFTS, GenConfig
from specheads.data_gen.drafter_labels import (
    FeatureDrafter,
    check_prompts,
    drafter_columns,
    drafter_config,
    drafter_identity,
    load_feature_drafter,
)
from specheads.data_gen.engines import BuiltinEngine
from specheads.data_gen.labels import LABELLER, SIBLING_COLUMNS
from specheads.data_gen.module import LabellingModule, ShardWriter
from specheads.data_gen.placement import check_visible_gpus, trainer_devices
from specheads.data_gen.plan import Shard, WorkItem, build_plan
from specheads.data_gen.responses import ImportedResponses, finish_imported, read_imported_responses
from specheads.data_gen.vllm_engine import require_vllm, shards_with_vllm_responses
from specheads.dataset.prompts import Prompt, encode_prompt, load_prompts, prompt_token_limit, prompts_hash
from specheads.dataset.shards import SHARDS, read_record, record_path, shard_path, shard_problem
from specheads.dataset.storage import FeatureStorage
from specheads.dataset.store import FORMAT, FORMAT_VERSION, MANIFEST, read_manifest, shard_statistics
from specheads.model_outputs.states import check_state_layer
from specheads.pair.embedded import file_sha256
from specheads.pair.models import (
    ModelPair,
    chat_template_hash,
    context_length,
    draft_weights_identity,
    load_model,
    load_pair,
    load_tokenizers,
    stop_token_ids,
    tokenizer_hash,
    weights_identity,
)
from specheads.pair.placement import rank_devices
from specheads.plumbing.batch_end_stops import StopAtBatchEnds
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder, write_json_atomic, write_text_atomic
from specheads.plumbing.lock import folder_lock, lock_files
from specheads.plumbing.text import count, rate


@dataclass
class Summary:
    """What a finished run reports."""

    out: Path
    rows: int
    labelled_tokens: int
    mean_accept: float
    tokens_per_s: float | None
    resumed_complete: bool = False
    skipped_prompts: int = 0
    unanswered_prompts: int = 0
    truncated_responses: int = 0
    cut_at_stop_responses: int = 0

    def text(self) -> str:
        """The end-of-run lines printed to the terminal."""
        speed = "nothing new to label" if self.tokens_per_s is None else f"{rate(self.tokens_per_s)} labelled tokens/s"
        lines = [f"specheads gen: {self.rows} rows, {self.labelled_tokens:,} labelled tokens, "
                 f"mean acceptance {self.mean_accept:.3f}, {speed}"]
        if self.skipped_prompts:
            lines.append(f"  skipped {count(self.skipped_prompts, 'prompt')} too long for "
                         f"the context (long_prompts: skip; their ids are in {self.out / MANIFEST} under "
                         "skipped_prompt_ids); raise max_prompt_tokens or shorten them to keep them")
        if self.unanswered_prompts:
            lines.append(f"  left out {count(self.unanswered_prompts, 'prompt')} with no imported response (their ids "
                         f"are in {self.out / MANIFEST} under unanswered_prompt_ids)")
        if self.truncated_responses:
            lines.append(f"  cut {count(self.truncated_responses, 'imported response')} longer than max_new_tokens at "
                         "max_new_tokens; raise --max-new-tokens to keep them whole")
        if self.cut_at_stop_responses:
            lines.append(f"  cut {count(self.cut_at_stop_responses, 'imported response')} at the first stop token, "
                         "where generated responses end (what followed it is not labelled)")
        return "\n".join(lines + [f"  wrote {self.out}"])


LEFT_OUT = ("skipped_prompts", "unanswered_prompts", "truncated_responses", "cut_at_stop_responses")


def left_out(counts: dict[str, int]) -> dict[str, int]:
    """The Summary's counts of prompts left out and responses cut, from the manifest's `counts` (0 where data made
    before they were counted lacks them)."""
    return {name: counts.get(name, 0) for name in LEFT_OUT}


@dataclass
class Selection:
    """The rows to label, and the prompts left out: too long for the context, or with no imported response."""

    items: list[WorkItem]
    skipped: list[str]
    unanswered: list[str]

    def counts(self, prompts: int, imported: ImportedResponses | None) -> dict[str, int]:
        """The manifest's prompt counts out of `prompts` given, with the imported responses cut at max_new_tokens
        and at their first stop token."""
        return {"prompts": prompts - len(self.skipped) - len(self.unanswered), "skipped_prompts": len(self.skipped),
                "unanswered_prompts": len(self.unanswered),
                "truncated_responses": imported.truncated if imported else 0,
                "cut_at_stop_responses": imported.cut_at_stop if imported else 0}


def select_items(config: GenConfig, tokenizer: Any, prompts: list[Prompt], imported: dict[str, list[list[int]]] | None,
                 max_context: int) -> Selection:
    """Encode prompts, drop (or refuse) those too long for the context, and make one work item per row (none for a
    prompt without an imported response)."""
    limit = prompt_token_limit(max_context, config.sampling.max_new_tokens, config.max_prompt_tokens)
    ratios = config.mixing.ratios()
    items: list[WorkItem] = []
    skipped: list[str] = []
    unanswered: list[str] = []
    for position, prompt in enumerate(prompts):
        ids = tuple(encode_prompt(tokenizer, prompt))
        if len(ids) > limit:
            if config.long_prompts == "fail":
                raise UsageError(
                    f"prompt {prompt.id!r} has {len(ids)} tokens, over the limit of {limit} (context {max_context} minus "
                    f"max_new_tokens, or max_prompt_tokens); shorten it or set long_prompts: skip")
            skipped.append(prompt.id)
            continue
        responses = imported.get(prompt.id, []) if imported is not None else [None] * config.samples_per_prompt
        if not responses:
            unanswered.append(prompt.id)
        for sample, response in enumerate(responses):
            ratio = ratios[(position * len(responses) + sample) % len(ratios)]
            items.append(WorkItem(prompt.id, sample, ids, ratio, None if response is None else tuple(response)))
    if not items:
        raise UsageError("no prompt is left to label (all too long, or no imported response matches); "
                         "raise max_prompt_tokens, give shorter prompts, or check the responses file")
    return Selection(items, skipped, unanswered)


def load_models(config: GenConfig, tokenizer: Any, devices: Any) -> ModelPair:
    """The pair gen labels: the target with its draft, or with the feature drafter `config.drafter` as the draft
    (checked against the target before its weights are read)."""
    if config.drafter is None:
        return load_pair(config.target, config.draft, tokenizer, devices)
    target = load_model(config.target, devices)
    option = config.drafter
    drafter = load_feature_drafter(option.kind, option.path, target, option.depth)
    return ModelPair(target, drafter, tokenizer, config.target.describe(), drafter.name())


def fingerprint_of(identity: dict) -> str:
    """The data fingerprint: a hash of everything that decides the rows."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def arithmetic(device: torch.device, threads: int, dtype: torch.dtype) -> dict[str, Any]:
    """What the rows' floats depend on beside the inputs (docs/data.md "Reproducibility"): the kind of device (a GPU
    by name), the models' dtype, torch's and transformers' versions (their kernels), and on a CPU its vector
    instructions and the threads each rank labels with (a reduction split over more threads adds in another order)."""
    record: dict[str, Any] = {"device": device.type, "dtype": str(dtype).removeprefix("torch."),
                              "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    if device.type == "cpu":
        record |= {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads}
    return record


def arithmetic_refusal(out: Path, made: dict[str, Any] | None, here: dict[str, Any]) -> str:
    """The one-line refusal to go on with data in `out` labelled under other arithmetic (`made`; None: before gen
    recorded it) than this run's (`here`)."""
    if made is None:
        return (f"{out} was labelled before gen recorded the arithmetic its rows depend on (torch threads, device, "
                "torch version), so this run's rows could differ from its shards; pick another --out or pass --overwrite")
    differs = [name for name in sorted(set(made) | set(here)) if made.get(name) != here.get(name)]
    fix = f"pass --threads {made['threads']}" if differs == ["threads"] else "go on with it where it was made"
    what = "; ".join(f"{name} {made.get(name)} there, {here.get(name)} here" for name in differs)
    return (f"{out} was labelled under other arithmetic ({what}), so this run's rows could differ from its shards; "
            f"{fix}, or pick another --out or pass --overwrite")


def data_identity(config: GenConfig, pair: ModelPair, prompts: list[Prompt], device: torch.device) -> dict:
    """What defines the dataset (docs/data.md "Manifest"), the arithmetic of this rank's `device` included; counts and
    times are left out on purpose."""
    return {
        "target": weights_identity(config.target, pair.target),
        "draft": (drafter_identity(pair.draft) if isinstance(pair.draft, FeatureDrafter)
                  else draft_weights_identity(config.draft, pair.draft)),
        "tokenizer_hash": tokenizer_hash(pair.tokenizer),
        "chat_template_hash": chat_template_hash(pair.tokenizer),
        "sampling": {**config.sampling.transform().as_dict(), "max_new_tokens": config.sampling.max_new_tokens},
        "mixing": {"ratios": config.mixing.ratios()},
        "labeller": LABELLER,  # how the draws make the rows (data_gen.labels.LABELLER)
        "seed": config.seed,
        "prompts": {"source": config.prompts, "split": config.prompts_split, "hash": prompts_hash(prompts),
                    "count": len(prompts)},
        # ignored with imported responses (their file decides the rows): kept at its default, so that imported data
        # made before keeps its fingerprint
        "samples_per_prompt": 1 if config.responses else config.samples_per_prompt,
        "responses": {"source": "imported", "sha256": file_sha256(Path(config.responses))}
        if config.responses else {"source": "target-generate",
                                  **({"engine": "vllm"} if config.responses_engine == "vllm" else {})},
        "store_features": config.store_features,
        "draft_hidden_size": int(pair.draft.config.hidden_size),
        # only when set, so that data made before the option keeps its fingerprint
        **({"state_layer": config.state_layer} if config.state_layer is not None else {}),
        **({"target_states": True, "target_hidden_size": int(pair.target.config.hidden_size)}
           if config.target_states else {}),
        # the columns too: data labelled before `sibling_logq` was one is told apart (and not resumed into)
        **({"sibling_labels": True, "sibling_columns": list(SIBLING_COLUMNS)} if config.sibling_labels else {}),
        **feature_storage(config).identity(),  # likewise only the options that differ from the default
        "long_prompts": config.long_prompts,
        "max_prompt_tokens": config.max_prompt_tokens,
        "batch_size": config.batch_size,
        "rows_per_shard": config.rows_per_shard,
        "arithmetic": arithmetic(device, config.threads, pair.target.dtype),
    }


def feature_storage(config: GenConfig) -> FeatureStorage:
    """Which draft states the run stores, and in which dtype."""
    return FeatureStorage(config.features_at, config.features_dtype)


def holds_files(out: Path) -> bool:
    """True when `out` exists and holds anything beside the gen lock."""
    return out.exists() and any(path.name not in lock_files("gen") for path in out.iterdir())


def refuse_foreign_folder(out: Path, overwrite: bool) -> None:
    """Refuse, before writing anything there, a non-empty folder that holds no specheads dataset (unless `overwrite`)."""
    if not overwrite and read_manifest(out) is None and holds_files(out):
        raise UsageError(f"{out} is not empty and holds no specheads dataset; pick another --out or pass --overwrite")


def prepare_output(out: Path, fingerprint: str, identity: dict, overwrite: bool) -> dict | None:
    """Refuse a folder holding other data (unless `overwrite`); returns the manifest of a finished identical run
    whose every shard still verifies (sha256 included). Shards that fail are removed, to be labelled again."""
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("fingerprint") == fingerprint:
        if not manifest.get("complete"):
            return None
        records = manifest.get("shards") or [None] * manifest["plan"]["num_shards"]
        failed = {index: shard_problem(out, index, fingerprint, record, deep=True) for index, record in enumerate(records)}
        failed = {index: problem for index, problem in failed.items() if problem}
        for index, problem in failed.items():
            print(f"specheads gen: {shard_path(out, index)} {problem}; labelling it again", file=sys.stderr)
            shard_path(out, index).unlink(missing_ok=True)
            record_path(out, index).unlink(missing_ok=True)
        return None if failed else manifest
    if manifest is not None or holds_files(out):
        refuse_foreign_folder(out, overwrite)
        if not overwrite:
            old = manifest.get("identity", {})
            differs = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            if differs == ["arithmetic"]:
                raise UsageError(arithmetic_refusal(out, old.get("arithmetic"), identity["arithmetic"]))
            raise UsageError(f"{out} holds a dataset with a different fingerprint ({manifest.get('fingerprint')} vs "
                             f"{fingerprint}; differs in: {', '.join(differs) or 'format'}); pick another --out or pass --overwrite")
        for name in (MANIFEST, "README.md"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / SHARDS, ignore_errors=True)
    return None


def run(config: GenConfig) -> Summary | None:
    """Run `specheads gen` with a validated config; every check happens before anything is written. Returns the
    summary on rank 0, None on the other ranks."""
    out = check_before_models(config)
    all_prompts = load_prompts(config.prompts, config.prompts_split, config.prompts_column,
                               column_flag="--prompts-column")
    prompts = all_prompts[: config.num_prompts] if config.num_prompts else all_prompts
    tokenizer = load_tokenizers(config.target, config.draft)
    read = (read_imported_responses(Path(config.responses), tokenizer, {p.id for p in all_prompts})
            if config.responses else None)
    for note in ignored_settings(config) if rank_zero_only.rank == 0 else []:
        print(f"specheads gen: {note}", file=sys.stderr)
    trainer = make_trainer(config)  # before the models: Lightning names this rank's devices, where they are loaded
    pair = load_models(config, tokenizer, rank_devices(trainer.strategy.root_device, config.gpus_per_rank))
    check_state_layer(pair.draft, config.state_layer)
    imported = (finish_imported(read, stop_token_ids(pair.target, tokenizer), tokenizer.eos_token_id,
                                config.sampling.max_new_tokens) if read is not None else None)
    selection = select_items(config, tokenizer, prompts, imported.by_prompt if imported else None,
                             context_length(pair.target))
    items = selection.items
    if config.drafter is not None:
        check_prompts(items)
    shards = build_plan(items, config.batch_size, config.rows_per_shard)
    identity = data_identity(config, pair, prompts, trainer.strategy.root_device)
    fingerprint = fingerprint_of(identity)
    started = started_manifest(config, pair, identity, fingerprint, len(shards), len(items))
    with ExitStack() as held:
        finished: dict[str, dict] = {}

        def prepare() -> bool:
            """Rank 0: lock the folder (held until the run ends: a second run into `out` is refused); True when it
            holds this very dataset finished, else start the run's manifest."""
            refuse_foreign_folder(out, config.overwrite)
            held.enter_context(folder_lock(out, "gen"))
            manifest = prepare_output(out, fingerprint, identity, config.overwrite)
            if manifest is not None:
                finished["manifest"] = manifest
                return True
            write_json_atomic(out / MANIFEST, started)
            return False

        if decided_by_rank_zero(trainer, prepare, held):  # nothing new to label: every rank ends here
            if "manifest" not in finished:
                return None  # not rank 0
            counts = finished["manifest"]["counts"]
            return Summary(out, counts["rows"], counts["labelled_tokens"], finished["manifest"]["mean_accept"], None,
                           True, **left_out(counts))
        if config.responses_engine == "vllm" and rank_zero_only.rank == 0:  # one process (GenConfig.validate)
            shards = shards_with_vllm_responses(config, pair.target, tokenizer, shards, out, fingerprint)
        return label(config, pair, tokenizer, shards, out, started, selection.counts(len(prompts), imported),
                     selection, trainer)


def check_before_models(config: GenConfig) -> Path:
    """Every check of `specheads gen` that needs no model: the config, the drafter's kind (and speculators), vLLM
    where it writes the responses, the output folder; the output folder's path."""
    config.validate()
    if config.drafter is not None and config.drafter.kind in FREE_DRAFTS:
        raise UsageError(f"--drafter.kind {config.drafter.kind} is labelled by data_gen.lookup_labels.run_lookup "
                         "(`specheads gen` runs it); call that")
    if config.responses_engine == "vllm":
        require_vllm()
    out = Path(config.out)
    check_output_folder(out)
    if config.drafter is not None:  # its kind (and speculators) before any model loads
        drafter_config(config.drafter.kind, config.drafter.path)
    return out


def started_manifest(config: GenConfig, pair: ModelPair, identity: dict[str, Any], fingerprint: str, shards: int,
                     rows: int) -> dict[str, Any]:
    """The manifest a run writes when it starts (`complete` false): the data's identity and fingerprint, the pair's
    names, the plan of `shards` shards over `rows` rows, the config and the tool's version."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "complete": False, "fingerprint": fingerprint,
        "identity": identity, "target_name": pair.target_name, "draft_name": pair.draft_name,
        "plan": {"num_shards": shards, "rows": rows, "batch_size": config.batch_size,
                 "rows_per_shard": config.rows_per_shard},
        "config": config.as_dict(), "tool_version": __version__,
    }


def ignored_settings(config: GenConfig) -> list[str]:
    """A line for each setting given that this run ignores."""
    notes = []
    if config.responses and config.samples_per_prompt != 1:
        notes.append(f"samples_per_prompt ({config.samples_per_prompt}) is ignored with --responses: each imported "
                     "response is one row; drop it, or import more responses per prompt")
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp and omp != str(config.threads):
        notes.append(f"OMP_NUM_THREADS={omp} is ignored: each rank labels with --threads {config.threads} (the rows "
                     "depend on it); pass --threads to change it")
    return notes


DECIDED = "SPECHEADS_GEN_DECIDED"
"""Set by a rank 0 that starts the other ranks itself (Lightning's launcher): it decided to label before starting
them, so they have no decision to wait for."""


def shares_decision(trainer: L.Trainer) -> bool:
    """True when this rank takes part in sharing rank 0's decision: several ranks started together by a launcher
    (torchrun, srun), each running `run` from the start. When Lightning starts the ranks from rank 0 instead, rank 0
    decides before starting them, and starts none when there is nothing to label."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return (trainer.world_size > 1 and environment is not None and environment.creates_processes_externally
            and DECIDED not in os.environ)


def decided_by_rank_zero(trainer: L.Trainer, decide: Callable[[], bool], held: ExitStack) -> bool:
    """`decide()` on rank 0: True when there is nothing to label. Every rank gets the same answer, so that all of
    them label or all of them end, and rank 0's failure fails them all. Under torchrun or srun the process group is
    set up here for it (Trainer.predict would set it up later)."""
    shared = shares_decision(trainer)
    if shared:
        trainer.strategy.setup_environment()
    finished, failure = False, None
    if rank_zero_only.rank == 0:
        try:
            finished = decide()
        except Exception as error:  # passed on to the other ranks, then raised here
            failure = error
    outcome: tuple[str, str] = (("refused" if isinstance(failure, UsageError) else "failed", str(failure))
                                if failure is not None else ("finished" if finished else "label", ""))
    if shared:
        outcome = trainer.strategy.broadcast(outcome, src=0)
        if outcome[0] != "label":
            torch.distributed.destroy_process_group()  # no collective follows
    elif trainer.world_size > 1 and rank_zero_only.rank == 0:
        held.enter_context(environment_set(DECIDED, "1"))  # the ranks Trainer.predict starts inherit it
    if failure is not None:
        raise failure
    kind, message = outcome
    if kind == "refused":
        raise UsageError(message)
    if kind == "failed":
        raise RuntimeError(f"rank 0 failed: {message}")
    return kind == "finished"


@contextmanager
def environment_set(name: str, value: str) -> Iterator[None]:
    """The environment variable `name` set to `value` for the block."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def label(config: GenConfig, pair: ModelPair, tokenizer: Any, shards: list[Shard], out: Path, started: dict,
          prompt_counts: dict[str, int], selection: Selection, trainer: L.Trainer) -> Summary | None:
    """Label every shard not yet done with `trainer`; rank 0 writes the finished manifest with `prompt_counts`
    (Selection.counts). Returns the summary on rank 0, None elsewhere."""
    transform = config.sampling.transform()
    fingerprint = started["fingerprint"]
    summary: dict[str, Summary] = {}

    def finalise(tokens_written: int, seconds: float) -> None:
        stats = shard_statistics(out, len(shards))
        records = [read_record(out, index) for index in range(len(shards))]
        manifest = {**started, "complete": True, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "shards": records,
                    "counts": {**prompt_counts, "rows": stats["rows"], "labelled_tokens": stats["labelled_tokens"],
                               "draft_tokens": stats["draft_tokens"]},
                    "skipped_prompt_ids": selection.skipped, "unanswered_prompt_ids": selection.unanswered,
                    "mean_accept": stats["mean_accept"], "mean_beta": stats["mean_beta"],
                    "storage": stats["storage"]}
        write_text_atomic(out / "README.md", dataset_card(manifest))
        write_json_atomic(out / MANIFEST, manifest)
        speed = tokens_written / seconds if tokens_written else None
        summary["done"] = Summary(out, stats["rows"], stats["labelled_tokens"], stats["mean_accept"], speed,
                                  **left_out(prompt_counts))

    module = LabellingModule(pair.target, pair.draft, tokenizer, shards, out, transform,
                             config.sampling.max_new_tokens, config.seed, config.label_chunk_tokens,
                             config.store_features, config.state_layer, fingerprint, feature_storage(config),
                             threads=config.threads, engine=BuiltinEngine(tokenizer, transform, config.sampling.max_new_tokens, config.seed,
                                                  config.generation), target_states=config.target_states,
                             siblings=config.sibling_labels)
    drafter = started["identity"]["draft"] if config.drafter is not None else None
    writer = ShardWriter(out, int(pair.draft.config.hidden_size) if config.store_features else None, finalise,
                         fingerprint, config.features_dtype,
                         int(pair.target.config.hidden_size) if config.target_states else None, config.sibling_labels,
                         drafter_columns(drafter) if drafter else None)
    trainer.callbacks += [writer, StopAtBatchEnds()]  # a stop once the batch is written
    with threads_kept():  # the module sets this rank's labelling threads (config.threads) once Lightning has launched
        trainer.predict(module, return_predictions=False)
    return summary.get("done")  # None on ranks other than 0


@contextmanager
def threads_kept() -> Iterator[None]:
    """torch's thread count as it was before the block, whatever the block sets."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_trainer(config: GenConfig) -> L.Trainer:
    """A predict-only Trainer: DDP when more than one process, Lightning's own cluster detection. With
    `gpus_per_rank` G its devices are each rank's first GPU, `[0, G, 2G, …]` (data_gen.placement)."""
    check_visible_gpus(config)
    processes = config.devices * config.num_nodes
    return L.Trainer(
        accelerator=config.accelerator, devices=trainer_devices(config.devices, config.gpus_per_rank),
        num_nodes=config.num_nodes, strategy="ddp" if processes > 1 else "auto", logger=False,
        enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False,
        enable_progress_bar=config.progress,
    )

