"""vLLM's price of a verify on this CPU (issue 72): the seconds of an engine step against the tokens it runs, read in
vLLM itself, so that our proposer's planner (`token_cost`: one more verified token in one-token-step units, cost(n) =
1 + token_cost · (n − 1)) prices vLLM's steps and not our decoder's.

One engine serves the DEV prompts (never the confirm ones) with our proposer and no head at K (every row verifies its
whole prompt-lookup proposal up to K, so the steps' sizes spread from B to B · (K + 1)), at T = 0, B at once. Each call
of the scheduler's `schedule` is timed to the next one: one whole engine step (schedule, forward, rejection, the
proposer, output processing), with the tokens it scheduled. Only decode steps count (no prompt chunk: every row runs
1 + its draft's tokens). The first step of a size builds oneDNN's matmul primitives for it (vLLM's CPU linear keeps 32
sizes a weight shape, process-wide): at B = 1 sizes recur and `--drop-first-of-size` fits the steady steps only; at
B > 1 a step's size rarely recurs, so serving pays that build and every decode step is fitted. The first steps' mean
extra seconds over the line are reported either way. A least-squares line
seconds = a + b · tokens over those steps gives, for B rows, a row's one-token step a / B + b and one more verified
token b, so token_cost = b · B / (a + b · B), with a 95 % interval from 400 bootstrap resamples of the steps.

    TARGET=$(.venv/bin/python -c "from specheads.pair.embedded import embedded_folder; print(embedded_folder())")
    LD_PRELOAD=.vllm-env/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \
    VLLM_USE_V2_MODEL_RUNNER=0 PYTHONPATH=. .vllm-env/bin/python benchmarks/vllm_verify_cost.py --target $TARGET \
        --batch 1 --k 32 --prompts 6 --max-new-tokens 48 --drop-first-of-size --out runs/vllm-lookup2/verify-cost-b1.json

The JSON holds the fit, `token_cost` (at `--batch`) and `token_cost_at` (the same line read at B = 1, 8, 32), the
steps themselves and the command's settings; `vllm_lookup.py --cost-from` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_anchor  # noqa: E402  (the same folder: its serving copy and stop ids)
import vllm_lookup  # noqa: E402  (the same folder: the prompts and our proposer's engine arguments)

DEV_PROMPTS = Path(__file__).resolve().parent / "prompts" / "lookup-dev.jsonl"
READ_AT = (1, 8, 32)
"""The batch sizes `token_cost_at` reads the fitted line at."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before vLLM is imported: a bad one ends in one line."""
    parser = argparse.ArgumentParser(description="vLLM (CPU): the seconds of a step against the tokens it verifies.")
    parser.add_argument("--target", required=True, help="the target's transformers folder")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=32, help="our proposer's K (no head: the whole proposal up to K)")
    parser.add_argument("--prompt-file", default=str(DEV_PROMPTS))
    parser.add_argument("--prompts", type=int, default=6, help="the first N prompts of the file")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default="runs/vllm-lookup2/verify-cost-b1.json")
    parser.add_argument("--work", default="runs/vllm", help="where the target's copy for vLLM goes")
    parser.add_argument("--drop-first-of-size", action="store_true", help="fit only steps of a size seen before")
    args = parser.parse_args(argv)
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"vllm_verify_cost.py: error: --target {args.target} holds no config.json; give the target's "
                         "transformers folder")
    if "confirm" in Path(args.prompt_file).name:
        raise SystemExit(f"vllm_verify_cost.py: error: --prompt-file {args.prompt_file} is a confirm set; price the "
                         "verify on the dev prompts")
    if min(args.batch, args.k, args.prompts, args.max_new_tokens) < 1:
        raise SystemExit("vllm_verify_cost.py: error: --batch, --k, --prompts and --max-new-tokens must be at least 1")
    return args


def decode_only(scheduled: Any) -> bool:
    """Whether a `SchedulerOutput` runs decode rows only: no new request, every row 1 + its draft's tokens."""
    spec = scheduled.scheduled_spec_decode_tokens
    return not scheduled.scheduled_new_reqs and all(
        count == 1 + len(spec.get(request, ())) for request, count in scheduled.num_scheduled_tokens.items())


class StepClock:
    """Wraps a scheduler's `schedule`: the time each step began, its scheduled tokens and rows, decode only or not."""

    def __init__(self, scheduler: Any) -> None:
        self.entries: list[tuple[float, int, int, bool]] = []
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            scheduled = original(*args, **kwargs)
            self.entries.append((began, int(scheduled.total_num_scheduled_tokens),
                                 len(scheduled.num_scheduled_tokens), decode_only(scheduled)))
            return scheduled

        scheduler.schedule = schedule

    def take(self) -> list[tuple[float, int, int, bool]]:
        """The entries since the last take."""
        taken, self.entries = self.entries, []
        return taken


def timed_steps(entries: list[tuple[float, int, int, bool]]) -> list[dict[str, Any]]:
    """Each step of one `generate` call timed to the next step's start (the last, untimed, dropped); steps that
    scheduled nothing are left out."""
    steps = []
    for (began, tokens, rows, decode), (following, *_) in zip(entries, entries[1:]):
        if tokens:
            steps.append({"tokens": tokens, "rows": rows, "decode": decode, "seconds": following - began})
    return steps


def line(tokens: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """Least squares seconds = a + b · tokens: (a, b)."""
    slope, intercept = np.polyfit(tokens, seconds, 1)
    return float(intercept), float(slope)


def token_cost(intercept: float, slope: float, batch: int) -> float:
    """One more verified token in units of a row's one-token step at `batch` rows (module docstring)."""
    return slope * batch / (intercept + slope * batch)


def fit_cost(steps: list[dict[str, Any]], batch: int, drop_first: bool, resamples: int = 400) -> dict[str, Any]:
    """The verify line over the decode steps (`drop_first`: of a size seen before only), its token cost at `batch`
    and at `READ_AT`, a bootstrap 95 % interval, and the mean extra seconds of a size's first step over the line."""
    seen: set[int] = set()
    warm, first = [], []
    for step in (s for s in steps if s["decode"]):
        (warm if step["tokens"] in seen else first).append(step)
        seen.add(step["tokens"])
    if not drop_first:
        warm = warm + first
    if len({s["tokens"] for s in warm}) < 2:
        raise SystemExit("vllm_verify_cost.py: error: fewer than two step sizes to fit; serve more prompts "
                         "(--prompts) or longer (--max-new-tokens)")
    tokens = np.array([s["tokens"] for s in warm], dtype=float)
    seconds = np.array([s["seconds"] for s in warm])
    intercept, slope = line(tokens, seconds)
    rng = np.random.default_rng(0)
    costs = []
    for _ in range(resamples):
        pick = rng.integers(0, len(warm), len(warm))
        if len(set(tokens[pick])) > 1:
            costs.append(token_cost(*line(tokens[pick], seconds[pick]), batch))
    residual = [s["seconds"] - (intercept + slope * s["tokens"]) for s in first]
    return {"batch": batch, "intercept_s": round(intercept, 5), "per_token_s": round(slope, 6),
            "token_cost": round(token_cost(intercept, slope, batch), 4),
            "token_cost_interval": [round(float(q), 4) for q in np.quantile(costs, [0.025, 0.975])],
            "token_cost_at": {str(b): round(token_cost(intercept, slope, b), 4) for b in READ_AT},
            "steps_fitted": len(warm), "sizes_fitted": [int(tokens.min()), int(tokens.max())], "drop_first": drop_first,
            "first_of_size_steps": len(first),
            "first_of_size_extra_s": round(float(np.mean(residual)), 4) if residual else None}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Serve the prompts `--batch` at a time with our proposer (no head, K) and time every engine step."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine, and its scheduler, in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM

    target = vllm_anchor.serving_copy(Path(args.target), Path(args.work), "target",
                                      vllm_anchor.files_sha256([Path(args.target)]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = argparse.Namespace(ngram="1-3", token_cost=0.0, head=None, logs=str(Path(args.out).parent))
    kwargs = vllm_lookup.engine_kwargs(f"ours:{args.k}", settings)
    kwargs["additional_config"]["specheads"].pop("log")
    llm = LLM(model=str(target), dtype="float32", max_model_len=2048, max_num_seqs=args.batch, seed=0,
              enforce_eager=True, generation_config="vllm", **kwargs)
    clock = StepClock(llm.llm_engine.engine_core.engine_core.scheduler)
    prompts = vllm_lookup.prompt_ids(llm.get_tokenizer(), args.prompt_file, args.prompts)
    stops = vllm_anchor.stop_ids(Path(args.target), llm.get_tokenizer().eos_token_id)
    vllm_lookup.serve_batch(llm, prompts[:1], argparse.Namespace(max_new_tokens=4), stops)  # warm-up, untimed
    clock.take()
    steps = []
    for first in range(0, len(prompts), args.batch):
        vllm_lookup.serve_batch(llm, prompts[first: first + args.batch], args, stops)
        steps += timed_steps(clock.take())
    return steps


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    steps = measure(args)
    result = {**fit_cost(steps, args.batch, args.drop_first_of_size), "k": args.k, "prompt_file": args.prompt_file, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "proposer": "ours, no head (whole proposal up to K)",
              "threads": os.environ.get("OMP_NUM_THREADS"), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "steps": steps}
    out = Path(args.out)
    staging = out.with_suffix(".tmp")
    staging.write_text(json.dumps(result, indent=1))
    staging.replace(out)
    print(json.dumps({key: value for key, value in result.items() if key != "steps"}, indent=1))


if __name__ == "__main__":
    main()
