"""A served queue whose prompts switch family midway (issue 62, the adaptation): how the planners that calibrate
themselves while serving follow a change of traffic.

The queue holds the prompts of one family, then the next (by default explanation → code → chat, the confirmation
prompts' `category`; `--samples` repeats each prompt of a family with its own seed, the family's block kept
contiguous), decoded by the round engine with continuous batching at B rows (a finished request's row takes the next
prompt, so the traffic changes row by row as the last family drains). Every policy decodes the same queue with the
same seeds, exactly (each rule reads past outcomes only): the goodput planner fed the expected-acceptance head
calibrated while serving (`goodput_online`), the same planner fed vLLM's merged estimator (`vllm_current_adaptive`)
and D-Cut's top-1 product (`dcut`), and constant K. Priced by one cost view (`--costs`: a roofline preset or a cost
table) at the queue's B.

Reported per window of `--window` rounds: the tokens emitted per round and per modelled second (the window's rounds
priced as eval's serving table prices them), the share of the window's rows of each family, and, for the planners
that read a signal, the mean predicted acceptance of the candidates the target checked against the share accepted.
Per online planner and family, the rounds it took to re-settle: from the round the family's first request took a
row, the rounds until its windowed mean prediction came, and stayed, within `--tolerance` (0.05) of its settled value,
the mean of the family's last two windows (none where the family spans fewer than three windows).

    python benchmarks/family_switch.py --head EXPECTED_HEAD --out runs/family-switch

The defaults (32 prompts × 8 samples a family, 96 tokens, B = 32) give each family about 300 rounds: three refits of
an estimate refitted every 100 rounds, as vLLM's is. With `--eagle3 DIR` an EAGLE-3 drafter drafts instead of the
self-speculative draft (`--head` then trained on data it labelled: `specheads gen --config smollm2-eagle3`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specheads.decoding.costs import RoundRecord, ServingCosts, served_throughput  # noqa: E402
from specheads.decoding.online import Outcome  # noqa: E402
from specheads.decoding.planners import Signal  # noqa: E402
from specheads.decoding.rules import Drafted  # noqa: E402
from specheads.plumbing.dataclass_cli import parse_script  # noqa: E402
from specheads.plumbing.files import write_json_atomic  # noqa: E402

ONLINE = ("goodput_online", "vllm_current_adaptive")
"""The policies whose estimate refits while serving: each gets its re-settling rounds per family."""


@dataclass
class Config:
    """What to serve.

    Args:
        head: the expected-acceptance head goodput_online calibrates (`.ckpt` or head folder); needed only for it.
        out: folder of results.json.
        prompts: JSONL of prompts with a `category` each.
        families: the families in queue order.
        per_family: prompts of each family (the file's first ones of that family).
        samples: decodes of each prompt, each with its own seed (a longer queue, the family kept contiguous).
        policies: the policies served (goodput_online, vllm_current_adaptive, dcut, vllm_adaptive, constant_k, …).
        constant_k: constant K's K.
        max_draft: the goodput planners' largest K and every rule's cap.
        batch_size: rows served together (continuous batching).
        max_new_tokens: tokens per request.
        costs: the cost view the planners plan with and the rounds are priced by: a roofline preset or a cost table.
        window: rounds per reported window.
        tolerance: how close to its settled mean prediction an online planner must come to count as re-settled.
        refit_every: rounds between the online estimates' refits (vLLM's 100; fewer only for a smoke run).
        threads: torch CPU threads (0: torch's default).
        device: where the models run (cpu, cuda).
        eagle3: an EAGLE-3 drafter's folder: it drafts instead of the self-speculative draft (the target without
            layers 20–21); --head must read its state.
    """

    head: str | None = None
    out: str = "runs/family-switch"
    prompts: str = str(ROOT / "benchmarks" / "prompts" / "heldout_confirm.jsonl")
    families: list[str] = field(default_factory=lambda: ["explanation", "code", "chat"])
    per_family: int = 32
    samples: int = 8
    policies: list[str] = field(default_factory=lambda: ["goodput_online", "vllm_current_adaptive", "dcut", "constant_k"])
    constant_k: int = 3
    max_draft: int = 8
    batch_size: int = 32
    max_new_tokens: int = 96
    costs: str = "h100-llama3.1-8b-llama3.2-1b"
    window: int = 20
    tolerance: float = 0.05
    refit_every: int = 100
    threads: int = 0
    device: str = "cpu"
    eagle3: str | None = None


class RecordedSignal(Signal):
    """A planner's signal, unchanged, that also records per round the acceptance it had predicted for each candidate
    the target checked (before the round's outcomes are folded in) and whether it was accepted."""

    def __init__(self, inner: Signal):
        self.inner = inner
        self.rounds: list[tuple[float, float, int]] = []  # per round: Σ predicted, accepted, checked

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def acceptance(self, drafted: Drafted) -> float:
        return self.inner.acceptance(drafted)

    def acceptance_at(self, row: int, drafted: Drafted) -> float:
        return self.inner.acceptance_at(row, drafted)

    def admit(self, row: int) -> None:
        self.inner.admit(row)

    def observe(self, rounds: Mapping[int, list[Drafted]], outcomes: Mapping[int, list[Outcome]]) -> None:
        graded = [(row, rounds[row][o.position - 1], o.accepted) for row, checked in outcomes.items() for o in checked]
        self.rounds.append((sum(self.inner.acceptance_at(row, seen) for row, seen, _ in graded),
                            float(sum(accepted for _, _, accepted in graded)), len(graded)))
        self.inner.observe(rounds, outcomes)


def family_queue(rows: list[dict[str, Any]], families: list[str], per_family: int, samples: int) -> list[dict[str, Any]]:
    """The queue: each family's first `per_family` prompts of `rows`, `samples` times each, family after family; each
    entry with its queue position as its seed."""
    queue = []
    for family in families:
        chosen = [row for row in rows if row.get("category") == family][:per_family]
        if not chosen:
            raise SystemExit(f"family_switch.py: no prompt of family {family!r} in --prompts; use its categories")
        queue += [row for _ in range(samples) for row in chosen]
    return [{**row, "seed": index} for index, row in enumerate(queue)]


def windows(log: list[RoundRecord], family_of: list[str], costs: ServingCosts, size: int,
            calibration: list[tuple[float, float, int]] | None = None) -> list[dict[str, Any]]:
    """Per window of `size` rounds: tokens per round and per modelled second, each family's share of the rows, and
    (given the signal's per-round `calibration`) the mean predicted acceptance of the checked candidates against the
    share accepted."""
    result = []
    for start in range(0, len(log), size):
        part = log[start : start + size]
        served = served_throughput(part, costs)
        rows = [family_of[request] for record in part for request in record.requests]
        entry = {"start": start, "rounds": len(part), "tokens": served["tokens"],
                 "tokens_per_round": served["tokens"] / len(part), "tokens_per_s": served["tokens_per_s"],
                 "families": {family: rows.count(family) / len(rows) for family in dict.fromkeys(rows)}}
        if calibration is not None:
            predicted, accepted, checked = np.sum(calibration[start : start + size], axis=0)
            entry.update(predicted=predicted / checked if checked else None, accepted=accepted / checked if checked else None)
        result.append(entry)
    return result


def switches(log: list[RoundRecord], family_of: list[str]) -> dict[str, int]:
    """Each family's first round: the round in which a request of it first took a row."""
    first: dict[str, int] = {}
    for number, record in enumerate(log):
        for request in record.requests:
            first.setdefault(family_of[request], number)
    return first


def resettle(series: list[dict[str, Any]], starts: dict[str, int], total: int, tolerance: float) -> dict[str, Any]:
    """Per family, from its first round: its settled mean prediction (the mean of its last two windows before the next
    family's first round) and the rounds until the windowed prediction came within `tolerance` of it and stayed there
    (None: fewer than three windows to judge)."""
    bounds = sorted(starts.items(), key=lambda item: item[1])
    result = {}
    for (family, first), end in zip(bounds, [start for _, start in bounds[1:]] + [total]):
        inside = [w for w in series if w["start"] >= first and w["start"] + w["rounds"] <= end and w["predicted"] is not None]
        if len(inside) < 3:
            result[family] = {"first_round": first, "settled": None, "rounds_to_settle": None}
            continue
        settled = float(np.mean([w["predicted"] for w in inside[-2:]]))
        away = [w for w in inside if abs(w["predicted"] - settled) > tolerance]
        rounds = 0 if not away else away[-1]["start"] + away[-1]["rounds"] - first
        result[family] = {"first_round": first, "settled": settled, "rounds_to_settle": rounds}
    return result


def serve(engine: Any, queue: list[list[int]], seeds: list[int], family_of: list[str], policy: str, config: Config,
          costs: ServingCosts, head: Any = None, log: list[RoundRecord] | None = None) -> dict[str, Any]:
    """One policy's decode of the queue (its rounds into `log` when given), its windows and, for an online planner,
    its re-settling per family."""
    from specheads.decoding import make_policy

    value = config.constant_k if policy == "constant_k" else config.max_draft
    rule = make_policy(policy, value, max_draft=config.max_draft)
    planner = rule.planner(costs)
    recorded = None
    if planner is not None and hasattr(planner, "signal"):
        recorded = planner.signal = RecordedSignal(planner.signal)
        fit = getattr(recorded.inner, "fit", None)
        if fit is not None:
            fit.refit_every = config.refit_every
    log = [] if log is None else log
    engine.decode(queue, rule, config.max_new_tokens, seeds, head if rule.reads_head else None,
                  batch_size=config.batch_size, costs=costs, log=log, planner=planner)
    series = windows(log, family_of, costs, config.window, recorded.rounds if recorded else None)
    total = served_throughput(log, costs)
    result = {"policy": policy, "rounds": len(log), "tokens": total["tokens"], "tokens_per_s": total["tokens_per_s"],
              "windows": series}
    fit = getattr(recorded.inner, "fit", None) if recorded else None
    if fit is not None:
        result["refits"] = fit.refits
    if policy in ONLINE and recorded is not None:
        result["resettle"] = resettle(series, switches(log, family_of), len(log), config.tolerance)
    return result


def print_tables(results: list[dict[str, Any]]) -> None:
    """The windows side by side (tokens per modelled second, and per round) and the re-settling rounds."""
    print("| window | rounds | families | " + " | ".join(f"{r['policy']} tok/s (tok/round)" for r in results) + " |")
    print("|---|---|---|" + "---|" * len(results))
    for number, first in enumerate(results[0]["windows"]):
        shares = ", ".join(f"{f} {s:.0%}" for f, s in first["families"].items())
        cells = [f"{r['windows'][number]['tokens_per_s']:.1f} ({r['windows'][number]['tokens_per_round']:.1f})"
                 if number < len(r["windows"]) else "–" for r in results]
        print(f"| {number} | {first['start']}–{first['start'] + first['rounds'] - 1} | {shares} | " + " | ".join(cells) + " |")
    for r in results:
        if "resettle" in r:
            cells = "; ".join(f"{f}: from round {s['first_round']}, " + (
                f"{s['rounds_to_settle']} rounds to within the tolerance of {s['settled']:.3f}"
                if s["settled"] is not None else "too few windows to judge") for f, s in r["resettle"].items())
            print(f"\n{r['policy']} ({r.get('refits', 0)} refits): {cells}.")


def main() -> None:
    config = parse_script(Config, "family_switch.py", __doc__.splitlines()[0])
    if "goodput_online" in config.policies and config.head is None:
        raise SystemExit("family_switch.py: goodput_online plans with an expected-acceptance head; give --head (a head "
                         "trained with configs/train/expected-acceptance.yaml) or leave it out of --policies")
    import torch

    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding import RoundEngine
    from specheads.decoding.cost_table import read_cost_table
    from specheads.decoding.drafters import head_draft_refusal, load_feature_draft
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, load_pair, stop_token_ids

    if config.threads:
        torch.set_num_threads(config.threads)
    costs = read_cost_table(config.costs, "--costs").at_batch_size(config.batch_size)
    rows = [json.loads(line) for line in Path(config.prompts).read_text().splitlines() if line.strip()]
    queue = family_queue(rows, config.families, config.per_family, config.samples)
    trained = load_trained(config.head) if config.head else None
    draft_spec = ModelSpec(path=None, skip_layers=[20, 21])
    refusal = trained and head_draft_refusal(trained.draft, trained.data_identity,
                                             None if config.eagle3 is None else ("eagle3", config.eagle3),
                                             draft_spec.describe())
    if refusal:
        raise SystemExit(f"family_switch.py: --head {config.head}: {refusal}")
    pair = load_pair(ModelSpec(path="embedded:smollm2"), draft_spec)
    device = torch.device(config.device)
    pair.target.to(device)
    draft = pair.draft if config.eagle3 is None else load_feature_draft("eagle3", config.eagle3, pair.target)
    draft.to(device)
    head = trained.head.to(device).eval() if trained else None
    by_id = {p.id: p for p in load_prompts(config.prompts)}
    prompts = [encode_prompt(pair.tokenizer, by_id[row["id"]]) for row in queue]
    engine = RoundEngine(pair.target, draft, SamplingTransform(1.0), stop_token_ids(pair.target, pair.tokenizer))
    family_of = [row["category"] for row in queue]
    results = []
    for policy in config.policies:
        results.append(serve(engine, prompts, [row["seed"] for row in queue], family_of, policy, config, costs, head))
        print(f"{policy}: {results[-1]['rounds']} rounds, {results[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    write_json_atomic(Path(config.out) / "results.json", {"config": asdict(config), "queue": [row["id"] for row in queue],
                                                          "results": results})
    print_tables(results)


if __name__ == "__main__":
    main()
