"""Benchmark of `specheads gen` on the embedded pair (issue: data_gen benchmark).

Three comparisons, each side by side in one run on the same prompts and settings:
  1. end to end: `specheads gen` against a per-prompt pipeline written the way the SpecDec++
     reference code works (one prompt at a time `generate`, then separate unbatched target and
     draft passes with full logits): labelled tokens/s and peak RSS;
  2. the labelling stage (responses fixed) against its bound: one batched target forward plus one
     batched draft forward over the same tokens, plus one more draft forward for the features;
  3. peak RSS of `specheads gen` at 32 and at 256 prompts;
  4. (`bound`, for a GPU) `specheads gen` on a config, end to end, against the forward bound measured in the same
     process on the same rows: one teacher-forced target forward plus the draft's passes (its forward for q and,
     when features are stored, its forward for them) over the same tokens, logits only where labels need them.
     It reports labelled tokens/s with and without model loading, the time spent generating responses, the
     bound's tokens/s and the ratios. `--random-target 1b` swaps the target for a random-initialised 1B-class
     Llama (bf16, the embedded tokenizer; its draft skips two of its layers).
  5. (`stages`) where `specheads gen`'s time goes on a config (`--stages-config`, `--stages-args`): wall and CPU
     seconds per stage, whichever path labels (generate + teacher-forced forwards, or the one-pass labeller of
     data_gen.onepass). Run it with another checkout's package on the path to profile that version.
Each measurement runs in its own process so peak RSS is that measurement's alone.

    python benchmarks/gen_throughput.py --prompts 32 --max-new-tokens 64 --memory-prompts "[32, 256]"
    OMP_NUM_THREADS=1 python benchmarks/gen_throughput.py --parts "[stages]" --stages-args "[--num-prompts, 8]"
    python benchmarks/gen_throughput.py --parts "[bound]" --bound-config configs/gen/smollm2-demo-16x.yaml \
        --bound-args "[--target.dtype, bfloat16, --generation.cache, static, --generation.compile, true,
                       --generation.batch_size, auto, --batch-size, 128, --rows-per-shard, 1024]"
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from jsonargparse.typing import PositiveInt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_high_water_mark() -> None:
    """Reset this process's VmHWM (Linux: writing 5 to clear_refs), so later peaks exclude model loading."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def high_water_mark_mib() -> float:
    """VmHWM from /proc/self/status: the peak RSS since the last reset."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompts_file(count: int, folder: str) -> str:
    """A JSONL of `count` distinct prompts: the built-in set, cycled with a short suffix past its 200."""
    from specheads.dataset.prompts import load_prompts

    builtin = load_prompts("builtin")
    path = Path(folder) / f"prompts-{count}.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            prompt = builtin[i % len(builtin)]
            suffix = "" if i < len(builtin) else f" (Answer in at most {2 + i // len(builtin)} paragraphs.)"
            handle.write(json.dumps({"id": f"{prompt.id}-{i // len(builtin)}",
                                     "prompt": prompt.messages[-1][1] + suffix}) + "\n")
    return str(path)


def gen_config(prompts: int, max_new_tokens: int, out: str):
    from specheads.data_gen.cli import parse_config

    return parse_config(["--config", str(ROOT / "configs/gen/smollm2-demo.yaml"), "--prompts", prompts_file(prompts, out),
                         "--num-prompts", str(prompts), "--samples-per-prompt", "1",
                         "--max-new-tokens", str(max_new_tokens), "--out", str(Path(out) / "gen"),
                         "--progress", "false", "--accelerator", "cpu"])


def measure_ours(prompts: int, max_new_tokens: int) -> dict:
    """`specheads gen` end to end (model loading excluded, as for the reference)."""
    from specheads.data_gen import run as run_module

    loaded = {}
    original = run_module.load_pair

    def timed_load(*args, **kwargs):
        start = time.perf_counter()
        pair = original(*args, **kwargs)
        loaded["seconds"] = time.perf_counter() - start
        loaded["rss_after_load_mib"] = high_water_mark_mib()
        reset_high_water_mark()
        return pair

    run_module.load_pair = timed_load
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = run_module.run(gen_config(prompts, max_new_tokens, out))
        seconds = time.perf_counter() - start - loaded["seconds"]
    return {"tokens": summary.labelled_tokens, "seconds": seconds, "tokens_per_s": summary.labelled_tokens / seconds,
            "mean_accept": summary.mean_accept, "peak_rss_mib": peak_rss_mib(),
            "peak_rss_after_load_mib": high_water_mark_mib(), "peak_rss_during_load_mib": loaded["rss_after_load_mib"]}


def measure_reference(prompts: int, max_new_tokens: int) -> dict:
    """The per-prompt pipeline of the SpecDec++ reference code: nothing batched, full logits everywhere."""
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.pair.models import ModelSpec, load_pair

    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(skip_layers=[20, 21]))
    tokenizer = pair.tokenizer
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    tokens = 0
    accept_sum = 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in load_prompts(prompts_file(prompts, folder)):
            ids = torch.tensor([encode_prompt(tokenizer, prompt)])
            output = pair.target.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                          max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            response = output[0, ids.shape[1]:]
            sequence = output[:, : ids.shape[1] + len(response)]
            positions = slice(ids.shape[1] - 1, sequence.shape[1] - 1)
            p = pair.target(sequence).logits[0, positions].softmax(-1)
            q = pair.draft(sequence).logits[0, positions].softmax(-1)
            candidates = torch.multinomial(q, 1).squeeze(-1)
            rows = torch.arange(len(candidates))
            accept = (p[rows, candidates] / q[rows, candidates]).clamp(max=1.0)
            _beta = torch.minimum(p, q).sum(-1)
            _entropy = -(q * q.clamp_min(1e-30).log()).sum(-1)
            is_draft = torch.rand(len(candidates)) >= 0.15
            mixed = torch.where(is_draft, candidates, response)
            mixed_sequence = torch.cat([ids[0], mixed]).unsqueeze(0)
            _features = pair.draft(mixed_sequence, output_hidden_states=True).hidden_states[-1][0, ids.shape[1] - 1:]
            tokens += len(candidates)
            accept_sum += float(accept.sum())
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mean_accept": accept_sum / tokens, "peak_rss_mib": peak_rss_mib()}


def measure_labelling(prompts: int, max_new_tokens: int) -> dict:
    """Our labelling stage against one batched target + draft forward (+ draft for features) on the same batches."""
    from specheads.data_gen.config import GenConfig
    from specheads.data_gen.labels import label_batch
    from specheads.data_gen.plan import build_plan, row_seed
    from specheads.data_gen.responses import generate_responses
    from specheads.data_gen.run import select_items
    from specheads.dataset.prompts import load_prompts
    from specheads.pair.models import load_pair

    config: GenConfig = gen_config(prompts, max_new_tokens, tempfile.mkdtemp())
    pair = load_pair(config.target, config.draft)
    transform = config.sampling.transform()
    device = torch.device("cpu")
    items = select_items(config, pair.tokenizer, load_prompts(config.prompts), None, 8192).items
    batches = [b for shard in build_plan(items, config.batch_size, config.rows_per_shard) for b in shard.batches]
    pad = pair.tokenizer.pad_token_id
    with torch.inference_mode():
        responses = [generate_responses(pair.target, pair.tokenizer, b, transform, max_new_tokens,
                                        [row_seed(0, i.prompt_id, 0, "response") for i in b], device) for b in batches]

        def forward_bound() -> float:
            start = time.perf_counter()
            for batch, answers in zip(batches, responses):
                sequences = [list(i.prompt_ids) + a for i, a in zip(batch, answers)]
                width = max(map(len, sequences))
                ids = torch.full((len(sequences), width), pad)
                mask = torch.zeros_like(ids)
                for row, s in enumerate(sequences):
                    ids[row, : len(s)] = torch.tensor(s)
                    mask[row, : len(s)] = 1
                pair.target(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
                pair.draft(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
                pair.draft(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
            return time.perf_counter() - start

        def ours() -> float:
            start = time.perf_counter()
            for batch, answers in zip(batches, responses):
                label_batch(pair.target, pair.draft, batch, answers, transform, 0, pad, config.label_chunk_tokens,
                            True, device)
            return time.perf_counter() - start

        forward_bound(), ours()  # warm-up
        bound_times, our_times = [], []
        for _ in range(3):  # interleaved, so machine noise hits both alike
            bound_times.append(forward_bound())
            our_times.append(ours())
    tokens = sum(len(a) for r in responses for a in r)
    return {"tokens": tokens, "bound_seconds": min(bound_times), "ours_seconds": min(our_times),
            "ratio": min(our_times) / min(bound_times)}


def random_target(folder: Path, size: str) -> Path:
    """A random-initialised Llama of `size` (bf16) with the embedded model's tokenizer, saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.pair.models import ModelSpec, load_tokenizer

    shapes = {"1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8}}
    tokenizer = load_tokenizer(ModelSpec(path="embedded:smollm2"))
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=8192, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         **shapes[size])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bound_argv(args: GenBenchmark, folder: str) -> list[str]:
    """`specheads gen` flags of the bound measurement: the config, the random target if asked, the user's flags."""
    argv = ["--config", str(ROOT / args.bound_config)]
    if args.random_target:
        layers = 16  # the random target's depth; its draft skips two middle layers
        argv += ["--target.path", str(random_target(Path(folder) / "random-target", args.random_target)),
                 "--target.dtype", "bfloat16", "--draft.skip_layers", f"[{layers // 2 - 1}, {layers // 2}]",
                 "--state_layer", "null"]
    return argv + list(args.bound_args) + ["--out", str(Path(folder) / "gen"), "--overwrite", "--progress", "false"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bound_pass(pair, batches: list[list[tuple[list[int], list[int]]]], pad: int, store_features: bool,
               device: torch.device) -> float:
    """Seconds for the forward bound over `batches` of (prompt ids, response ids): the target's states and its
    logits at the response positions, the draft's likewise, and one more draft pass for the features."""
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        sequences = [prompt + response for prompt, response in batch]
        width = max(map(len, sequences))
        ids = torch.full((len(sequences), width), pad)
        mask = torch.zeros_like(ids)
        labelled = torch.zeros_like(ids, dtype=torch.bool)
        for row, (prompt, response) in enumerate(batch):
            ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            mask[row, : len(prompt) + len(response)] = 1
            labelled[row, len(prompt) - 1 : len(prompt) + len(response) - 1] = True
        ids, mask, labelled = ids.to(device), mask.to(device), labelled.to(device)
        for model in (pair.target, pair.draft):
            states = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            model.get_output_embeddings()(states[labelled]).float().sum()
        if store_features:
            pair.draft.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.sum()
    synchronize(device)
    return time.perf_counter() - start


def measure_bound(args: GenBenchmark) -> dict:
    """`specheads gen` end to end on a config, then the forward bound on the rows it wrote, in one process."""
    from specheads.data_gen import run as run_module
    from specheads.data_gen import vllm_engine
    from specheads.data_gen.cli import parse_config
    from specheads.data_gen.engines import BuiltinEngine
    from specheads.dataset.store import load_labelled

    folder = tempfile.mkdtemp()
    config = parse_config(bound_argv(args, folder))
    timed: dict[str, float] = {"load": 0.0, "generate": 0.0}
    held = {}

    def timing(name: str, function):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = function(*a, **k)
            timed[name] += time.perf_counter() - start
            if name == "load":
                held["pair"] = result
            return result
        return wrapper

    run_module.load_pair = timing("load", run_module.load_pair)
    BuiltinEngine.responses = timing("generate", BuiltinEngine.responses)
    vllm_engine.vllm_responses = timing("generate", vllm_engine.vllm_responses)
    start = time.perf_counter()
    summary = run_module.run(config)
    total = time.perf_counter() - start

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pair = held["pair"]
    pair.target.to(device)
    pair.draft.to(device)  # Lightning's teardown moved the pair back to the CPU
    rows = load_labelled(config.out)
    pairs = sorted(zip(rows["prompt_ids"], rows["target_ids"]), key=lambda row: -len(row[0]))  # the plan's order
    batches = [pairs[i : i + config.batch_size] for i in range(0, len(pairs), config.batch_size)]
    pad = pair.tokenizer.pad_token_id
    with torch.inference_mode():
        bound_pass(pair, batches[:1], pad, config.store_features, device)  # warm-up
        bound = min(bound_pass(pair, batches, pad, config.store_features, device) for _ in range(args.bound_repeats))
    tokens = summary.labelled_tokens
    after_load = tokens / (total - timed["load"])
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(), "gen_flags": bound_argv(args, "OUT"),
        "rows": summary.rows, "labelled_tokens": tokens, "mean_accept": summary.mean_accept,
        "seconds": {"total": total, "load": timed["load"], "generate": timed["generate"],
                    "label_and_write": total - timed["load"] - timed["generate"], "bound": bound},
        "tokens_per_s": {"end_to_end": tokens / total, "after_load": after_load, "generate": tokens / timed["generate"],
                         "bound": tokens / bound},
        "ratio_to_bound": {"end_to_end": tokens / total / (tokens / bound), "after_load": after_load / (tokens / bound)},
    }


STAGES = {  # (module, function): stage; a stage's time excludes the stages it calls
    ("specheads.data_gen.run", "load_pair"): "load the models",
    ("specheads.data_gen.engines", "generate_responses"): "generate the responses (transformers generate)",
    ("specheads.data_gen.labels", "decoder_states"): "teacher-forced forwards of target and draft",
    ("specheads.data_gen.labels", "mixed_features"): "draft forward over the mixed tokens (features)",
    ("specheads.data_gen.labels", "output_logits"): "LM heads (p, q)",
    ("specheads.data_gen.labels", "label_positions"): "label math (transform, draws, statistics)",
    ("specheads.data_gen.onepass.OnePass", "prefill"): "one pass: the prompts",
    ("specheads.data_gen.onepass.OnePass", "forward"): "one pass: the decoding steps (T and D)",
    ("specheads.data_gen.onepass.OnePass", "features_of"): "one pass: the features (Z, teacher-forced)",
    ("specheads.data_gen.onepass.OnePass", "logits"): "one pass: LM heads (p, q)",
    ("specheads.data_gen.onepass.Record", "label"): "one pass: draws, labels and mixing",
    ("specheads.data_gen.onepass.OnePass", "keep"): "one pass: dropping finished rows",
    ("specheads.data_gen.module", "write_shard"): "write the shards",
}


def measure_stages(args: GenBenchmark) -> dict:
    """`specheads gen` on `args.stages_config` with every stage of STAGES timed (wall and CPU seconds, each stage
    without the stages it calls); what is left is Lightning, planning, checks and the manifest."""
    import importlib

    from specheads.data_gen import run as run_module
    from specheads.data_gen.cli import parse_config

    seconds: dict[str, list[float]] = {}
    calls: list[list[float]] = []  # per open call: wall and CPU seconds of the stages it called
    absorbing = {"one pass: the prompts"}  # the stages it calls count as its own
    open_stages: list[str] = []

    def timed(stage: str, function):
        def wrapper(*a, **k):
            if any(name in absorbing for name in open_stages):
                return function(*a, **k)
            open_stages.append(stage)
            calls.append([0.0, 0.0])
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*a, **k)
            finally:
                open_stages.pop()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                inner = calls.pop()
                totals = seconds.setdefault(stage, [0.0, 0.0])
                totals[0] += wall - inner[0]
                totals[1] += cpu - inner[1]
                if calls:
                    calls[-1][0] += wall
                    calls[-1][1] += cpu
        return wrapper

    for (where, name), stage in STAGES.items():
        path, _, owner = where.rpartition(".") if where.endswith(("OnePass", "Record")) else (where, "", "")
        try:
            target = getattr(importlib.import_module(path), owner) if owner else importlib.import_module(path)
        except (ImportError, AttributeError):
            continue  # a version without that stage
        if hasattr(target, name):
            setattr(target, name, timed(stage, getattr(target, name)))
    folder = tempfile.mkdtemp()
    config = parse_config(["--config", str(ROOT / args.stages_config), *args.stages_args, "--out", str(Path(folder) / "gen"),
                           "--progress", "false", "--accelerator", "cpu"])
    wall, cpu = time.perf_counter(), time.process_time()
    summary = run_module.run(config)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    load = seconds.get("load the models", [0.0, 0.0])
    stages = {stage: {"wall_s": round(w, 2), "cpu_s": round(c, 2),
                      **({} if stage == "load the models" else {"share_after_load": round(w / (wall - load[0]), 3)})}
              for stage, (w, c) in sorted(seconds.items(), key=lambda item: -item[1][0])}
    accounted = [sum(v[i] for v in seconds.values()) for i in (0, 1)]
    stages["other (Lightning, plan, checks, manifest)"] = {
        "wall_s": round(wall - accounted[0], 2), "cpu_s": round(cpu - accounted[1], 2),
        "share_after_load": round((wall - accounted[0]) / (wall - load[0]), 3)}
    return {"torch_threads": torch.get_num_threads(), "labelled_tokens": summary.labelled_tokens,
            "tokens_per_s_reported": summary.tokens_per_s, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "stages": stages}


def child(mode: str, prompts: int, max_new_tokens: int, args: GenBenchmark | None = None) -> None:
    if mode == "bound":
        result = measure_bound(args)
    elif mode == "stages":
        result = measure_stages(args)
    else:
        result = {"ours": measure_ours, "reference": measure_reference, "labelling": measure_labelling}[mode](
            prompts, max_new_tokens)
    print("RESULT " + json.dumps(result))


def in_child(mode: str, prompts: int, max_new_tokens: int) -> dict:
    extra = sys.argv[1:] if mode in ("bound", "stages") else []  # their own flags travel with them
    process = subprocess.run([sys.executable, __file__, *extra, "--child", mode, "--prompts", str(prompts),
                              "--max-new-tokens", str(max_new_tokens)], capture_output=True, text=True)
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode or not lines:
        raise RuntimeError(f"{mode} failed:\n{process.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@dataclass
class GenBenchmark:
    """What to measure.

    Args:
        prompts: built-in prompts per run.
        max_new_tokens: tokens per response.
        memory_prompts: prompt counts of the memory runs, whose peak memory after loading is compared.
        memory_max_new_tokens: tokens per response in the memory runs.
        child: internal: run one measurement in this process.
        parts: which measurements to run (`bound` is for a GPU: see the module's docstring).
        bound_config: the `specheads gen` config the bound part runs.
        bound_args: more `specheads gen` flags for the bound part (generation options, dtype, sizes).
        random_target: run the bound part with a random-initialised target of this size instead of the config's.
        bound_repeats: passes of the forward bound; the fastest counts.
        stages_config: the `specheads gen` config the stages part profiles.
        stages_args: more `specheads gen` flags for the stages part (e.g. `[--num-prompts, 8]`).
    """

    prompts: PositiveInt = 32
    max_new_tokens: PositiveInt = 64
    memory_prompts: list[PositiveInt] = field(default_factory=lambda: [32, 256])
    memory_max_new_tokens: PositiveInt = 32
    child: Literal["ours", "reference", "labelling", "bound", "stages"] | None = None
    parts: list[Literal["end_to_end", "labelling", "memory", "bound", "stages"]] = field(
        default_factory=lambda: ["end_to_end", "labelling", "memory"])
    bound_config: str = "configs/gen/smollm2-demo-16x.yaml"
    bound_args: list[str] = field(default_factory=list)
    random_target: Literal["1b"] | None = None
    bound_repeats: PositiveInt = 2
    stages_config: str = "configs/gen/smollm2-demo.yaml"
    stages_args: list[str] = field(default_factory=lambda: ["--num-prompts", "8"])


def main() -> None:
    from specheads.plumbing.dataclass_cli import parse_script

    args = parse_script(GenBenchmark, "benchmarks/gen_throughput.py", __doc__)
    if args.child:
        child(args.child, args.prompts, args.max_new_tokens, args)
        return
    report = {"torch_threads": torch.get_num_threads(), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
    if "end_to_end" in args.parts:
        report["end_to_end"] = {"ours": in_child("ours", args.prompts, args.max_new_tokens),
                                "reference": in_child("reference", args.prompts, args.max_new_tokens)}
        e2e = report["end_to_end"]
        e2e["speedup"] = e2e["ours"]["tokens_per_s"] / e2e["reference"]["tokens_per_s"]
        print(json.dumps(report, indent=2), flush=True)
    if "labelling" in args.parts:
        report["labelling"] = in_child("labelling", args.prompts, args.max_new_tokens)
        print(json.dumps(report["labelling"], indent=2), flush=True)
    if "memory" in args.parts:
        report["memory"] = {str(n): in_child("ours", n, args.memory_max_new_tokens) for n in args.memory_prompts}
        runs = list(report["memory"].values())
        report["memory"]["ratio_after_load"] = runs[-1]["peak_rss_after_load_mib"] / runs[0]["peak_rss_after_load_mib"]
    if "bound" in args.parts:
        report["bound"] = in_child("bound", args.prompts, args.max_new_tokens)
    if "stages" in args.parts:
        report["stages"] = in_child("stages", args.prompts, args.max_new_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
