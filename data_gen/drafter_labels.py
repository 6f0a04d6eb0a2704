"""Labels for a feature drafter as the draft (`specheads gen --drafter.kind eagle3|dspark --drafter.path DIR`): an
EAGLE-3 or DSpark drafter in speculators' format, which reads the target's streams (`specheads.pair.drafters`).

Such a drafter's q at a drafted position depends on how deep into its round the position is: EAGLE-3 drafts the k-th
candidate from its own states of the k − 1 before it, DSpark from slot k of the block at the round's anchor plus the
Markov head's bias from the token before. So every labelled position has a depth d (1 = the round's first candidate):

- depth: the token mix (`is_draft`) sets it. A run of drafted positions is a round, as everywhere else in specheads
  (`train.loss.run_positions`, `heads.calibration.round_windows`): the position after a target token (or the prompt)
  is depth 1, each drafted position raises the next one's depth by one, and after `depth` (K_max) drafted positions a
  new round starts (d_i = 1 + (drafted positions right before i) mod K_max). So each anchor gets a chain of up to
  K_max positions, as a constant-K decoder drafts them, and the depths 1..K_max all occur.
- prefix: the labels' prefix, as for any draft (docs/data.md): the target's response y. A position at depth d is
  drafted from the round anchored d positions back (the target has read every token before the anchor), the chain
  reading the target's tokens y in between, as EAGLE-3 trains (training-time test) and DSpark trains (blocks over
  the ground truth). So p, q and the stored state share one prefix, and min(1, p/q) is exact for it. A decoder's
  chain reads its own candidates instead; a later depth matters only where the earlier ones were accepted, whose
  tokens then follow min(p, q)/Σ min(p, q), between q and the target's p.
- state: `features` row j is the drafter's state (after its final norm) that produced q for response position j + 1,
  what the decoding core hands a head (`Eagle3BatchCache`, `DSparkBatchCache`); row n, the one for position n + 1.
  A feature drafter's data serves heads that read the `context_state` only. With a DSpark drafter, `markov_features`
  row j is markov_w1[the token before position j + 1] (what DSpark's confidence head reads beside the state) and
  `drafter_score` its confidence head's prediction for position j + 1, made before the candidate is drawn.

q is computed by the decoding core's own B = 1 drafts (`Eagle3Draft.feed`, `block_forward` + `candidate_logits`),
row by row, round by round; p and the target's streams come from one teacher-forced target forward per batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specheads.data_gen.labels import (
    SIBLING_COLUMNS,
    PositionLabels,
    labels_from_log_probs,
    mix_tokens,
    mixing_draws,
    refuse_bad_labels,
)
from specheads.data_gen.plan import WorkItem, row_seed
from specheads.dataset.storage import FeatureStorage
from specheads.dataset.store import DrafterColumns
from specheads.model_outputs.sampling import SamplingTransform, row_generator, uniforms
from specheads.model_outputs.signals import output_logits
from specheads.model_outputs.states import decoder_states
from specheads.pair.drafters import draft_rows, drafter_weights_sha256, speculators_models, streams_captured
from specheads.plumbing.errors import UsageError

KINDS = {"eagle3": "EAGLE-3", "dspark": "DSpark"}
LAYER_IDS = {"eagle3": "eagle_aux_hidden_state_layer_ids", "dspark": "aux_hidden_state_layer_ids"}
DEPTH_CHOICE = (
    "A feature drafter's q depends on how deep into its round a position is, so each position has a `depth`: a run "
    "of drafted positions in the mix is a round (depth 1 after a target token, one more per drafted position, a new "
    "round after K_max = {depth}), so every anchor gets a chain of up to {depth} positions, as a constant-K decoder "
    "drafts them. The chain reads the target's tokens y (the labels' prefix, as EAGLE-3's training-time test and "
    "DSpark's blocks do), so p, q and the state share one prefix and min(1, p/q) is exact for it; a decoder's chain "
    "reads its own accepted candidates there. `features` row j is the drafter's state that produced q for position "
    "j + 1 (a `context_state`); no state that has read the candidate is stored.")
"""The dataset card's account of the depth choice."""


@dataclass
class FeatureDrafter:
    """A loaded feature drafter as gen's draft: its algorithm `kind`, speculators' model, its folder, the depth K_max
    its chains reach, and the target's vocabulary size."""

    kind: str
    drafter: Any
    folder: Path
    depth: int
    vocabulary: int

    @property
    def config(self) -> Any:
        """The drafter's decoder-layer config (what gen reads `hidden_size` from, as from a draft model's)."""
        return self.drafter.config.transformer_layer_config

    @property
    def layer_ids(self) -> list[int]:
        """The target layers whose streams it reads."""
        return list(getattr(self.drafter.config, LAYER_IDS[self.kind]))

    @property
    def markov_rank(self) -> int:
        """The rank of its Markov embedding (0: none, and always for EAGLE-3)."""
        markov = getattr(self.drafter, "markov_head", None)
        return int(markov.markov_rank) if markov is not None else 0

    @property
    def scores(self) -> bool:
        """Whether it predicts each candidate's acceptance (a DSpark drafter with its confidence head)."""
        return getattr(self.drafter, "confidence_head", None) is not None

    def name(self) -> str:
        """How the manifest and messages name it."""
        return f"{KINDS[self.kind]} {self.folder}"


def drafter_config(kind: str, folder: str | Path) -> dict[str, Any]:
    """The config.json of the drafter folder `folder`, refused in one line (before any model is loaded) unless it is
    a `kind` drafter's folder and speculators is installed."""
    folder = Path(folder)
    speculators_models(kind)  # the install line when it is missing
    path = folder / "config.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        raise UsageError(f"--drafter.path {folder} is not a drafter folder (config.json and model.safetensors); give "
                         "the folder `specheads train drafter` or speculators wrote")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON ({error.msg}); give a drafter folder speculators wrote") from None
    found = config.get("speculators_model_type")
    if found != kind:
        raise UsageError(f"--drafter.path {folder} holds a {found!r} drafter (speculators_model_type), not "
                         f"--drafter.kind {kind}; give --drafter.kind {found} or a {kind} drafter's folder"
                         if found in KINDS else
                         f"--drafter.path {folder}: its config.json names speculators_model_type {found!r}, not "
                         f"{kind!r}; give the folder of a {kind} drafter")
    return config


def drafter_depth(kind: str, config: dict[str, Any], asked: int | None, folder: str | Path) -> int:
    """K_max of the chains: `asked`, or the drafter's own (EAGLE-3: the speculative tokens its config proposes;
    DSpark: its block's candidates, which a DSpark depth may not exceed)."""
    if kind == "dspark":
        candidates = int(config["block_size"]) - (0 if config.get("sample_from_anchor", True) else 1)
        if asked is not None and asked > candidates:
            raise UsageError(f"--drafter.depth {asked} is deeper than the {candidates} candidates a block of the DSpark "
                             f"drafter {folder} drafts; give at most {candidates}, or leave it unset")
        return asked or candidates
    if asked is not None:
        return asked
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 3)


def check_for_target(kind: str, config: dict[str, Any], target: Any, folder: str | Path) -> None:
    """Refuse, before its weights are read, a drafter made for another target: its layers' hidden size and vocabulary
    and the target layers it reads must be the target's."""
    layers = config.get("transformer_layer_config") or {}
    target_config = target.config.get_text_config(decoder=True)
    ids = config.get(LAYER_IDS[kind]) or []
    count = target_config.num_hidden_layers
    found = {"hidden size": (layers.get("hidden_size"), target_config.hidden_size),
             "vocabulary": (layers.get("vocab_size"), target_config.vocab_size)}
    differs = [f"{what} {theirs} (the target's: {ours})" for what, (theirs, ours) in found.items() if theirs != ours]
    if any(not 0 <= int(i) <= count for i in ids):
        differs.append(f"target layers {ids} (the target has {count})")
    if differs:
        raise UsageError(f"--drafter.path {folder} was made for another target: {'; '.join(differs)}; give a drafter "
                         "trained for this target (`specheads train drafter`)")


def load_feature_drafter(kind: str, folder: str | Path, target: Any, depth: int | None) -> FeatureDrafter:
    """The `kind` drafter saved in `folder`, completed with `target`'s weights, frozen, on its device; refused in one
    line when the folder is of another kind or was made for another target (before its weights are read)."""
    config = drafter_config(kind, folder)
    check_for_target(kind, config, target, folder)
    chosen = drafter_depth(kind, config, depth, folder)
    if kind == "eagle3":
        from specheads.pair.eagle3 import load_drafter
    else:
        from specheads.pair.dspark import load_drafter
    return FeatureDrafter(kind, load_drafter(folder, target), Path(folder), chosen, int(target.config.vocab_size))


def drafter_identity(drafter: FeatureDrafter) -> dict[str, Any]:
    """What the data fingerprint records of the drafter: its kind, folder and the digest of its files
    (`drafter_weights_sha256`), the chains' depth, and the columns it adds."""
    digest = drafter_weights_sha256(drafter.folder)
    return {"kind": drafter.kind, "folder": str(drafter.folder), "weights_sha256": digest, "depth": drafter.depth,
            "markov_rank": drafter.markov_rank, "scores": drafter.scores, "layer_ids": drafter.layer_ids}


def drafter_columns(identity: dict[str, Any]) -> DrafterColumns:
    """The columns data labelled with the drafter of `identity` (`drafter_identity`) holds."""
    return DrafterColumns(identity["markov_rank"], identity["scores"])


def chain_depths(is_draft: list[bool], depth: int) -> list[int]:
    """The depth of response positions 1..n + 1 (n = len(`is_draft`)): 1 + the drafted positions right before each,
    modulo `depth` (module docstring)."""
    depths, run = [], 0
    for drafted in is_draft:
        depths.append(run % depth + 1)
        run = run + 1 if drafted else 0
    return [*depths, run % depth + 1]


def chains(depths: list[int]) -> list[tuple[int, int]]:
    """(the index of its first position, its length) of each round in `depths` (a round starts at each depth 1)."""
    starts = [index for index, depth in enumerate(depths) if depth == 1]
    return [(start, end - start) for start, end in zip(starts, [*starts[1:], len(depths)])]


@dataclass
class ChainStep:
    """What the drafter computed for one drafted position: its logits over the draft vocabulary, its state after the
    final norm, and (DSpark) its Markov embedding of the token before and its confidence head's prediction."""

    logits: torch.Tensor
    state: torch.Tensor
    markov: torch.Tensor | None = None
    score: float | None = None


def eagle3_steps(drafter: Any, tokens: list[int], streams: torch.Tensor, rounds: list[tuple[int, int]],
                 vocabulary: int) -> Iterator[ChainStep]:
    """Each round's steps, in order: a round (anchor, length) drafts the positions after the anchor from a catch-up
    with the target's `streams` [L, 3h] up to the anchor, then reads the chain's tokens with its own states."""
    from specheads.decoding.eagle3 import Eagle3Draft

    draft = Eagle3Draft(drafter, vocabulary)
    normed = bool(drafter.config.norm_output)
    for anchor, length in rounds:
        held = draft.first_position + draft.length
        logits, own = draft.feed(tokens[held: anchor + 1], streams[held - 1: anchor], fused=True)
        for step in range(length):
            if step:
                logits, own = draft.feed([tokens[anchor + step]], own[-1:], fused=False)
            state = own[-1] if normed else drafter.norm(own[-1:])[0]
            yield ChainStep(logits[-1], state.float())
        draft.crop(anchor)


def dspark_steps(drafter: Any, tokens: list[int], streams: torch.Tensor, rounds: list[tuple[int, int]],
                 vocabulary: int) -> Iterator[ChainStep]:
    """Each round's steps, in order: one block at the round's anchor over the target's `streams` [L, k·h] before it,
    the candidates' logits from its slots with the Markov bias of the chain's tokens."""
    from specheads.decoding.dspark import block_forward, candidate_logits, markov_inputs

    markov = drafter.markov_head
    for anchor, length in rounds:
        block = block_forward(drafter, streams[:anchor], tokens[anchor])
        for step in range(length):
            previous = tokens[anchor: anchor + step + 1]
            logits, score = candidate_logits(drafter, block, previous)
            slot = len(markov_inputs(drafter.config, previous)) - 1
            embedding = None if markov is None else markov.prev_embeddings(
                torch.tensor(previous[-1], device=block.hidden.device)).float()
            yield ChainStep(logits, block.hidden[slot].float(), embedding, score)


STEPS = {"eagle3": eagle3_steps, "dspark": dspark_steps}


@dataclass
class DrafterRow:
    """One row's labels, depths, states [n + 1, h], Markov embeddings [n + 1, R] and scores [n] (None where the
    drafter has none)."""

    labels: PositionLabels
    depths: list[int]
    states: torch.Tensor
    markov: torch.Tensor | None
    scores: list[float] | None


def label_drafter_row(target: Any, drafter: FeatureDrafter, target_states: torch.Tensor, streams: torch.Tensor,
                      tokens: list[int], prompt_length: int, is_draft: list[bool], transform: SamplingTransform,
                      draws: torch.Tensor, sibling_draws: torch.Tensor | None = None) -> DrafterRow:
    """The labels of one row (its prompt + response `tokens`, the target's states and streams on them) with the
    drafter drafting each position at its depth (module docstring); candidates drawn with `draws`, and with
    `sibling_draws` each position's second child from the same q (`labels.sibling_labels`: a tree's second child
    shares its first's state)."""
    depths = chain_depths(is_draft, drafter.depth)
    rounds = [(prompt_length - 1 + start, length) for start, length in chains(depths)]  # anchor: the token before
    rows = draft_rows(drafter.drafter)
    n = len(is_draft)
    steps = list(STEPS[drafter.kind](drafter.drafter, tokens, streams, rounds, drafter.vocabulary))
    parts = []
    for start, length in chains(depths[:n]):
        chunk = steps[start: start + length]
        positions = torch.arange(prompt_length - 1 + start, prompt_length - 1 + start + length)
        logits = torch.stack([place(step.logits, rows, drafter.vocabulary) for step in chunk])
        logp_all = transform.log_probs(output_logits(target, target_states[positions.to(target_states.device)]))
        parts.append(labels_from_log_probs(logp_all, transform.log_probs(logits), logits, transform,
                                           draws[start: start + length],
                                           None if sibling_draws is None else sibling_draws[start: start + length]))
    labels = PositionLabels(*(None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
                              for name in PositionLabels.__dataclass_fields__))
    markov = torch.stack([step.markov for step in steps]).cpu() if steps[0].markov is not None else None
    scores = [float(step.score) for step in steps[:n]] if steps[0].score is not None else None
    return DrafterRow(labels, depths[:n], torch.stack([step.state for step in steps]).cpu(), markov, scores)


def place(logits: torch.Tensor, rows: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Draft-vocabulary logits at their rows of the target's vocabulary, −inf elsewhere (q is then 0 there)."""
    from specheads.decoding.features import place_logits

    return place_logits(logits.float(), rows, vocabulary)


def check_prompts(items: list[WorkItem]) -> None:
    """Refuse, before anything is labelled, a prompt of one token: a feature drafter's first q reads the target's
    streams of the position before the prompt's last."""
    short = next((item for item in items if len(item.prompt_ids) < 2), None)
    if short is not None:
        raise UsageError(f"prompt {short.prompt_id!r} has one token; a feature drafter drafts after the target has read "
                         "a token before the prompt's last: give prompts of two tokens or more (a chat template does)")


def label_drafter_batch(target: Any, drafter: FeatureDrafter, items: list[WorkItem], responses: list[list[int]],
                        transform: SamplingTransform, global_seed: int, pad_id: int, device: torch.device,
                        storage: FeatureStorage, siblings: bool = False) -> dict[str, list]:
    """Label one batch of rows with `drafter` as the draft; the columns of `labels.label_batch` (features: the
    drafter's states, the rows and dtype `storage` names; the `sibling_*` columns with `siblings`, from the row's own
    sibling stream as `label_batch` draws them), plus `depth`, and with a DSpark drafter `markov_features` (where it
    has a Markov head) and `drafter_score` (where it has a confidence head)."""
    sequences = [list(item.prompt_ids) + response for item, response in zip(items, responses)]
    with streams_captured(target, drafter.layer_ids) as captured:
        target_states = decoder_states(target, sequences, pad_id, device)
    streams = torch.cat([captured[index] for index in drafter.layer_ids], dim=-1)
    columns: dict[str, list] = {}
    for row, (item, response) in enumerate(zip(items, responses)):
        generator = row_generator(row_seed(global_seed, item.prompt_id, item.sample_index, "label"))
        mixing = mixing_draws(global_seed, item, len(response))
        is_draft = (mixing >= item.target_ratio).tolist()
        sibling_draws = (uniforms(row_generator(row_seed(global_seed, item.prompt_id, item.sample_index, "sibling")),
                                  len(response)) if siblings else None)
        result = label_drafter_row(target, drafter, target_states[row], streams[row], sequences[row],
                                   len(item.prompt_ids), is_draft, transform, uniforms(generator, len(response)),
                                   sibling_draws)
        mixed_ids, _ = mix_tokens(torch.tensor(response), result.labels.draft_ids, item.target_ratio, mixing)
        kept = torch.from_numpy(storage.rows(is_draft))
        values = {"prompt_id": item.prompt_id, "sample_index": item.sample_index, "target_ratio": item.target_ratio,
                  "prompt_ids": list(item.prompt_ids), "target_ids": response, "mixed_ids": mixed_ids.tolist(),
                  "is_draft": is_draft, "depth": result.depths,
                  **{name: getattr(result.labels, name).numpy()
                     for name in ("draft_ids", "logp", "logq", "accept", "beta", "entropy", "top1", "top2",
                                  *(SIBLING_COLUMNS if siblings else ()))},
                  "features": storage.encode(result.states[kept])}
        if result.markov is not None:
            values["markov_features"] = storage.encode(result.markov[kept])
        if result.scores is not None:
            values["drafter_score"] = result.scores
        refuse_bad_labels(values, item)
        for name, value in values.items():
            columns.setdefault(name, []).append(value)
    return columns
