"""The serving loop (issue 72, item 4): serve, log, retrain, reload a token head on a queue that switches prompt
families, against vLLM's online table adapting on the same queue (`specheads.train.lookup_loop`).

The queue: the greedy responses of `--labels` (gen at T = 0), in blocks of one family (`--order`), each family's
prompts (by id) dealt into `--cycles` parts, one a cycle: with the defaults code-edit, passage, chat-repeat, open,
then again, seven switches. The first block is served by `--head`; after each block the head is fitted again on the
logs of every block served (`--start scratch`: fresh weights; `warm`: from `--head`'s; repeatable, one loop each,
under `<out>/<start>/`) with `--config`'s recipe, and serves the next. Per block: each rule's counted speedup (the
target's forwards priced by `--verify-curve`'s measured curve: counted, not a wall clock) and, paired per prompt,
each loop's ratio to the table and to the head never retrained, with bootstrap 95 % intervals over the block's
prompts (`<out>/report.json`). Resumes: blocks served and heads fitted under `--out` are read, not made again.

    python benchmarks/lookup_loop.py --labels runs/lookup/gen-confirm24-t0 \
        --prompts benchmarks/prompts/lookup-confirm.jsonl --head heads/shipped/smollm2-lookup \
        --config configs/train/lookup-stop.yaml --verify-curve runs/lookup2/wallclock-t0.json \
        --start scratch --start warm --out runs/lookup-loop
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from lookup_replay import read_curve

from specheads.dataset.lookup import load_lookup
from specheads.dataset.store import read_manifest
from specheads.decoding.free_replay import greedy_refusal, make_rule
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic
from specheads.train.lookup_loop import Request, Serving, bar_met, block_report, fixed_rules, run_loop, switching_queue
from specheads.train.lookup_refit import Recipe

STARTS = ("scratch", "warm")


def requests_of(labels: str, prompts: str) -> list[Request]:
    """The greedy requests of `labels`, each with its prompt's family (`category` in the prompts' JSONL)."""
    refusal = greedy_refusal(read_manifest(Path(labels)), labels)
    if refusal:
        raise UsageError(refusal)
    family = {record["id"]: record.get("category", "unknown")
              for record in map(json.loads, Path(prompts).read_text().splitlines()) if record}
    rows = load_lookup(labels).select_columns(["prompt_id", "prompt_ids", "target_ids"])
    return [Request(str(row["prompt_id"]), family.get(row["prompt_id"], "unknown"), list(row["prompt_ids"]),
                    list(row["target_ids"])) for row in rows]


def printed(rows: list[dict[str, Any]], loops: list[str]) -> None:
    """One line a block: the speedups and the paired ratios."""
    def show(value: dict[str, Any]) -> str:
        low, high = value["interval"]
        return f"{value['speedup']:.3f} [{low:.3f}, {high:.3f}]"

    for row in rows:
        where = f"block {row['block']}" if "block" in row else f"after a switch, blocks {row['blocks']}"
        print(f"{where} {row['family']} ({row['table']['prompts']} prompts): table {show(row['table'])}, "
              f"never retrained {show(row['fixed'])}, /table {show(row['fixed/table'])}; " + "; ".join(
                  f"{name} {show(row[name])}, /table {show(row[name + '/table'])}, /never {show(row[name + '/fixed'])}"
                  for name in loops))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", required=True, help="lookup labels at T = 0 (the queue's greedy responses)")
    parser.add_argument("--prompts", required=True, help="their prompts' JSONL (its `category` is the family)")
    parser.add_argument("--head", required=True, help="the head that serves the first block")
    parser.add_argument("--config", required=True, help="the head recipe, e.g. configs/train/lookup-stop.yaml")
    parser.add_argument("--verify-curve", required=True, help="a benchmarks/lookup_decode.py results JSON")
    parser.add_argument("--order", default="code-edit,passage,chat-repeat,open", help="the families of a cycle")
    parser.add_argument("--cycles", type=int, default=2, help="times the queue goes through the families")
    parser.add_argument("--start", action="append", choices=STARTS, help="retrain from scratch or from --head "
                        "(repeatable; default scratch)")
    parser.add_argument("--max-epochs", type=int, help="epochs of each fit (default: --config's)")
    parser.add_argument("--rule", default="lookup_plan:0.043", help="the head's rule")
    parser.add_argument("--table", default="lookup_table:0.043", help="vLLM's online table's rule")
    parser.add_argument("--max-draft", type=int, default=32, help="tokens the proposer reads a round")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples over a block's prompts")
    parser.add_argument("--out", default="runs/lookup-loop")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.max_draft < 1:
        raise UsageError("--cycles and --max-draft must be >= 1")
    serving = Serving(args.rule, args.table, args.max_draft, read_curve(args.verify_curve))
    make_rule(serving.rule, serving.max_draft, args.head, serving.curve)
    make_rule(serving.table, serving.max_draft, None, serving.curve)
    recipe = Recipe.of_config(yaml.safe_load(Path(args.config).read_text()))
    if args.max_epochs is not None:
        if args.max_epochs < 1:
            raise UsageError("--max-epochs must be >= 1")
        recipe = replace(recipe, max_epochs=args.max_epochs)
    blocks = switching_queue(requests_of(args.labels, args.prompts), args.order.split(","), args.cycles)
    out, starts = Path(args.out), args.start or ["scratch"]
    loops = {start: run_loop(blocks, args.head, serving, recipe, out / start, start == "warm", print)
             for start in starts}
    report = block_report(blocks, loops, fixed_rules(blocks, args.head, serving), args.resamples)
    printed(report["blocks"] + report["families"], starts)
    bars = {start: bar_met(report["blocks"], start) for start in [*starts, "fixed"]}
    print("bar (loop/table >= 1 after every switch): " + ", ".join(f"{s} {b}" for s, b in bars.items()))
    write_json_atomic(out / "report.json", {"labels": args.labels, "head": args.head, "config": args.config,
                                            "serving": {"rule": serving.rule, "table": serving.table,
                                                        "max_draft": serving.max_draft,
                                                        "verify_curve": serving.curve.as_dict()},
                                            "recipe": recipe.__dict__, "order": args.order, "cycles": args.cycles,
                                            "counted": "target forwards priced by the verify curve, not wall clock",
                                            **report, "bar": bars})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
