"""Responses and their labels in one decoding pass, for a draft derived from the target (gen's path on a CPU).

A derived draft runs target layers: the target's first `shared` layers (those before its first skipped one), then the
target layers it keeps. So one pass over the target's layer modules serves three streams of each row at every step:

- T, the target on the response y: its logits p sample y_i (with the row's `response` draws, as `generate` does in
  `responses.RowSeededSampler`) and are the labels' p;
- D, the draft on y: it takes T's state after the shared layers (the same layers on the same tokens give the same
  states) and runs the layers it keeps; its logits q give the candidate ŷ_i and the labels' q;
- Z, the draft on the mixed tokens z, up to the state layer: the stored `features`. Nothing drawn depends on them,
  so Z runs once the pass has ended, teacher-forced over every row's whole mix (a forward over many tokens costs
  half what a decoding step's does a token).

Streams that meet at a layer module go through it as one batch, each with its own rows of that layer's KV cache. Each
distinct prompt is run once (the samples of a prompt share it) and its keys and values are copied to its rows. Against
`generate` followed by teacher-forced forwards of the target, of the draft, and of the draft on the mixed tokens
(`labels.label_batch`), the pass runs the shared layers once for T and D, stops Z at the state layer, runs each prompt
once, and takes p once: the p a label reads is the very p its response token was drawn from.

It computes what `generate` and `label_batch` compute, with the same draws from the same streams, up to float rounding
(a cached step adds in another order than a whole-sequence forward; a draw can then differ only where its uniform
falls within that rounding of a boundary of the cumulative distribution, as between two `generate` batch sizes).
`OnePass.build` returns a labeller only for a derived pair whose layers attend over every earlier token, and only once
a probe shows that the pass gives the plain forwards' p, q and states on the model; gen falls back to `generate` and
`label_batch` otherwise (`data_gen.module`), saying why where the probe failed (`ProbeFailed`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specheads.data_gen.labels import SIBLING_COLUMNS, labels_from_log_probs, mix_tokens, mixing_draws, refuse_bad_labels
from specheads.data_gen.plan import WorkItem, row_seed
from specheads.dataset.storage import DEFAULT_STORAGE, FeatureStorage
from specheads.model_outputs.sampling import SamplingTransform, draw_from_log_probs, row_generator, uniforms
from specheads.model_outputs.signals import output_logits
from specheads.model_outputs.states import decoder_layers, decoder_states
from specheads.pair.models import derived_layers

PROBE_TOLERANCE = 1e-3
"""Largest difference between the pass and the plain forwards on the probe, relative to the largest value: float
rounding stays orders of magnitude below it; a family whose forward does what the pass does not (scaled embeddings,
another position encoding) lands far above."""

KV_BUDGET = 3 << 30
"""Bytes of KV cache one pass may hold; the rows beyond it go to the next pass."""

DROP_AFTER = 8
"""Finished rows leave the batch (every cache is copied without them) once they would otherwise ride along for this
many row-steps: a copy costs about what a few row-steps do."""


@dataclass(frozen=True)
class Layout:
    """Which target layers each stream runs: the draft's layer j is target layer `kept[j]`, and its first `shared`
    layers are the target's first; the feature stream runs the draft's first `depth` layers (none when no features are
    stored), then the final norm when `final_norm` (the state of `state_layer: null`)."""

    kept: tuple[int, ...]
    shared: int
    depth: int
    final_norm: bool

    def drafts(self, layer: int) -> bool:
        """Whether D runs target layer `layer` beside T (T runs every layer; D shares T's before `shared`)."""
        return layer >= self.shared and layer in self.kept

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers Z runs, in order (none when no features are stored)."""
        return self.kept[: self.depth]

    @property
    def feature_layer(self) -> int:
        """The target layer after which the feature stream's state is read."""
        return self.feature_layers[-1]


def derived_layout(target: Any, draft: Any, state_layer: int | None, features: bool = True) -> Layout | None:
    """The layout of a draft whose layers, embeddings, final norm and LM head are the target's own parameters (what
    `models.without_layers` makes: `models.derived_layers`, the very objects) and that skips a layer, None for any
    other draft; with `features`, its stream of the states at `state_layer`."""
    kept = derived_layers(draft, target, identical=True)
    if not isinstance(kept, list) or len(kept) == len(target.get_decoder().layers):
        return None
    shared = next(j for j, k in enumerate(kept + [-1]) if j != k)
    depth = (state_layer or len(kept)) if features else 0
    return Layout(tuple(kept), shared, depth, features and state_layer is None)


def plain_attention(model: Any) -> bool:
    """Whether every layer of `model` attends over all earlier tokens (no sliding window or recurrent layer) through an
    attention that takes a 4D mask (sdpa or eager), behind a decoder with the rotary embedding and final norm the
    pass calls."""
    config = model.config.get_text_config(decoder=True)
    decoder = model.get_decoder()
    return (set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
            and getattr(config, "sliding_window", None) is None
            and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
            and hasattr(decoder, "rotary_emb") and hasattr(decoder, "norm"))


class ProbeFailed(Exception):
    """The pass cannot label a derived pair: on the probe it gave other numbers than the model's own forwards, or the
    model's layers raised when the pass called them (a family that wants other inputs). The message says which."""


class LayerCache:
    """The keys and values one layer module holds for the rows of the streams that run it (stream after stream), filled
    in place. A fresh cache records its first forward as it is; `extended` and `laid_out` make caches with room for
    more."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.used = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a forward's keys and values [rows, heads, tokens, dim] and return every slot's so far: what an
        attention module asks of its cache."""
        if self.keys is None:  # a fresh cache records the forward as it is
            self.keys, self.values, self.used = keys, values, keys.shape[2]
            return keys, values
        width = keys.shape[2]
        self.keys[:, :, self.used : self.used + width] = keys
        self.values[:, :, self.used : self.used + width] = values
        self.used += width
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    def extended(self, capacity: int) -> LayerCache:
        """A cache holding this one's slots, with room for `capacity` in all (an empty one while this one is)."""
        cache = LayerCache()
        if self.keys is not None:
            cache.keys = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
            cache.values = self.values.new_empty(cache.keys.shape)
            cache.keys[:, :, : self.used] = self.keys[:, :, : self.used]
            cache.values[:, :, : self.used] = self.values[:, :, : self.used]
            cache.used = self.used
        return cache

    @classmethod
    def laid_out(cls, prompts: list[LayerCache], copies: torch.Tensor, blocks: list[int], width: int,
                 capacity: int) -> LayerCache:
        """The cache of a pass: for each stream (`blocks[b]`: the row of the prompts' caches it copies), one row per
        pass row, a copy of its prompt's cache (`prompts[copies[r]]`) right-aligned to `width` slots, `capacity` slots
        in all."""
        first = prompts[0].keys
        cache = cls()
        cache.keys = first.new_zeros(len(blocks) * len(copies), first.shape[1], capacity, first.shape[3])
        cache.values = first.new_zeros(cache.keys.shape)
        for index, prompt in enumerate(prompts):
            rows = (copies == index).nonzero().squeeze(1).to(first.device)
            for block, source in enumerate(blocks):
                where = (rows + block * len(copies), slice(None), slice(width - prompt.used, width))
                cache.keys[where] = prompt.keys[source, :, : prompt.used]
                cache.values[where] = prompt.values[source, :, : prompt.used]
        cache.used = width
        return cache

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` (the slots in use are copied, the room after them is left unset)."""
        index = index.to(self.keys.device)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(len(index), *old.shape[1:])
            new[:, :, : self.used] = old[:, :, : self.used].index_select(0, index)
            setattr(self, name, new)


def cache_keyword(layer: torch.nn.Module) -> str:
    """The name a decoder layer takes its KV cache by: `cache` from transformers 5.2x on, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(layer).forward).parameters else "past_key_values"


@dataclass
class StepOutput:
    """One forward of T and D: their last-layer states at the last position (before the final norm), and the draft's
    state at the state layer at every position (None when no features are stored)."""

    target: torch.Tensor
    draft: torch.Tensor
    features: torch.Tensor | None


def stream(global_seed: int, item: WorkItem, name: str, n: int) -> torch.Tensor:
    """The first `n` uniforms of the row's stream `name` (the streams `generate` and `label_batch` draw from)."""
    return uniforms(row_generator(row_seed(global_seed, item.prompt_id, item.sample_index, name)), n)


class OnePass:
    """The one-pass labeller of a derived draft pair (module docstring)."""

    def __init__(self, target: Any, layout: Layout):
        self.target = target
        self.layout = layout
        self.decoder = target.get_decoder()
        self.layers = list(decoder_layers(target))
        self.keyword = cache_keyword(self.layers[0])
        self.device = next(target.parameters()).device

    @classmethod
    def build(cls, target: Any, draft: Any, state_layer: int | None, features: bool = True) -> OnePass | None:
        """The labeller of a derived pair whose layers attend over every earlier token and on which the probe finds
        the plain forwards' p, q and (with `features`) states at `state_layer`; None for any other pair. Raises
        `ProbeFailed` for such a pair whose probe fails: whatever the probe raises means the same, that the pass does
        not compute this model's forward, and the plain forwards are the answer either way."""
        layout = derived_layout(target, draft, state_layer, features)
        if layout is None or not plain_attention(target):
            return None
        labeller = cls(target, layout)
        try:
            with torch.no_grad():
                matches = labeller.probe(draft)
        except Exception as error:  # a layer that wants other inputs, in whatever way it says so
            detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ProbeFailed(f"its layers raised {type(error).__name__}" + (f": {detail}" if detail else "")) from error
        if not matches:
            raise ProbeFailed("its p, q or states differ from the model's own forwards")
        return labeller

    # -- the streams' forward --------------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                caches: list[LayerCache]) -> StepOutput:
        """T and D on `tokens` [B, t] at `positions` [B, t], under the boolean `mask` [B, 1, t, slots], each layer
        with its cache in `caches`."""
        hidden = self.target.get_input_embeddings()(tokens)
        rotary = self.decoder.rotary_emb(hidden, positions)
        repeated = {count: (mask.repeat(count, 1, 1, 1), positions.repeat(count, 1),
                            tuple(part.repeat(count, 1, 1) for part in rotary)) for count in (1, 2)}
        draft = features = None
        for index, layer in enumerate(self.layers):
            if index == self.layout.shared:
                draft = hidden
            runs_draft = self.layout.drafts(index)
            layer_mask, layer_positions, layer_rotary = repeated[1 + runs_draft]
            output = layer(torch.cat([hidden, draft]) if runs_draft else hidden, attention_mask=layer_mask,
                           position_ids=layer_positions, position_embeddings=layer_rotary, use_cache=True,
                           **{self.keyword: caches[index]})
            hidden, *rest = (output[0] if isinstance(output, tuple) else output).split(len(hidden))
            if runs_draft:
                draft = rest[0]
            if self.layout.depth and index == self.layout.feature_layer:
                features = draft if draft is not None else hidden
        draft = hidden if draft is None else draft  # a draft that skips only the target's last layers
        if self.layout.final_norm:
            features = self.decoder.norm(draft if features is None else features)
        return StepOutput(hidden[:, -1], draft[:, -1], features)

    def features_of(self, mixed: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    caches: list[LayerCache]) -> torch.Tensor:
        """Z: the draft's states at the state layer [B, t, h] on the mixed tokens `mixed` [B, t] at `positions`, under
        `mask` [B, 1, t, slots], its layers' caches (`z_caches` of `prefill`) in `caches`."""
        z = self.target.get_input_embeddings()(mixed)
        rotary = self.decoder.rotary_emb(z, positions)
        for cache, index in zip(caches, self.layout.feature_layers, strict=True):
            output = self.layers[index](z, attention_mask=mask, position_ids=positions, position_embeddings=rotary,
                                        use_cache=True, **{self.keyword: cache})
            z = output[0] if isinstance(output, tuple) else output
        return self.decoder.norm(z) if self.layout.final_norm else z

    def logits(self, target_states: torch.Tensor, draft_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p's and q's logits (float32) from T's and D's last-layer states: the final norm and the LM head (the pair's
        own, `output_logits`) in one batch."""
        both = output_logits(self.target, self.decoder.norm(torch.cat([target_states, draft_states])))
        return both[: len(target_states)], both[len(target_states) :]

    def prefill(self, prompts: list[list[int]], copies: torch.Tensor, steps: int
                ) -> tuple[list[LayerCache], list[LayerCache], StepOutput, torch.Tensor]:
        """Run T and D over each distinct prompt and lay the caches out for the pass's rows, left-aligned to the longest
        prompt: row r holds prompt `copies[r]`, with room for `steps` more tokens. The prompts' common beginning (a
        chat template's system prompt) is run once, then each prompt's rest on its own (no padding). Returns the pass's
        caches, Z's (one per layer of Z, a copy of D's rows, or T's where D shares T's layers: over the prompt both read
        the same tokens; none when no features are stored), the prompts' last-position output (one row per prompt) and
        which prompt slots each row attends to [rows, width]."""
        common = 0
        while common < min(len(p) for p in prompts) - 1 and len({p[common] for p in prompts}) == 1:
            common += 1
        start = [LayerCache() for _ in self.layers]
        if common:
            self.forward(torch.tensor([prompts[0][:common]], device=self.device),
                         torch.arange(common, device=self.device)[None], self.causal(common, common), start)
        outputs, kept = [], []
        for prompt in prompts:
            caches = [cache.extended(len(prompt)) for cache in start]
            rest = len(prompt) - common
            outputs.append(self.forward(torch.tensor([prompt[common:]], device=self.device),
                                        torch.arange(common, len(prompt), device=self.device)[None],
                                        self.causal(rest, len(prompt)), caches))
            kept.append(caches)
        width = max(len(p) for p in prompts)

        def laid_out(index: int, blocks: list[int]) -> LayerCache:
            return LayerCache.laid_out([caches_of[index] for caches_of in kept], copies, blocks, width, width + steps)

        caches = [laid_out(index, [0] + [1] * self.layout.drafts(index)) for index in range(len(self.layers))]
        z_caches = [laid_out(index, [int(self.layout.drafts(index))]) for index in self.layout.feature_layers]
        lengths = torch.tensor([len(p) for p in prompts], device=self.device).index_select(0, copies.to(self.device))
        valid = torch.arange(width, device=self.device) >= (width - lengths)[:, None]
        output = StepOutput(torch.cat([o.target for o in outputs]), torch.cat([o.draft for o in outputs]),
                            None if outputs[0].features is None else torch.cat([o.features[:, -1:] for o in outputs]))
        return caches, z_caches, output, valid

    def causal(self, queries: int, slots: int) -> torch.Tensor:
        """The boolean mask [1, 1, queries, slots] of the last `queries` of `slots` tokens, each seeing itself and
        every slot before it."""
        return torch.ones(queries, slots, dtype=torch.bool, device=self.device).tril(slots - queries)[None, None]

    def keep(self, caches: list[LayerCache], staying: torch.Tensor, rows: int) -> None:
        """Keep the batch rows `staying` (of `rows`) in every stream's block of every cache."""
        for index, cache in enumerate(caches):
            blocks = 1 + self.layout.drafts(index)
            cache.keep(torch.cat([staying + block * rows for block in range(blocks)]))

    # -- the probe -------------------------------------------------------------------------------------------------------

    def probe(self, draft: Any) -> bool:
        """Whether the pass gives the plain forwards' p, q and feature states (within PROBE_TOLERANCE) on two rows of
        different prompt lengths: at the prompts' last positions, and after one fed token of y (T, D) and of z (Z)."""
        token = [t % self.target.get_input_embeddings().weight.shape[0] for t in range(9)]  # ids of any vocabulary
        prompts, y, z = [token[1:4], [token[1], token[4]]], token[5:7], token[7:9]  # a common first token, then rests
        caches, z_caches, first, valid = self.prefill(prompts, torch.arange(2), 1)
        mask = torch.cat([valid, torch.ones(2, 1, dtype=torch.bool, device=self.device)], 1)[:, None, None, :]
        positions = torch.tensor([[3], [2]], device=self.device)
        second = self.forward(torch.tensor([y], device=self.device).T, positions, mask, caches)
        found = [torch.stack(pair) for pair in zip(self.logits(first.target, first.draft),
                                                   self.logits(second.target, second.draft))]
        state_layer = None if self.layout.final_norm else self.layout.depth
        expected = []
        for model in (self.target, draft):
            states = [decoder_states(model, [p + [t]], 0, self.device)[0, -2:] for p, t in zip(prompts, y)]
            expected.append(torch.stack([output_logits(model, torch.stack([s[step] for s in states])) for step in (0, 1)]))
        if self.layout.depth:
            fed = self.features_of(torch.tensor([z], device=self.device).T, positions, mask, z_caches)
            found.append(torch.stack([first.features[:, -1], fed[:, -1]]))
            mixed = [decoder_states(draft, [p + [t]], 0, self.device, state_layer)[0, -2:] for p, t in zip(prompts, z)]
            expected.append(torch.stack([torch.stack([s[step] for s in mixed]) for step in (0, 1)]))
        return all(a.shape == b.shape and float((a.float() - b.float()).abs().max())
                   <= PROBE_TOLERANCE * (float(b.abs().max()) or 1.0) for a, b in zip(found, expected))

    # -- the pass --------------------------------------------------------------------------------------------------------

    def rows_per_pass(self, items: list[WorkItem], max_new_tokens: int) -> int:
        """Rows whose KV caches (every stream's, prompt and response) fit in `KV_BUDGET` together."""
        config = self.target.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        blocks = sum(1 + self.layout.drafts(index) for index in range(len(self.layers))) + len(self.layout.feature_layers)
        per_slot = 2 * blocks * heads * head_dim * self.target.dtype.itemsize
        slots = max(len(item.prompt_ids) for item in items) + max_new_tokens + 1
        return max(1, min(len(items), KV_BUDGET // (per_slot * slots)))

    @torch.no_grad()
    def run(self, items: list[WorkItem], transform: SamplingTransform, max_new_tokens: int, global_seed: int,
            stop_ids: list[int], store_features: bool = True, storage: FeatureStorage = DEFAULT_STORAGE,
            siblings: bool = False, rows_per_pass: int | None = None) -> dict[str, list]:
        """Sample each item's response and label it: the columns `label_batch` returns for those rows, in order. The rows
        go in passes of at most `rows_per_pass` (default: all), fewer where their KV caches would exceed `KV_BUDGET`."""
        columns: dict[str, list] = {}
        start = 0
        while start < len(items):
            rows = min(rows_per_pass or len(items), self.rows_per_pass(items[start:], max_new_tokens))
            group = items[start : start + rows]
            record = self.run_group(group, transform, max_new_tokens, global_seed, stop_ids, store_features, siblings)
            for name, values in record.columns(group, storage).items():
                columns.setdefault(name, []).extend(values)
            start += len(group)
        return columns

    def run_group(self, items: list[WorkItem], transform: SamplingTransform, max_new_tokens: int, global_seed: int,
                  stop_ids: list[int], store_features: bool, siblings: bool) -> Record:
        """One pass over rows whose caches fit in memory together."""
        distinct: dict[tuple[int, ...], int] = {}
        copies = torch.tensor([distinct.setdefault(item.prompt_ids, len(distinct)) for item in items])
        caches, z_caches, prompt, valid = self.prefill([list(ids) for ids in distinct], copies, max_new_tokens + 1)
        record = Record(items, global_seed, max_new_tokens, siblings)
        on_device = copies.to(self.device)
        logits = self.logits(prompt.target.index_select(0, on_device), prompt.draft.index_select(0, on_device))
        rows = torch.arange(len(items))  # the item each batch row holds
        generating = torch.ones(len(items), dtype=torch.bool)  # per batch row: still sampling its response
        prompt_lengths = torch.tensor([len(item.prompt_ids) for item in items], device=self.device)
        prompt_valid = valid
        stop = torch.tensor(stop_ids, dtype=torch.long)
        for step in range(1, max_new_tokens + 1):
            live = generating.nonzero().squeeze(1)
            tokens = record.label(step, rows[live], logits, transform)
            fed = torch.zeros(len(rows), dtype=torch.long)
            fed[live] = tokens
            mask = torch.cat([valid, torch.ones(len(rows), caches[0].used + 1 - valid.shape[1], dtype=torch.bool,
                                                device=self.device)], 1)[:, None, None, :]
            positions = (prompt_lengths[rows.to(self.device)] + step - 1).unsqueeze(1)
            output = self.forward(fed[:, None].to(self.device), positions, mask, caches)
            generating[live[torch.isin(tokens, stop) | (step == max_new_tokens)]] = False
            if not generating.any():
                break
            staying = generating.nonzero().squeeze(1)
            on_device = staying.to(self.device)
            logits = self.logits(output.target.index_select(0, on_device), output.draft.index_select(0, on_device))
            if (len(rows) - len(staying)) * (max_new_tokens - step) >= DROP_AFTER:
                self.keep(caches, on_device, len(rows))
                rows, generating, valid = rows[staying], generating[staying], valid.index_select(0, on_device)
        if store_features:
            steps = int(record.lengths.max())
            mixed = record.tokens["mixed_ids"][:steps].T.to(self.device)  # a row's slots after its end are never read
            positions = prompt_lengths[:, None] + torch.arange(steps, device=self.device)
            mask = torch.cat([prompt_valid.unsqueeze(1).expand(-1, steps, -1),
                              self.causal(steps, steps)[0].expand(len(items), -1, -1)], 2)[:, None]
            record.keep_features(prompt.features[:, -1].index_select(0, copies.to(self.device)),
                                 self.features_of(mixed, positions, mask, z_caches))
        return record


class Record:
    """Each row's responses and labels as the pass makes them: one [steps, rows] tensor per column (position i − 1 of
    a row in row i − 1 of the tensor), and the feature states [steps + 1, rows, h]."""

    def __init__(self, items: list[WorkItem], global_seed: int, steps: int, siblings: bool):
        rows = len(items)
        self.ratios = torch.tensor([item.target_ratio for item in items], dtype=torch.float64)
        self.response_draws = torch.stack([stream(global_seed, item, "response", steps) for item in items])
        self.label_draws = torch.stack([stream(global_seed, item, "label", steps) for item in items])
        self.sibling_draws = (torch.stack([stream(global_seed, item, "sibling", steps) for item in items])
                              if siblings else None)
        self.mixing = torch.stack([mixing_draws(global_seed, item, steps) for item in items])
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.tokens: dict[str, torch.Tensor] = {name: torch.zeros(steps, rows, dtype=torch.long) for name in
                                                ("target_ids", "draft_ids", "mixed_ids", *SIBLING_COLUMNS[: int(siblings)])}
        self.flags = torch.zeros(steps, rows, dtype=torch.bool)
        names = ("logp", "logq", "accept", "beta", "entropy", "top1", "top2", *(SIBLING_COLUMNS[1:] if siblings else ()))
        self.values: dict[str, torch.Tensor] = {name: torch.zeros(steps, rows) for name in names}
        self.features: torch.Tensor | None = None
        self.steps = steps

    def keep_features(self, prompt: torch.Tensor, response: torch.Tensor) -> None:
        """The feature states of every row: at the prompt's last token [rows, h], and after z_1 .. z_t [rows, t, h]."""
        self.features = torch.zeros(self.steps + 1, len(self.lengths), prompt.shape[-1])
        self.features[0] = prompt.float().cpu()
        self.features[1 : response.shape[1] + 1] = response.transpose(0, 1).float().cpu()

    def label(self, step: int, rows: torch.Tensor, logits: tuple[torch.Tensor, torch.Tensor],
              transform: SamplingTransform) -> torch.Tensor:
        """Sample position `step` of `rows` from p, label it from p and q and mix it; returns y of those rows."""
        p_logits, q_logits = logits
        logp_all, logq_all = transform.log_probs(p_logits), transform.log_probs(q_logits)
        index = step - 1
        tokens = draw_from_log_probs(logp_all, self.response_draws[rows, index]).cpu()
        labels = labels_from_log_probs(logp_all, logq_all, q_logits, transform, self.label_draws[rows, index],
                                       None if self.sibling_draws is None else self.sibling_draws[rows, index])
        mixed, is_draft = mix_tokens(tokens, labels.draft_ids, self.ratios[rows], self.mixing[rows, index])
        self.lengths[rows] = step
        made = {"target_ids": tokens, "mixed_ids": mixed}
        for name, values in self.tokens.items():
            values[index, rows] = made[name] if name in made else getattr(labels, name)
        self.flags[index, rows] = is_draft
        for name, values in self.values.items():
            values[index, rows] = getattr(labels, name).float()
        return tokens

    def columns(self, items: list[WorkItem], storage: FeatureStorage) -> dict[str, list]:
        """The rows' columns, as `label_batch` returns them."""
        columns: dict[str, list] = {"prompt_id": [i.prompt_id for i in items], "sample_index": [i.sample_index for i in items],
                                    "target_ratio": [i.target_ratio for i in items],
                                    "prompt_ids": [list(i.prompt_ids) for i in items]}
        lengths = self.lengths.tolist()
        for name, values in self.tokens.items():  # the response and its mix as lists, the candidates as arrays
            columns[name] = [values[:n, row].tolist() if name in ("target_ids", "mixed_ids") else values[:n, row].numpy()
                             for row, n in enumerate(lengths)]
        columns["is_draft"] = [self.flags[:n, row].tolist() for row, n in enumerate(lengths)]
        for name, values in self.values.items():
            columns[name] = [values[:n, row].numpy() for row, n in enumerate(lengths)]
        for row, item in enumerate(items):
            refuse_bad_labels({name: columns[name][row] for name in self.values}, item)
        if self.features is not None:
            states = [self.features[: n + 1, row] for row, n in enumerate(lengths)]
            if storage.at != "all":
                states = [s[torch.from_numpy(storage.rows(np.asarray(flags)))] for s, flags in zip(states, columns["is_draft"])]
            columns["features"] = [storage.encode(s) for s in states]
        return columns
