"""Tree drafts against the chain at equal verify budgets (issue 38): the chain with the head's stop rule, a tree with
draft-confidence values (EAGLE-2's) and a tree with the head's values, at N = 4, 8, 16 tokens per target forward;
and, at N = 8, EAGLE-2's own construction (q's best tokens as fixed children, values Π q). The two sampled trees also
run with growth read from the costs (`TreeRule(cost_ratio=c)`, floor 0, nothing tuned; docs/method.md "Trees whose
growth weighs their costs"): `tree_head_cost` against `tree_confidence_cost` is the same growth rule with two value
sources. With `--sibling_head` (a head trained on second children, configs/train/sibling-ontime.yaml) the cost-grown
head tree also runs with it scoring the second children (`tree_sibling_cost`, sibling-aware values). With `--eagle3
DIR` an EAGLE-3 drafter (speculators' format, `specheads train drafter --config eagle3-smollm2`) drafts instead of the
self-speculative draft; the heads must then be trained on data it labelled (`specheads gen --config smollm2-eagle3`).

Three steps, each resumable (a setting whose records exist is not decoded again); `--shard i/n` splits a step's
settings between processes (two on the 2-core machine, one torch thread each):

    # the trees' floors, tuned on dev prompts (the even-numbered half of heldout_decode.jsonl) at N = 8
    python benchmarks/tree_drafts.py --step tune --head H --out runs/tree --shard 0/2 & ... --shard 1/2
    # the 160 confirmation prompts at N = 4, 8, 16 with the tuned floors
    python benchmarks/tree_drafts.py --step confirm --head H --out runs/tree --shard 0/2 & ... --shard 1/2
    # the table: tokens per target forward and modelled speedup at c, with paired 95 % intervals over prompts
    python benchmarks/tree_drafts.py --step report --out runs/tree
    # the head's scores of first children and of later siblings against how often they were accepted (dev prompts)
    python benchmarks/tree_drafts.py --step siblings --head H --out runs/tree

The chain's stop threshold h is the one tuned on the same dev prompts for eval's head rule (docs/results.md); its
tree twin has floor 1 − h. Counts, not times: the modelled speedup is tokens ÷ (c · draft forwards + target
forwards), a tree forward of the draft counting as one forward, as EAGLE-2's top-k expansion does on a GPU.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specheads.eval.offline import interval  # noqa: E402
from specheads.eval.sweep import modelled_speedup  # noqa: E402
from specheads.plumbing.dataclass_cli import parse_script  # noqa: E402
from specheads.plumbing.files import write_json_atomic  # noqa: E402


@dataclass
class Config:
    """What to decode.

    Args:
        step: tune (the trees' floors on dev prompts), confirm (the reported runs), report (the table) or siblings
            (the head's score by a child's place among its siblings against its acceptance, on the dev prompts).
        head: the trained on-time head (`.ckpt` or head folder).
        out: folder of the records and results.json.
        shard: `i/n`: this process decodes every n-th setting from the i-th.
        threads: torch CPU threads (0: torch's default).
        dev_file: JSONL of the dev prompts (its even-numbered lines are used).
        dev_prompts: dev prompts decoded per tuning setting.
        test_file: JSONL of the confirmation prompts.
        test_prompts: confirmation prompts decoded per setting.
        max_new_tokens: tokens per run.
        budgets: N, the most tokens a target forward verifies.
        tune_budget: N the floors are tuned at.
        chain_threshold: the chain's stop threshold h (eval's dev-tuned head rule).
        confidence_floors: floors tried for the confidence-valued tree.
        head_floors: floors tried for the head-valued tree.
        eagle_floors: floors tried for EAGLE-2's construction (fixed top children, confidence values).
        eagle_budgets: N at which EAGLE-2's construction is confirmed.
        width: most children per node.
        expand: most nodes the draft reads per forward.
        cost_ratio: c = t_draft / t_target of the modelled speedup and of the trees whose growth reads the costs.
        kinds: decode only these kinds' settings (all when not given): the chain and the trees grown by their costs
            need no tune step.
        sibling_head: a head of second children (`data.children: second`): adds `tree_sibling_cost`, the cost-grown
            head tree whose later siblings it scores.
        eagle3: an EAGLE-3 drafter's folder: it drafts instead of the self-speculative draft (the target without
            layers 20–21); --head and --sibling_head must read its state.
        resamples: bootstrap resamples of the paired intervals.
    """

    step: Literal["tune", "confirm", "report", "siblings"] = "report"
    head: str | None = None
    out: str = "runs/tree"
    shard: str = "0/1"
    threads: int = 0
    dev_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_decode.jsonl")
    dev_prompts: int = 24
    test_file: str = str(ROOT / "benchmarks" / "prompts" / "heldout_confirm.jsonl")
    test_prompts: int = 160
    max_new_tokens: int = 24
    budgets: list[int] = field(default_factory=lambda: [4, 8, 16])
    tune_budget: int = 8
    chain_threshold: float = 0.6
    confidence_floors: list[float] = field(default_factory=lambda: [0.03, 0.1, 0.25])
    head_floors: list[float] = field(default_factory=lambda: [0.05, 0.15, 0.3, 0.45])
    eagle_floors: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.25, 0.4, 0.6])
    eagle_budgets: list[int] = field(default_factory=lambda: [8])
    width: int = 4
    expand: int = 4
    cost_ratio: float = 0.2
    kinds: list[str] | None = None
    sibling_head: str | None = None
    eagle3: str | None = None
    resamples: int = 2000


KINDS = ("chain", "tree_eagle", "tree_confidence", "tree_head", "tree_confidence_cost", "tree_head_cost",
         "tree_sibling_cost")
TREE_KINDS = {"tree_confidence": ("confidence", "sampled", False), "tree_head": ("head", "sampled", False),
              "tree_eagle": ("confidence", "top", False), "tree_confidence_cost": ("confidence", "sampled", True),
              "tree_head_cost": ("head", "sampled", True), "tree_sibling_cost": ("head", "sampled", True)}
"""kind -> (values, children, whether growth is read from the costs at --cost_ratio: floor 0, not tuned); the
`tree_sibling_cost` tree scores its later siblings with --sibling_head"""
GAINS = (("tree_head", "chain"), ("tree_head", "tree_confidence"), ("tree_head", "tree_eagle"),
         ("tree_head_cost", "tree_confidence_cost"), ("tree_head_cost", "chain"), ("tree_head_cost", "tree_head"),
         ("tree_sibling_cost", "tree_head_cost"), ("tree_sibling_cost", "tree_confidence_cost"),
         ("tree_sibling_cost", "chain"))
"""The paired comparisons of the report: (kind, against)."""


def settings(config: Config, step: str, tuned: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """The settings a step decodes: kind, budget N and knob (h for the chain, the floor for a tree)."""
    if step == "tune":
        return ([{"kind": "tree_confidence", "budget": config.tune_budget, "knob": f} for f in config.confidence_floors]
                + [{"kind": "tree_head", "budget": config.tune_budget, "knob": f} for f in config.head_floors]
                + [{"kind": "tree_eagle", "budget": config.tune_budget, "knob": f} for f in config.eagle_floors])
    assert tuned is not None
    return ([{"kind": kind, "budget": n, "knob": config.chain_threshold if kind == "chain" else tuned[kind]}
             for n in config.budgets for kind in ("tree_head", "tree_confidence", "chain") if kind == "chain" or kind in tuned]
            + [{"kind": kind, "budget": n, "knob": 0.0} for n in config.budgets
               for kind in ("tree_head_cost", "tree_confidence_cost", "tree_sibling_cost")
               if kind != "tree_sibling_cost" or config.sibling_head]
            + [{"kind": "tree_eagle", "budget": n, "knob": tuned["tree_eagle"]} for n in config.eagle_budgets
               if "tree_eagle" in tuned])


def setting_name(setting: dict[str, Any]) -> str:
    return f"{setting['kind']}-N{setting['budget']}-{setting['knob']:g}"


def tuned_floors(folder: Path) -> dict[str, float]:
    """Per tree kind, the dev floor of the highest modelled speedup."""
    rows = json.loads((folder / "tune.json").read_text())["rows"]
    return {kind: max((r for r in rows if r["kind"] == kind), key=lambda r: r["speedup"])["knob"]
            for kind, (_, _, costs) in TREE_KINDS.items() if not costs and any(r["kind"] == kind for r in rows)}


def drafter_of(config: Config) -> tuple[str, str] | None:
    """The feature drafter the runs draft with (kind, folder), None for the self-speculative draft."""
    return None if config.eagle3 is None else ("eagle3", config.eagle3)


def drafted_by(config: Config) -> dict[str, Any]:
    """What drafted a setting's records, as its file records it: the self-speculative draft, or the --eagle3
    drafter's folder and files (a folder decoded by another draft is refused, not mixed into the report)."""
    if config.eagle3 is None:
        return {"kind": None}
    from specheads.pair.drafters import drafter_weights_sha256

    return {"kind": "eagle3", "folder": config.eagle3, "weights_sha256": drafter_weights_sha256(config.eagle3)}


def round_engine(config: Config, heads: list[Any]) -> tuple[Any, Any]:
    """The round engine at T = 1 over the embedded target and its tokenizer: the self-speculative draft, or the
    --eagle3 drafter; refuses (one line, before the drafter loads) a head that read the other draft's state."""
    from specheads.decoding import RoundEngine
    from specheads.decoding.drafters import head_draft_refusal, load_feature_draft
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, load_pair, stop_token_ids

    draft_spec = ModelSpec(path=None, skip_layers=[20, 21])
    for trained in heads:
        refusal = head_draft_refusal(trained.draft, trained.data_identity, drafter_of(config), draft_spec.describe())
        if refusal:
            raise SystemExit(f"tree_drafts.py: {trained.source}: {refusal}")
    pair = load_pair(ModelSpec(path="embedded:smollm2"), draft_spec)
    draft = pair.draft if config.eagle3 is None else load_feature_draft("eagle3", config.eagle3, pair.target)
    return RoundEngine(pair.target, draft, SamplingTransform(1.0), stop_token_ids(pair.target, pair.tokenizer)), pair.tokenizer


def siblings(config: Config) -> None:
    """siblings.json and a table: per place among siblings, the checked children's mean head score, how often they
    were accepted and a 95 % interval over prompts (head tree, tuned floor, N = tune_budget, dev prompts)."""
    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding.tree import TreeRule, decode_tree

    out = Path(config.out)
    trained = load_trained(config.head)
    head = trained.head
    engine, tokenizer = round_engine(config, [trained])
    rule = TreeRule("head", tuned_floors(out)["tree_head"], config.tune_budget, config.width, config.expand)
    by_prompt = []
    for index, prompt in enumerate(load_prompts(config.dev_file)[::2][: config.dev_prompts]):
        checked: list[tuple[int, float, bool]] = []
        decode_tree(engine, [encode_prompt(tokenizer, prompt)], rule, config.max_new_tokens, [index], head,
                           checked=checked)
        by_prompt.append(checked)
    rows = []
    for place in sorted({c[0] for checked in by_prompt for c in checked}):
        table = np.array([[sum(c[1] for c in checked if c[0] == place), sum(c[2] for c in checked if c[0] == place),
                           sum(1 for c in checked if c[0] == place)] for checked in by_prompt])
        draws = np.random.default_rng(0).integers(0, len(table), (config.resamples, len(table)))
        gap = (table[draws, 0].sum(1) - table[draws, 1].sum(1)) / np.maximum(table[draws, 2].sum(1), 1)
        rows.append({"place": place, "checked": int(table[:, 2].sum()), "mean_score": table[:, 0].sum() / table[:, 2].sum(),
                     "accepted": table[:, 1].sum() / table[:, 2].sum(),
                     "score_minus_accepted_ci": interval(list(gap))})
    write_json_atomic(out / "siblings.json", {"floor": rule.floor, "budget": rule.budget, "rows": rows})
    print("| place among siblings | checked | mean head score | accepted | score − accepted [95 %] |")
    print("|---|---|---|---|---|")
    for row in rows:
        low, high = row["score_minus_accepted_ci"]
        print(f"| {row['place']} | {row['checked']} | {row['mean_score']:.3f} | {row['accepted']:.3f} | "
              f"{row['mean_score'] - row['accepted']:+.3f} [{low:+.3f}, {high:+.3f}] |")


def decode(config: Config, step: str) -> None:
    """Decode this shard's settings of `step`, writing one records file per setting."""
    import torch

    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding import make_policy
    from specheads.decoding.tree import TreeRule, decode_tree

    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    index, count = (int(part) for part in config.shard.split("/"))
    tuned = (tuned_floors(out) if (out / "tune.json").exists() else {}) if step == "confirm" else None
    todo = [s for i, s in enumerate(settings(config, step, tuned)) if i % count == index
            and not (out / step / f"{setting_name(s)}.json").exists() and (config.kinds is None or s["kind"] in config.kinds)]
    if not todo:
        return
    chain = load_trained(config.head)
    sibling = load_trained(config.sibling_head) if config.sibling_head else None
    if chain.children != "first" or (sibling is not None and sibling.children != "second"):
        raise SystemExit("tree_drafts.py: --head must score drafted candidates and --sibling_head a tree's second "
                         "children (trained with data.children: second)")
    head, sibling_head = chain.head, None if sibling is None else sibling.head
    digest = None if sibling_head is None else sibling_head.weights_digest()
    for setting in todo:
        if setting["kind"] == "tree_sibling_cost" and digest is None:
            raise SystemExit("tree_drafts.py: tree_sibling_cost needs --sibling_head")
    for path in (out / step).glob("tree_sibling_cost-*.json") if digest else ():
        made_with = json.loads(path.read_text()).get("sibling_head_digest")
        if made_with != digest:
            raise SystemExit(f"tree_drafts.py: {path} was decoded with another sibling head ({made_with}); give that "
                             "head, or another --out")
    drafter = drafted_by(config)
    for path in (out / "tune").glob("*.json") if step == "confirm" else ():  # its floors decide this step's trees
        check_drafted_by(path, drafter)
    for path in (out / step).glob("*.json"):
        check_drafted_by(path, drafter)
    source = load_prompts(config.dev_file)[::2][: config.dev_prompts] if step == "tune" else \
        load_prompts(config.test_file)[: config.test_prompts]
    engine, tokenizer = round_engine(config, [chain] + ([] if sibling is None else [sibling]))
    prompts = [encode_prompt(tokenizer, p) for p in source]
    seeds = list(range(len(prompts)))
    for setting in todo:
        if setting["kind"] == "chain":
            rule = make_policy("head", setting["knob"], max_draft=setting["budget"])
            results = [r for first in range(0, len(prompts), 16)
                       for r in engine.decode(prompts[first : first + 16], rule, config.max_new_tokens,
                                              seeds[first : first + 16], head)]
        else:
            values, children, costs = TREE_KINDS[setting["kind"]]
            rule = TreeRule(values, setting["knob"], setting["budget"], config.width, config.expand, children,
                            cost_ratio=config.cost_ratio if costs else None)
            results = decode_tree(engine, prompts, rule, config.max_new_tokens, seeds, head,
                                  sibling_head=sibling_head if setting["kind"] == "tree_sibling_cost" else None)
        records = [{"prompt": p.id, "emitted": r.emitted, "accepted": r.accepted, "drafted": r.drafted,
                    "draft_forwards": r.draft_forwards, "head_forwards": r.head_forwards,
                    "target_calls": r.target_calls} for p, r in zip(source, results)]
        payload = {"setting": setting, "records": records, "drafted_by": drafter}
        if setting["kind"] == "tree_sibling_cost":
            payload["sibling_head_digest"] = digest
        write_json_atomic(out / step / f"{setting_name(setting)}.json", payload)
        print(setting_name(setting), summary(records, config.cost_ratio), flush=True)


def check_drafted_by(path: Path, drafter: dict[str, Any]) -> None:
    """Stop where `path`'s records were drafted by another draft than `drafter` (`drafted_by`; records written before
    the field count as the self-speculative draft's)."""
    made_with = json.loads(path.read_text()).get("drafted_by", {"kind": None})
    if made_with != drafter:
        raise SystemExit(f"tree_drafts.py: {path} was drafted by {made_with}, not {drafter}; give the same draft "
                         "(--eagle3), or another --out")


def totals(records: list[dict[str, Any]]) -> np.ndarray:
    """[prompts, 4]: emitted, accepted, draft forwards (the head's forwards at their cost included), target forwards."""
    refuse_uncharged(records)
    return np.array([[r["emitted"], r["accepted"], r["draft_forwards"] + r["head_forwards"], r["target_calls"]]
                     for r in records], dtype=float)


def refuse_uncharged(records: list[dict[str, Any]]) -> None:
    """Stop at records decoded before the head's forwards were counted: their speedups count the head free."""
    if any("head_forwards" not in r for r in records):
        raise SystemExit("tree_drafts.py: these records were decoded before the head's forwards were counted (no "
                         "head_forwards); remove them and decode again")


def figures(table: np.ndarray, cost_ratio: float) -> dict[str, np.ndarray]:
    """Tokens per target forward, accepted drafted tokens per target forward, modelled speedup (over summed rows;
    `table` may carry a leading resample axis)."""
    emitted, accepted, drafts, calls = (table[..., i].sum(-1) for i in range(4))
    return {"tokens_per_target_forward": emitted / calls, "accepted_per_target_forward": accepted / calls,
            "speedup": modelled_speedup(emitted, drafts, calls, cost_ratio), "draft_forwards_per_target_forward": drafts / calls}


def summary(records: list[dict[str, Any]], cost_ratio: float) -> dict[str, float]:
    return {name: round(float(value), 3) for name, value in figures(totals(records), cost_ratio).items()}


def report(config: Config) -> None:
    """results.json and a markdown table: every setting's figures and the head tree's paired gains."""
    out = Path(config.out)
    rows = {}
    for step in ("tune", "confirm"):
        for path in sorted((out / step).glob("*.json")):
            payload = json.loads(path.read_text())
            rows.setdefault(step, []).append({**payload["setting"], **summary(payload["records"], config.cost_ratio),
                                              "records": payload["records"]})
    if "tune" in rows:
        write_json_atomic(out / "tune.json", {"rows": [{k: v for k, v in r.items() if k != "records"} for r in rows["tune"]]})
    results: dict[str, Any] = {"cost_ratio": config.cost_ratio, "settings": [], "gains": []}
    confirm = {(r["kind"], r["budget"]): r for r in rows.get("confirm", [])}
    draws = None
    for (kind, n), row in sorted(confirm.items(), key=lambda item: (item[0][1], KINDS.index(item[0][0]))):
        results["settings"].append({k: v for k, v in row.items() if k != "records"})
        for other in (against for mine, against in GAINS if mine == kind):
            if (other, n) not in confirm:
                continue
            mine, theirs = totals(row["records"]), totals(confirm[(other, n)]["records"])
            if draws is None:
                draws = np.random.default_rng(0).integers(0, len(mine), (config.resamples, len(mine)))
            a, b = figures(mine[draws], config.cost_ratio), figures(theirs[draws], config.cost_ratio)
            point_a, point_b = figures(mine, config.cost_ratio), figures(theirs, config.cost_ratio)
            gain = {"budget": n, "tree": kind, "against": other}
            for name in ("tokens_per_target_forward", "speedup"):
                ratio = a[name] / b[name] - 1
                gain[name] = [float(point_a[name] / point_b[name] - 1), *interval(list(ratio))]
            results["gains"].append(gain)
    write_json_atomic(out / "results.json", results)
    print("| N | drafting | knob | tokens / target forward | accepted / target forward | draft forwards / target forward | "
          f"modelled speedup (c = {config.cost_ratio}) |")
    print("|---|---|---|---|---|---|---|")
    for row in results["settings"]:
        print(f"| {row['budget']} | {row['kind']} | {row['knob']:g} | {row['tokens_per_target_forward']:.3f} | "
              f"{row['accepted_per_target_forward']:.3f} | {row['draft_forwards_per_target_forward']:.2f} | {row['speedup']:.3f}× |")
    print("\n| N | head tree | against | tokens / target forward [95 % paired] | modelled speedup [95 % paired] |")
    print("|---|---|---|---|---|")
    for gain in results["gains"]:
        cells = [f"{100 * g[0]:+.1f} % [{100 * g[1]:+.1f}, {100 * g[2]:+.1f}]"
                 for g in (gain["tokens_per_target_forward"], gain["speedup"])]
        print(f"| {gain['budget']} | {gain['tree']} | {gain['against']} | {cells[0]} | {cells[1]} |")


def main() -> None:
    config = parse_script(Config, "tree_drafts.py", __doc__.splitlines()[0])
    if config.step == "report":
        report(config)
        return
    if config.head is None:
        raise SystemExit("tree_drafts.py: --head is required for the tune and confirm steps; give the on-time head's .ckpt")
    untuned = config.step == "confirm" and config.kinds is not None and all(
        kind == "chain" or TREE_KINDS[kind][2] for kind in config.kinds)
    if config.step in ("confirm", "siblings") and not untuned and not (Path(config.out) / "tune.json").exists():
        raise SystemExit("tree_drafts.py: no tune.json in --out; run --step tune, then --step report, first")
    siblings(config) if config.step == "siblings" else decode(config, config.step)


if __name__ == "__main__":
    main()
