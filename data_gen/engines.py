"""The built-in response engine: transformers' `generate` on the target, batched to the device's memory.

A shard's rows arrive sorted by prompt length, longest first (the plan sorts them), so consecutive rows form a
`generate` call with little left padding: that is the length bucketing. With a static KV cache the cache length
is bucketed too (`responses.CACHE_BUCKET`).

Which response a row gets does not depend on any setting here: every row draws from its own generator
(`responses.RowSeededSampler`), so the batch a row sits in, the cache kind and compilation leave its draws alone.
What they can change is arithmetic: another batch size pads differently, a static cache attends over more
(masked) positions, a compiled step fuses kernels, bf16 rounds. The logits then differ in their last bits, and a
draw changes only where its uniform falls within that rounding of a boundary of the cumulative distribution (for
T = 0: where the two best logits tie within it). On the tiny test model in float32 the rows are identical with
and without the fast path (tests/test_responses_fast.py), and a given config on given hardware always gives the
same rows. The settings are recorded in the manifest's config but are not part of the data fingerprint: a run
resumed with other settings keeps the shards it has.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from specheads.data_gen.config import GenerationOptions
from specheads.data_gen.plan import WorkItem, row_seed
from specheads.data_gen.responses import generate_responses, static_cache_length
from specheads.model_outputs.sampling import SamplingTransform

LOGIT_COPIES = 8
"""Float32 [rows, vocab] tensors alive at once in one decoding step: the logits, their float32 copy, the
transform's temporaries (two more with top-p's sort), the CDF and the sampler's one-hot scores."""


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of KV cache one token costs in `model` (keys and values of every layer, in the model's dtype)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


def row_bytes(model: Any, prompt_width: int, cache_tokens: int) -> int:
    """Device memory one row of a `generate` call needs, beside the weights: its KV cache, its share of the
    prefill's activations (one layer's at a time, plus a row of attention scores per head in case the attention
    kernel materialises them) and the decoding step's vocabulary-sized workspace."""
    config = model.config.get_text_config(decoder=True)
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_prompt_token = model.dtype.itemsize * (4 * hidden + 2 * intermediate) + 4 * config.num_attention_heads * prompt_width
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return cache_tokens * kv_bytes_per_token(model) + prompt_width * per_prompt_token + LOGIT_COPIES * 4 * vocab


def free_device_bytes(device: torch.device) -> int | None:
    """Memory a CUDA device can still give this process (free plus what PyTorch holds unused); None elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def rows_that_fit(budget: int, per_row: int) -> int:
    """Rows of `per_row` bytes within `budget`: at least one, a multiple of 8 from 8 up (fewer distinct batch
    shapes for a compiled step to meet)."""
    rows = budget // per_row
    return max(1, rows // 8 * 8 if rows >= 8 else rows)


@dataclass
class BuiltinEngine:
    """Responses from the target with `generate`: the settings of `GenerationOptions`, the run's sampling."""

    tokenizer: Any
    transform: SamplingTransform
    max_new_tokens: int
    seed: int
    options: GenerationOptions = field(default_factory=GenerationOptions)
    cap: int | None = None  # rows per call after running out of memory

    def responses(self, model: Any, items: list[WorkItem], device: torch.device, batch_size: int) -> list[list[int]]:
        """Each item's response: its imported one, else one generated in calls of at most `batch_size` rows unless
        `options.batch_size` says otherwise."""
        missing = [item for item in items if item.response_ids is None]
        generated = iter(self.generate_all(model, missing, device, batch_size))
        return [list(item.response_ids) if item.response_ids is not None else next(generated) for item in items]

    def generate_all(self, model: Any, items: list[WorkItem], device: torch.device, batch_size: int) -> list[list[int]]:
        """Generate in consecutive calls; a call that runs out of GPU memory is retried at half the rows."""
        responses: list[list[int]] = []
        while len(responses) < len(items):
            pending = items[len(responses):]
            rows = pending[: self.rows_per_call(model, pending, device, batch_size)]
            try:
                responses += self.generate(model, rows, device)
                continue
            except torch.cuda.OutOfMemoryError:
                if len(rows) == 1:
                    raise
            self.cap = len(rows) // 2
            torch.cuda.empty_cache()
            print(f"specheads gen: out of GPU memory generating {len(rows)} rows at once; going on with {self.cap}",
                  file=sys.stderr)
        return responses

    def rows_per_call(self, model: Any, pending: list[WorkItem], device: torch.device, batch_size: int) -> int:
        """Rows for the next `generate` call: the configured number, or what fits in memory (`auto`)."""
        setting = self.options.batch_size
        if setting == "auto":
            rows = self.rows_in_memory(model, pending, device) or batch_size
        else:
            rows = batch_size if setting is None else setting
        return max(1, min(rows, self.cap or rows, len(pending)))

    def rows_in_memory(self, model: Any, pending: list[WorkItem], device: torch.device) -> int | None:
        """How many rows the free device memory holds at the longest pending prompt (None off CUDA)."""
        free = free_device_bytes(device)
        if free is None:
            return None
        width = max(len(item.prompt_ids) for item in pending)
        cache = static_cache_length(width, self.max_new_tokens) if self.options.cache == "static" else width + self.max_new_tokens
        return rows_that_fit(int(free * self.options.memory_fraction), row_bytes(model, width, cache))

    def generate(self, model: Any, rows: list[WorkItem], device: torch.device) -> list[list[int]]:
        """One `generate` call over `rows` with the rows' own seeds."""
        seeds = [row_seed(self.seed, item.prompt_id, item.sample_index, "response") for item in rows]
        return generate_responses(model, self.tokenizer, rows, self.transform, self.max_new_tokens, seeds, device,
                                  self.options.cache, self.options.compile)
