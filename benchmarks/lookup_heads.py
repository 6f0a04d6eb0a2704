"""Offline: what a free draft's token heads add over the match statistics alone and over vLLM's acceptance table.

Reads lookup labels (`specheads gen --drafter.kind lookup|suffix`): a fitting folder (the table is fitted there, as
the heads were trained there) and a held-out folder the predictors are judged on, per prompt family (the prompts
file's `category`). Two views of the same held-out proposals:

- conditional: â_k against the label p(x_k | context, x_<k) at the tokens a decode reaches (weight: the product of
  the earlier labels, 1 or 0 at T = 0): what a stop rule reads;
- survival: Π_{j≤k} â_j against the product of the labels up to k, at every proposed token: what a planner reads
  (the expected accepted length is its sum over k).

Predictors: each head given (`--head NAME=DIR`: stop heads as they are, expected heads' survival made conditional);
vLLM's table, (accepted + 1) / (observed + 2) per (source, match-length bucket, position) counted at the reached tokens
of the fitting folder (its online form halves its counts every 1024 steps; fitted on the whole folder it is at its
best); the proposal's own frequency score and its running product; the match length (a rank only: no calibration).
The computation is `specheads eval --draft-kind lookup`'s (`eval.lookup`), for several heads and any fitting folder.

    python benchmarks/lookup_heads.py --fit runs/lookup/gen-dev-t0 --heldout runs/lookup/gen-confirm-t0 \
        --prompts benchmarks/prompts/lookup-confirm.jsonl --head stop=runs/lookup/train-stop/head ... \
        --out runs/lookup/heads-offline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specheads.dataset.lookup import flat_tokens, load_lookup
from specheads.eval.lookup import free_predictors, head_estimates, judge
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.files import write_json_atomic


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", required=True, help="lookup labels the table is counted on (the heads' training data)")
    parser.add_argument("--heldout", required=True, help="lookup labels the predictors are judged on")
    parser.add_argument("--prompts", required=True, help="the held-out prompts' JSONL (its `category` is the family)")
    parser.add_argument("--head", action="append", default=[], help="NAME=DIR of an exported token head (repeatable)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    heads = dict(item.split("=", 1) for item in args.head)
    rows = load_lookup(args.heldout)
    loaded = {name: TokenHead.load(folder) for name, folder in heads.items()}
    with_states = any(head.target_state_size for head in loaded.values())
    tokens = flat_tokens(rows, with_states)
    fit = flat_tokens(load_lookup(args.fit), False)
    category = {record["id"]: record.get("category", "all")
                for record in map(json.loads, Path(args.prompts).read_text().splitlines())}
    families = np.array([category.get(prompt, "unknown") for prompt in rows["prompt_id"]])[tokens["row"]]
    predictors = {name: (head_estimates(head, tokens), True) for name, head in loaded.items()}
    predictors |= free_predictors(fit, tokens)
    report = {"fit": args.fit, "heldout": args.heldout, "results": judge(tokens, predictors, families)}
    write_json_atomic(Path(args.out), report)
    for family, found in report["results"].items():
        line = ", ".join(f"{name} {values['conditional']['auc']:.3f}/{values['survival']['auc']:.3f}"
                         for name, values in found.items())
        print(f"{family}: AUC conditional/survival: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
