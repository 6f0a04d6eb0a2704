"""The serving loop of a token head (issue 72, item 4): serve, log, retrain, reload, on a queue that switches prompt
families, beside vLLM's online table adapting on the same queue.

At T = 0 a greedy response decides every round of every rule (`specheads.decoding.free_replay`), so the loop serves
with no target forward: the queue is greedy (prompt, response) requests in blocks of one family each
(`switching_queue`), and a block is served by replaying the head's rule (`lookup_plan`) on it. What the server
logs is our decoder's round log of that replay (`round_log`, `decoder_log_lines`, request ids numbered along the
whole queue). After each block the head is fitted again on the logs of every block served so far
(`specheads.train.lookup_refit.refit`: the reached positions, from fresh weights or from the first head's) and
reloaded: the next block's rule reads it. The table's rule (`lookup_table`, vLLM's online acceptance table) and the
first head never retrained serve the whole queue once each, their planners' state carried from request to request
as a server's (`replay_speedups`). Every speedup is counted: the target's forwards priced by its verify curve, not a
wall clock (the head's own forward, the proposal's search and the bookkeeping are not in it).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from specheads.decoding.costs import CostCurve
from specheads.decoding.free_replay import forward_price, geometric_interval, make_rule, replay_speedups, round_log
from specheads.lookup.proposers import ngram_propose
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic, write_text_atomic
from specheads.train.lookup_logs import decoder_log_lines
from specheads.train.lookup_refit import Recipe, refit

NGRAM = {name: inspect.signature(ngram_propose).parameters[name].default for name in ("max_ngram", "min_ngram")}


@dataclass(frozen=True)
class Request:
    """One request of the queue: its prompt's id and family, prompt and greedy response token ids."""

    prompt_id: str
    family: str
    prompt: list[int]
    response: list[int]


@dataclass(frozen=True)
class Serving:
    """How the loop serves: the head's rule and the table's (`name:value`), the proposer's most tokens a round, the
    target's verify curve (None: `forward_price`'s default)."""

    rule: str = "lookup_plan:0.043"
    table: str = "lookup_table:0.043"
    max_draft: int = 32
    curve: CostCurve | None = None


def switching_queue(requests: list[Request], order: list[str], cycles: int = 2) -> list[list[Request]]:
    """Blocks of one family each, the families in `order` once a cycle: each family's requests (by prompt id) dealt
    into `cycles` parts, part c served in cycle c; refused where a family has fewer requests than cycles."""
    blocks = []
    for cycle in range(cycles):
        for family in order:
            found = sorted((r for r in requests if r.family == family), key=lambda r: r.prompt_id)
            if len(found) < cycles:
                raise UsageError(f"family {family!r} has {len(found)} requests, fewer than {cycles} cycles; give "
                                 "families of the queue's prompts (--order) or fewer cycles")
            blocks.append(found[cycle::cycles])
    return blocks


def serve_block(block: list[Request], first: int, head: str, serving: Serving) -> tuple[list[float], list[dict]]:
    """The counted speedup of the head's rule on each request of the block, and the round log the server writes
    of it (requests numbered from `first`)."""
    policy, planner = make_rule(serving.rule, serving.max_draft, head, serving.curve)
    records, proposed = round_log([(r.prompt, r.response) for r in block], policy, planner, serving.max_draft)
    price, costs = forward_price(serving.curve), [0.0] * len(block)
    for record in records:
        costs[record.requests[0]] += price(record.verified[0] + 1)
    numbered = [replace(record, requests=[first + r for r in record.requests]) for record in records]
    lines = decoder_log_lines({"k": serving.max_draft, **NGRAM, "draft": "lookup"},
                              {first + i: r.prompt for i, r in enumerate(block)},
                              {first + i: r.response for i, r in enumerate(block)}, numbered, proposed)
    return [len(r.response) / cost for r, cost in zip(block, costs)], lines


def served_block(block: list[Request], first: int, head: str, serving: Serving, folder: Path) -> dict[str, Any]:
    """`serve_block`'s speedups (`served.json`) and log (`log.jsonl`) in `folder`, read back where written."""
    found = folder / "served.json"
    if found.is_file():
        return json.loads(found.read_text())
    speedups, lines = serve_block(block, first, head, serving)
    write_text_atomic(folder / "log.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    served = {"head": head, "family": block[0].family, "prompt_ids": [r.prompt_id for r in block],
              "speedups": speedups}
    write_json_atomic(found, served)
    return served


def settled(out: Path, setting: dict[str, Any]) -> None:
    """Record the loop's setting in `out/loop.json`; refused in one line where `out` holds a loop of another."""
    found = out / "loop.json"
    if found.is_file() and json.loads(found.read_text()) != json.loads(json.dumps(setting)):
        raise UsageError(f"{out} holds a loop of another head, recipe, rule or queue ({found}); give another --out")
    write_json_atomic(found, setting)


def run_loop(blocks: list[list[Request]], head: str, serving: Serving, recipe: Recipe, out: Path,
             warm: bool, progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Serve every block with the current head, then fit the head again on the logs of every block so far (from
    `head`'s weights where `warm`, else fresh) and reload it for the next (module docstring); per block what it
    served. Resumes from `out`: a block served or a head fitted there is read, not made again."""
    settled(out, {"head": head, "warm": warm, "recipe": recipe.__dict__, "rule": serving.rule,
                  "max_draft": serving.max_draft, "curve": None if serving.curve is None else serving.curve.as_dict(),
                  "queue": [[r.prompt_id for r in block] for block in blocks]})
    first, logs, served = 0, [], []
    current = head
    for index, block in enumerate(blocks):
        folder = out / f"block-{index}"
        served.append(served_block(block, first, current, serving, folder))
        progress(f"{out.name} block {index} ({block[0].family}, head {current}): "
                 f"{np.exp(np.mean(np.log(served[-1]['speedups']))):.3f}x")
        logs.append(str(folder / "log.jsonl"))
        first += len(block)
        if index + 1 < len(blocks):
            current = str(refit(logs, folder / "head", recipe, head if warm else None))
    return served


def fixed_rules(blocks: list[list[Request]], head: str, serving: Serving) -> dict[str, list[float]]:
    """The table's rule and the head's rule on `head` never retrained, each over the whole queue in order (their
    planners' state carried along it): their counted speedups per request, by `table` and `fixed`."""
    pairs = [(r.prompt, r.response) for block in blocks for r in block]
    found = replay_speedups(pairs, [serving.table, serving.rule], head, serving.max_draft, serving.curve)
    return {"table": found[serving.table], "fixed": found[serving.rule]}


def compared(picked: np.ndarray, loops: dict[str, np.ndarray], fixed: dict[str, np.ndarray],
             resamples: int) -> dict[str, Any]:
    """On the requests `picked` (queue positions): each rule's counted speedup (geometric mean, bootstrap 95 %
    interval over those prompts), and paired per prompt each loop's ratio to the table and to the head never
    retrained, and that head's ratio to the table."""
    table, still = fixed["table"][picked], fixed["fixed"][picked]
    row = {"table": geometric_interval(table, resamples), "fixed": geometric_interval(still, resamples),
           "fixed/table": geometric_interval(still / table, resamples)}
    for name, values in loops.items():
        row[name] = geometric_interval(values[picked], resamples)
        row[f"{name}/table"] = geometric_interval(values[picked] / table, resamples)
        row[f"{name}/fixed"] = geometric_interval(values[picked] / still, resamples)
    return row


def block_report(blocks: list[list[Request]], loops: dict[str, list[dict[str, Any]]], fixed: dict[str, list[float]],
                 resamples: int = 1000) -> dict[str, list[dict[str, Any]]]:
    """`compared` per block (`blocks`), and pooled per family over the blocks after a switch (every block but the
    first) and over all of them (`families`)."""
    along = {name: np.concatenate([served["speedups"] for served in loop]) for name, loop in loops.items()}
    fixed_along = {name: np.array(values) for name, values in fixed.items()}
    ends = np.cumsum([0, *map(len, blocks)])
    rows = [{"block": index, "family": block[0].family, "prompt_ids": [r.prompt_id for r in block],
             **compared(np.arange(ends[index], ends[index + 1]), along, fixed_along, resamples)}
            for index, block in enumerate(blocks)]
    groups: dict[str, list[int]] = {"all": list(range(1, len(blocks)))}
    for index, block in enumerate(blocks[1:], start=1):
        groups.setdefault(block[0].family, []).append(index)
    families = [{"family": family, "blocks": picked,
                 **compared(np.concatenate([np.arange(ends[i], ends[i + 1]) for i in picked]), along, fixed_along,
                            resamples)} for family, picked in groups.items() if picked]
    return {"blocks": rows, "families": families}


def bar_met(rows: list[dict[str, Any]], loop: str) -> dict[str, bool]:
    """Issue 72's bar for `loop` after every switch (every block but the first): its paired ratio to the table's
    point >= 1, and no interval wholly below 1."""
    after = rows[1:]
    return {"point": all(row[f"{loop}/table"]["speedup"] >= 1 for row in after),
            "not_worse": all(row[f"{loop}/table"]["interval"][1] >= 1 for row in after)}
