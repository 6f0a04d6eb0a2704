"""`specheads demo` end to end: each stage through its own command, then the summary and the combined report."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from specheads.artifacts.checkpoint import load_trained
from specheads.artifacts.report_file import REPORT_FILE, read_report
from specheads.dataset.store import read_manifest
from specheads.demo.config import DemoConfig
from specheads.demo.eagle3 import check_eagle3, eagle3_line, eagle3_lines
from specheads.demo.lookup import check_lookup, lookup_line, lookup_lines
from specheads.demo.report import write_demo_report
from specheads.demo.stages import (
    EVALUATED,
    HEADS,
    SHIPPED,
    Layout,
    Stage,
    eval_stage,
    export_stage,
    gen_stage,
    shipped_eval_stage,
    train_stage,
)
from specheads.demo.summary import summarise, summary_text
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder, write_json_atomic

MARKER = ".specheads-demo"
"""The file that marks a folder `specheads demo` made: the only kind --overwrite deletes."""


def prepare_folder(root: Path, overwrite: bool) -> None:
    """Create the demo folder and mark it; with `overwrite`, first delete it, but only if the demo made it (or it is
    empty): --overwrite never deletes a folder of the user's such as `.` or a home folder."""
    if overwrite and root.exists():
        if not root.is_dir() or (any(root.iterdir()) and not (root / MARKER).is_file()):
            raise UsageError(f"--overwrite deletes only a folder `specheads demo` made, and {root} is not one (no {MARKER} "
                             "in it); give a new --out, or delete that folder yourself if it is an older demo's")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("made by `specheads demo`: `specheads demo --overwrite` may delete this folder\n")


def evaluated(layout: Layout, head: str) -> bool:
    """Whether the head's report folder holds an evaluation of this very checkpoint (or shipped head, by its weights
    digest), and of the expected-acceptance head the on-time head's verify budget planned with."""
    if not ((layout.report(head) / REPORT_FILE).is_file() and (head == SHIPPED or layout.checkpoint(head).is_file())):
        return False
    try:
        report = read_report(layout.report(head))
    except UsageError:  # a damaged report: evaluate again
        return False
    if report.head.weights_digest != load_trained(layout.evaluated_head(head)).head.weights_digest():
        return False
    planner = ((report.decoding or {}).get("serving") or {}).get("budget") or {}
    if head == "ontime" and planner.get("head"):
        return (layout.checkpoint("expected").is_file() and planner.get("weights_digest")
                == load_trained(str(layout.checkpoint("expected"))).head.weights_digest())
    return True


def run_stage(stage: Stage, number: int, total: int) -> float:
    """Run one stage's command in this process; returns its seconds. A failing stage stops the demo."""
    from specheads.cli import main

    print(f"\n── [{number}/{total}] {stage.title}\n   {stage.command()}", flush=True)
    start = time.perf_counter()
    code = main(list(stage.argv))
    if code != 0:
        raise UsageError(f"the demo stopped at `{stage.key}` (exit {code}, the error is above); fix it and run "
                         "`specheads demo` again with the same --out: finished stages are kept")
    return time.perf_counter() - start


def wall_clock_lines(config: DemoConfig, layout: Layout, seconds: dict[str, float]
                     ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The pairs decoded in wall clock on this machine after the stages, each timed into `seconds`: the prompt-lookup
    pair (nothing to train) and, with `--eagle3`, the EAGLE-3 pair (None without)."""
    print("\n── prompt-lookup pair in wall clock: prompt lookup as the draft, B = 1, T = 0", flush=True)
    began = time.perf_counter()
    lookup = lookup_line(config, layout)
    seconds["lookup_wall_clock"] = time.perf_counter() - began
    eagle3 = None
    if config.eagle3:
        print(f"\n── EAGLE-3 pair in wall clock: {config.eagle3} as the draft, B = 1", flush=True)
        began = time.perf_counter()
        eagle3 = eagle3_line(config, layout)
        seconds["eagle3_wall_clock"] = time.perf_counter() - began
    return lookup, eagle3


def demo(config: DemoConfig) -> dict[str, Any]:
    """Run (or resume) the demo into `config.folder`; returns summary.json's content."""
    check_output_folder(config.folder)
    check_eagle3(config)
    check_lookup(config)
    layout = Layout(config.folder.resolve())
    prepare_folder(layout.root, config.overwrite)
    started = time.perf_counter()
    stages = [gen_stage(layout, config.size, config.progress)]
    stages += [train_stage(layout, config.size, head, config.progress) for head in HEADS]
    stages += [eval_stage(layout, config.size, head, config.progress) for head in EVALUATED]
    stages += [shipped_eval_stage(layout, config.size, config.progress)]
    stages += [export_stage(layout, head) for head in HEADS]
    seconds: dict[str, float] = {}
    for number, stage in enumerate(stages, 1):
        head = stage.key.partition("_")[2]
        if stage.key.startswith("eval_") and evaluated(layout, head):
            print(f"\n── [{number}/{len(stages)}] {stage.title}: already evaluated into {layout.report(head)} (kept)")
            seconds[stage.key] = 0.0
            continue
        seconds[stage.key] = run_stage(stage, number, len(stages))
    lookup, eagle3 = wall_clock_lines(config, layout, seconds)
    seconds["total"] = time.perf_counter() - started
    reports = {head: read_report(layout.report(head)) for head in (*EVALUATED, SHIPPED)}
    summary = summarise(layout, read_manifest(layout.data), reports, seconds, [s.command() for s in stages],
                        config.size)
    summary["lookup"], summary["eagle3"] = lookup, eagle3
    write_json_atomic(layout.root / "summary.json", summary)
    write_demo_report(summary, reports, layout)
    print("\n" + "\n".join([summary_text(summary), *lookup_lines(lookup), *eagle3_lines(eagle3)]))
    return summary
