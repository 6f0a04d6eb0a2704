"""Responses from vLLM's offline engine (`--responses-engine vllm`), then labelled as usual.

The adapter is three separate steps, so that each can be checked without vLLM (tests/test_responses_fast.py runs
them against a fake engine):
  1. `build_requests`: per row, the chat-templated prompt's token ids (`{"prompt_token_ids": ...}`, vLLM's
     TokensPrompt) and the SamplingParams fields: the run's transform (temperature, top-k, top-p; T = 0 greedy),
     `max_tokens` = max_new_tokens, the model's stop ids, and the row's own seed (the `response` stream of
     `plan.row_seed`, the built-in engine's seed too);
  2. `LLM.generate(prompts, [SamplingParams(**fields), ...])`, in a separate process, so that vLLM's GPU memory
     is given back before labelling starts;
  3. `parse_output`: the completion's token ids, ending with the stop token when vLLM stopped on one (finish
     reason `stop`) and cut at max_new_tokens (`length`), as the built-in engine's responses end.

The rows then carry the responses as imported ones do and are labelled by the teacher-forced passes, so they look
exactly like rows of the built-in engine. They are not the same samples: vLLM draws from each row's seed with
its own generator and kernels, so a row's response is reproducible under vLLM (same seed, version and hardware;
vLLM does not promise batch invariance) but differs from the built-in engine's response for the same seed. The
data fingerprint records the engine.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from specheads.data_gen.config import GenConfig
from specheads.data_gen.plan import Shard, WorkItem, row_seed
from specheads.dataset.shards import shard_problem
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, cut_at_stop, resolve_source, stop_token_ids
from specheads.plumbing.errors import UsageError

INSTALL = "pip install 'specheads[vllm]'"


def require_vllm() -> None:
    """Refuse, in one line, a vLLM run where vLLM is not installed (found without importing it)."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(f"--responses-engine vllm needs vLLM, which is not installed here; {INSTALL} on a CUDA machine, "
                         "or drop the flag to generate with the built-in engine")


def sampling_fields(transform: SamplingTransform, max_new_tokens: int, seed: int, stop_ids: list[int]) -> dict[str, Any]:
    """vLLM SamplingParams fields for one row: the run's transform and length, the row's seed, nothing else that
    would reshape the distribution (penalties off, no minimum length)."""
    return {
        "n": 1, "temperature": float(transform.temperature), "top_k": transform.top_k or -1, "top_p": float(transform.top_p),
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "max_tokens": max_new_tokens, "min_tokens": 0, "seed": seed, "stop_token_ids": list(stop_ids),
        "ignore_eos": False, "detokenize": False,
    }


def build_requests(items: list[WorkItem], global_seed: int, transform: SamplingTransform, max_new_tokens: int,
                   stop_ids: list[int]) -> list[tuple[dict, dict]]:
    """(TokensPrompt, SamplingParams fields) per row, in the rows' order."""
    return [({"prompt_token_ids": list(item.prompt_ids)},
             sampling_fields(transform, max_new_tokens, row_seed(global_seed, item.prompt_id, item.sample_index, "response"),
                             stop_ids))
            for item in items]


def parse_output(output: Any, item: WorkItem, stop_ids: list[int], max_new_tokens: int) -> list[int]:
    """A RequestOutput's response ids, ending as the built-in engine's do: with the stop token when generation
    stopped on one, cut after the first stop token and at max_new_tokens."""
    if list(output.prompt_token_ids) != list(item.prompt_ids):
        raise RuntimeError(f"vLLM answered another prompt in place of {item.prompt_id!r} (outputs out of order)")
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM did not finish the response to {item.prompt_id!r} (finish reason "
                           f"{completion.finish_reason!r})")
    if completion.finish_reason == "stop" and not (tokens and tokens[-1] in stop_ids):
        stop = getattr(completion, "stop_reason", None)
        tokens.append(stop if isinstance(stop, int) else stop_ids[0])
    tokens = cut_at_stop(tokens, stop_ids)[:max_new_tokens]
    if not tokens:
        raise RuntimeError(f"vLLM gave an empty response to {item.prompt_id!r}")
    return tokens


def generate_with(llm: Any, make_params: Callable[..., Any], items: list[WorkItem], global_seed: int,
                  transform: SamplingTransform, max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """Every row's response from `llm.generate` (vLLM's LLM, or anything with its offline API)."""
    requests = build_requests(items, global_seed, transform, max_new_tokens, stop_ids)
    outputs = llm.generate([prompt for prompt, _ in requests], [make_params(**fields) for _, fields in requests],
                           use_tqdm=False)
    if len(outputs) != len(items):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(items)} prompts")
    return [parse_output(output, item, stop_ids, max_new_tokens) for output, item in zip(outputs, items)]


def default_memory_share() -> dict[str, float]:
    """vLLM's `gpu_memory_utilization` (a share of the whole GPU) sized to 90 % of the memory free now, so that
    vLLM starts beside whatever this process holds; nothing off CUDA. `generation.vllm_args` overrides it."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_memory_utilization": round(0.9 * free / total, 3)}


def engine_arguments(spec: ModelSpec, extra: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for the target: its weights, tokenizer, revision and dtype, then `extra`."""
    if spec.skip_layers:
        raise UsageError("--responses-engine vllm serves the target as it is stored; target.skip_layers has no "
                         "vLLM equivalent: drop it or use the built-in engine")
    source = resolve_source(spec)
    if source.gguf_file and not source.is_local:
        raise UsageError(f"vLLM reads GGUF files from disk only; download {spec.path}/{spec.gguf_file} and give its path")
    model = str(Path(source.location) / source.gguf_file) if source.gguf_file else source.location
    return {"model": model, "tokenizer": source.location, "revision": source.revision, "dtype": spec.dtype, "seed": 0,
            **extra}


def run_vllm(arguments: dict[str, Any], items: list[WorkItem], global_seed: int, transform: SamplingTransform,
             max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """Start vLLM and generate every row's response (runs in the child process of `vllm_responses`)."""
    from vllm import LLM, SamplingParams

    return generate_with(LLM(**arguments), SamplingParams, items, global_seed, transform, max_new_tokens, stop_ids)


def vllm_responses(arguments: dict[str, Any], items: list[WorkItem], global_seed: int, transform: SamplingTransform,
                   max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """`run_vllm` in a fresh (spawned) process: its GPU memory is all free again when it returns."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_vllm, arguments, items, global_seed, transform, max_new_tokens, stop_ids).result()


def pending_rows(shards: list[Shard], out: Path, run: str) -> list[WorkItem]:
    """The rows of the shards not yet written and verified (what a resumed run still has to label)."""
    return [item for shard in shards if shard_problem(out, shard.index, run, None, deep=True) is not None
            for items in shard.batches for item in items]


def with_responses(shards: list[Shard], responses: dict[tuple[str, int], list[int]]) -> list[Shard]:
    """The shards with each row that has a response in `responses` (by prompt id and sample) carrying it."""
    def attach(item: WorkItem) -> WorkItem:
        response = responses.get((item.prompt_id, item.sample_index))
        return item if response is None else replace(item, response_ids=tuple(response))

    return [Shard(shard.index, [[attach(item) for item in items] for items in shard.batches]) for shard in shards]


def shards_with_vllm_responses(config: GenConfig, target: Any, tokenizer: Any, shards: list[Shard], out: Path,
                               run: str) -> list[Shard]:
    """Generate with vLLM the responses of every row still to label and attach them to the shards."""
    rows = pending_rows(shards, out, run)
    if not rows:
        return shards
    print(f"specheads gen: generating {len(rows)} responses with vLLM", file=sys.stderr)
    arguments = engine_arguments(config.target, {**default_memory_share(), **config.generation.vllm_args})
    generated = vllm_responses(arguments, rows, config.seed, config.sampling.transform(), config.sampling.max_new_tokens,
                               stop_token_ids(target, tokenizer))
    return with_responses(shards, {(item.prompt_id, item.sample_index): ids for item, ids in zip(rows, generated)})
