"""One KV cache per model for B rows of different lengths (the round engine's caches; B = 1 is a case).

Both models keep one KV cache for the batch and a mask of the slots each row may attend to. A step feeds each row
its own tokens, right-padded with masked slots, at the row's own positions; a row that rejects candidates masks
their slots instead of cropping (the common tail no row needs is cropped). A row that finishes is masked out of
later forwards. Every forward is timed and counted, per row and per batch.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specheads.model_outputs.signals import output_logits
from specheads.model_outputs.states import cache_argument, decoder_forward, returned_cache


def pick(tensor: torch.Tensor, rows: list[int], columns: list[int]) -> torch.Tensor:
    """`tensor[rows, columns]`, the index built on the tensor's own device (a split model's states are on its last
    shard's, not its first parameter's)."""
    return tensor[torch.tensor(rows, device=tensor.device), torch.tensor(columns, device=tensor.device)]


class BatchCache:
    """A causal LM with one KV cache for B rows of different lengths: per-row slots, positions and a slot mask."""

    def __init__(self, model: Any, rows: int, state_layer: int | None = None):
        self.model = model
        self.state_layer = state_layer
        self.cache_argument = cache_argument(model)
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=self.device)
        self.slots: list[list[int]] = [[] for _ in range(rows)]  # each row's cache slot per token it holds
        self.forwards = [0] * rows  # the forwards each row took part in
        self.passes = 0  # forward passes of the whole batch
        self.forward_seconds = 0.0
        layers = getattr(DynamicCache(config=model.config), "layers", None)
        self.plain_config = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds (the position of its next token)."""
        return [len(slots) for slots in self.slots]

    def length(self, row: int) -> int:
        """Tokens `row` holds."""
        return len(self.slots[row])

    def can_draft(self, row: int) -> bool:
        """Whether the row may draft this round (a draft that reads the target's states waits for its first call)."""
        return True

    def draft_limit(self) -> int | None:
        """The most candidates one round may draft (a block drafter's block); None: no limit of the draft's own."""
        return None

    def drafter_score(self, row: int) -> float | None:
        """The draft's own prediction that the candidate it last proposed for `row` is accepted, made before that
        candidate was drawn (a DSpark drafter's confidence head); None for a draft that makes none."""
        return None

    def drafter_score_scaled(self, row: int) -> float | None:
        """`drafter_score` through the draft's per-position temperatures (a DSpark drafter's, where given); None for a
        draft that makes no score or was given no temperatures."""
        return None

    def markov_embedding(self, row: int) -> torch.Tensor | None:
        """The draft's Markov embedding [R] of the token before the candidate it last proposed for `row` (a DSpark
        drafter's `markov_w1[token]`, what its confidence head reads beside the state); None for a draft without one."""
        return None

    def round_widths(self, unread: int, drafted: int) -> list[int]:
        """The tokens each draft forward of a round that drafted `drafted` candidates read: its catch-up (`unread`,
        the tokens it had not read) first, then one a candidate (the last candidate's forward is never run)."""
        return [unread] + [1] * (drafted - 1) if drafted else []

    @torch.no_grad()
    def feed(self, tokens: dict[int, list[int]], logits_rows: dict[int, int] | None = None
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Extend the rows in `tokens` by their tokens (other rows feed a masked pad); per fed row, the float32 logits
        and `state_layer` states of its last `logits_rows[row]` (default 1) tokens."""
        start = time.perf_counter()
        rows, width = len(self.slots), max(len(t) for t in tokens.values())
        used = self.mask.shape[1]
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        new_mask = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        for row, fed in tokens.items():
            length = self.length(row)
            input_ids[row, : len(fed)] = torch.tensor(fed)
            new_mask[row, : len(fed)] = 1
            positions[row] = torch.arange(length, length + width).clamp_max(length + len(fed) - 1)
            self.slots[row].extend(range(used, used + len(fed)))
            self.forwards[row] += 1
        self.mask = torch.cat([self.mask, new_mask.to(self.device)], dim=1)
        output, states = decoder_forward(self.model, self.state_layer, input_ids=input_ids.to(self.device),
                                         attention_mask=self.mask, position_ids=positions.to(self.device),
                                         use_cache=True, **{self.cache_argument: self.cache})
        self.cache = returned_cache(output)
        wanted = {row: (logits_rows or {}).get(row, 1) for row in tokens}
        index = [(row, position) for row, fed in tokens.items() for position in range(len(fed) - wanted[row], len(fed))]
        rows_at, columns_at = [r for r, _ in index], [c for _, c in index]
        logits = output_logits(self.model, pick(output.last_hidden_state, rows_at, columns_at))
        picked = pick(states, rows_at, columns_at)
        result, offset = {}, 0
        for row in tokens:
            result[row] = (logits[offset : offset + wanted[row]], picked[offset : offset + wanted[row]])
            offset += wanted[row]
        self.passes += 1
        self.forward_seconds += time.perf_counter() - start
        return result

    def feed_tree(self, tokens: list[int], positions: list[int], sees: list[list[int]], logits_from: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """`feed_trees` for row 0 alone: the float32 logits and states of the tokens from `logits_from` on, and the
        slots all took."""
        return self.feed_trees({0: (tokens, positions, sees)}, {0: logits_from})[0]

    @torch.no_grad()
    def feed_trees(self, trees: dict[int, tuple[list[int], list[int], list[list[int]]]],
                   logits_from: dict[int, int] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]]:
        """One forward over tokens the rows do not hold yet (draft trees' nodes, or the tokens tree rounds verify),
        for each row in `trees` its (tokens, positions, sees): token i sits at `positions[i]` and attends to the row's
        held slots, to the slots `sees[i]` (its ancestors, fed earlier or earlier in this call) and to itself, through
        a 4D mask; other rows and the padding attend to nothing else. Per row: the float32 logits and `state_layer`
        states of its tokens from `logits_from[row]` (default 0) on, and the slots all its tokens took; `hold` makes
        some of them the row's, the others stay masked and `trim` drops them."""
        start = time.perf_counter()
        rows, used = len(self.slots), self.mask.shape[1]
        width = max(len(tokens) for tokens, _, _ in trees.values())
        allowed = torch.zeros(rows, width, used + width, dtype=torch.bool, device=self.device)
        columns = torch.arange(width, device=self.device)
        allowed[:, columns, used + columns] = True  # every query sees itself (no empty row)
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        for row, (tokens, at, sees) in trees.items():
            allowed[row, : len(tokens), :used] = self.mask[row].bool()
            for index, seen in enumerate(sees):
                allowed[row, index, seen] = True
            input_ids[row, : len(tokens)] = torch.tensor(tokens)
            positions[row, : len(tokens)] = torch.tensor(at)
            self.forwards[row] += 1
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        mask = torch.zeros(rows, 1, width, used + width, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        self.mask = torch.cat([self.mask, torch.zeros(rows, width, dtype=torch.long, device=self.device)], dim=1)
        output, states = decoder_forward(self.model, self.state_layer, input_ids=input_ids.to(self.device),
                                         attention_mask=mask, position_ids=positions.to(self.device),
                                         use_cache=True, **{self.cache_argument: self.cache})
        self.cache = returned_cache(output)
        result = {}
        for row, (tokens, _, _) in trees.items():
            first = (logits_from or {}).get(row, 0)
            result[row] = (output_logits(self.model, output.last_hidden_state[row, first : len(tokens)]),
                           states[row, first : len(tokens)], list(range(used, used + len(tokens))))
        self.passes += 1
        self.forward_seconds += time.perf_counter() - start
        return result

    def hold(self, row: int, slots: list[int]) -> None:
        """Make slots `feed_tree` took the row's next tokens, in order (a tree round's accepted path)."""
        self.slots[row].extend(slots)
        self.mask[row, slots] = 1

    def crop_row(self, row: int, length: int) -> None:
        """Forget `row`'s tokens beyond `length`: their slots are masked for every later query."""
        dropped = self.slots[row][length:]
        if dropped:
            self.mask[row, dropped] = 0
            del self.slots[row][length:]

    def trim(self) -> None:
        """Crop the cache's tail of slots no row attends to any more, and compact it once most of its slots are masked
        (a row that took a new request masks the old one's slots; without this, attention would run over every request
        a row has served)."""
        needed = max((slots[-1] + 1 for slots in self.slots if slots), default=0)
        extra = self.mask.shape[1] - needed
        if extra > 0 and self.cache is not None:
            self.cache.crop(-extra)
            self.mask = self.mask[:, :needed]
        if self.cache is not None and max(self.lengths, default=0) * 2 < self.mask.shape[1]:
            self.compact()

    def plain_layers(self) -> bool:
        """Whether the cache is one [B, heads, slots, dim] tensor per layer, the layout `compact`, `snapshot` and `load`
        rewrite (sliding-window and recurrent caches are left alone); before the first forward, whether the model's
        config gives that layout."""
        if self.cache is None:
            return self.plain_config
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)

    def snapshot(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, a copy of the keys and values of `row`'s first `length` tokens, [heads, length, dim] each."""
        index = torch.tensor(self.slots[row][:length], dtype=torch.long)
        return [(layer.keys[row].index_select(1, index.to(layer.keys.device)),  # copies, on the layer's device
                 layer.values[row].index_select(1, index.to(layer.values.device)))
                for layer in self.cache.layers]

    def load(self, stored: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Give each row of `stored`, which holds nothing, the tokens of a `snapshot` as new slots, without a forward,
        all in one extension of the cache (their keys keep the positions they were computed at, 0 onwards, as
        `compact` relies on)."""
        lengths = {row: layers[0][0].shape[1] for row, layers in stored.items()}
        rows, used, width = len(self.slots), self.mask.shape[1], max(lengths.values())
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        first = next(iter(stored.values()))
        for index in range(len(first)):
            keys, values = (first[index][part].new_zeros(rows, first[index][part].shape[0], width,
                                                         first[index][part].shape[2]) for part in (0, 1))
            for row, layers in stored.items():
                keys[row, :, : lengths[row]], values[row, :, : lengths[row]] = layers[index]
            self.cache.update(keys, values, index)
        new_mask = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for row, length in lengths.items():
            new_mask[row, :length] = 1
            self.slots[row] = list(range(used, used + length))
        self.mask = torch.cat([self.mask, new_mask], dim=1)

    def compact(self) -> None:
        """Move each row's slots to the front of the cache, in order (keys keep the positions they were computed at,
        since every feed passes positions explicitly)."""
        if not self.plain_layers():
            return  # a cache of another layout (sliding, recurrent): left as it is
        layers = self.cache.layers
        width = max(self.lengths)
        index = torch.zeros(len(self.slots), width, dtype=torch.long)
        mask = torch.zeros(len(self.slots), width, dtype=torch.long)
        for row, slots in enumerate(self.slots):
            index[row, : len(slots)] = torch.tensor(slots, dtype=torch.long)
            mask[row, : len(slots)] = 1
        for layer in layers:  # each layer's keys on its own device (a split model's)
            gather = index.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        self.mask = mask.to(self.device)
        self.slots = [list(range(len(slots))) for slots in self.slots]
