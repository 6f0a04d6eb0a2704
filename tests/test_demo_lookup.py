"""The demo's prompt-lookup line (`specheads.demo.lookup`): decoded for the tiny target in wall clock against the
target alone, every rule's tokens the target alone's at T = 0, kept and reused while its settings and head are the
same; the token head's rule left out, said in one line, where no head ships; a bad --lookup-head refused before any
stage; the line on the demo's screen, in its report and first in its figure."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import random_token_head

from specheads.cli import main
from specheads.decoding.costs import CostCurve
from specheads.decoding.verify_curve import VERIFY_TOKENS, free_draft_costs
from specheads.demo import lookup
from specheads.demo.config import DemoConfig
from specheads.demo.figure import panels
from specheads.demo.report import demo_markdown
from specheads.demo.stages import Layout
from specheads.heads.lookup import TokenHeadModel

SUMMARY = Path(__file__).parent / "fixtures" / "demo_summary.json"


@pytest.fixture(scope="module")
def decoded(tiny_model, prompts_file, tmp_path_factory) -> tuple[dict, lookup.LookupSettings, Layout]:
    """The line for the tiny target: 3 prompts × 12 tokens, every rule, a random token head's rule among them."""
    root = tmp_path_factory.mktemp("demo")
    settings = lookup.LookupSettings(prompts=3, max_new_tokens=12, rules=tuple(lookup.RULES),
                                     head=random_token_head(root / "head"), target=str(tiny_model),
                                     prompt_file=str(prompts_file), resamples=100)
    layout = Layout(root / "demo")
    return lookup.lookup_line(DemoConfig(), layout, settings), settings, layout


def test_the_lookup_line_decodes_every_rule_exactly_against_the_target_alone(decoded):
    result, settings, layout = decoded
    assert set(result["rules"]) == {"constant_k:8", "lookup_table:0.043", "lookup_plan:0.043"}
    assert result["prompts"] == 3 and result["threads"] == 1 and result["packed_layers"] > 0
    for rule, row in result["rules"].items():
        assert row["same_as_target"] == 3, rule  # greedy: the exact decoder's tokens are the target alone's
        assert row["speedup"] > 0 and len(row["per_prompt"]) == 3
        assert row["interval"][0] <= row["speedup"] <= row["interval"][1]
    for run in result["runs"]:  # each rule decoded each prompt as far as the target alone did
        assert all(run[rule][0] == run["alone"][0] for rule in settings.rules)
    lines = lookup.lookup_lines(result)
    assert "3 copy-heavy prompts (all) × 12 tokens, T = 0, B = 1, 1 thread, both sides reading prepacked weights" in lines[0]
    for rule, words in (("constant_k:8", "fixed K = 8"), ("lookup_table:0.043", "vLLM's online acceptance table"),
                        ("lookup_plan:0.043", "the token head's rule")):
        row = result["rules"][rule]
        line = next(line for line in lines if words in line)
        assert f"{row['speedup']:.2f}× [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}]" in line
        assert "tokens the target alone's on 3 of 3 prompts" in line
    curve = result["verify_curve"]
    assert curve["tokens"] == list(VERIFY_TOKENS) and curve["seconds"] == sorted(curve["seconds"])  # timed here
    assert f"a verify of 9 tokens costs {lookup.verify_price(result):.2f} one-token forwards here" in lines[0]
    assert json.loads((layout.root / "lookup" / "wall_clock.json").read_text()) == result


def test_the_planners_price_a_verify_from_the_measured_curve(decoded):
    """The adaptive rules' planners read the curve the line timed, not the fixed t their names carry; fixed K reads
    none."""
    _, settings, _ = decoded
    curve = CostCurve((1, 9, 33), (0.01, 0.03, 0.09))
    rules = lookup.make_rules(settings, free_draft_costs(curve))
    assert rules["constant_k:8"][1] is None
    for rule in ("lookup_table:0.043", "lookup_plan:0.043"):
        planner = rules[rule][1]
        assert planner.cost(9) == pytest.approx(3.0) and planner.cost(33) == pytest.approx(9.0), rule


def test_a_kept_line_is_reused_until_its_head_changes(decoded, monkeypatch):
    result, settings, layout = decoded
    monkeypatch.setattr(lookup, "measure", lambda settings: pytest.fail("a kept line was decoded again"))
    assert lookup.lookup_line(DemoConfig(), layout, settings) == result
    random_token_head(Path(settings.head), seed=1)  # the head exported again into the same folder: decoded again
    monkeypatch.setattr(lookup, "measure", lambda settings: {"prompts": 1})
    assert lookup.lookup_line(DemoConfig(), layout, settings)["prompts"] == 1
    random_token_head(Path(settings.head), seed=0)
    monkeypatch.setattr(lookup, "measure", lambda settings: {"prompts": 2})
    assert lookup.lookup_line(DemoConfig(), layout, replace(settings, max_new_tokens=8))["prompts"] == 2


def test_without_a_shipped_token_head_its_rule_is_left_out_and_said(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup, "shipped_heads", lambda: {})
    settings = lookup.lookup_settings(DemoConfig(quick=True))
    assert settings.rules == ("constant_k:8", "lookup_table:0.043") and settings.head is None
    assert (settings.prompts, settings.max_new_tokens) == (3, 80)
    lines = lookup.lookup_lines({"settings": vars(settings), "prompts": 3, "max_new_tokens": 80, "temperature": 0.0,
                                 "threads": 1, "target_alone_tokens_per_s": 30.0, "rules": {},
                                 "verify_curve": {"tokens": [1, 9], "seconds": [0.03, 0.045]}})
    assert lines[-1].strip().startswith("the token head's rule: no token head ships at heads/shipped/smollm2-lookup")
    # a shipped folder that is no token head: the rule left out, the demo not failed
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(lookup, "shipped_heads", lambda: {lookup.SHIPPED_LOOKUP_HEAD: tmp_path})
    broken = lookup.lookup_settings(DemoConfig())
    assert broken.head is None and "cannot be read" in broken.missing and "lookup_plan:0.043" not in broken.rules
    # one that is: its rule decoded, the full demo's line larger
    monkeypatch.setattr(lookup, "shipped_heads", lambda: {lookup.SHIPPED_LOOKUP_HEAD: Path(random_token_head(tmp_path / "h"))})
    full = lookup.lookup_settings(DemoConfig())
    assert full.rules == tuple(lookup.RULES) and full.missing is None and (full.prompts, full.max_new_tokens) == (9, 128)


def test_a_bad_lookup_head_is_refused_before_any_stage(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--quick", "--lookup-head", str(tmp_path / "nowhere")]) == 2
    assert "--lookup-head" in capsys.readouterr().err and not out.exists()
    suffix = tmp_path / "suffix-head"
    TokenHeadModel("lookup_token_stop", width=8, depth=0, draft_kind="suffix").export(suffix)
    assert main(["demo", "--out", str(out), "--quick", "--lookup-head", str(suffix)]) == 2
    assert "trained on 'suffix' drafts" in capsys.readouterr().err and not out.exists()


def test_the_demos_prompts_are_copy_heavy_families_one_of_each_first():
    prompts = [json.loads(line) for line in Path(lookup.PROMPTS).read_text().splitlines()]
    assert [p["category"] for p in prompts[:3]] == ["code-edit", "chat-repeat", "passage"]
    assert len(prompts) == 9 and {p["category"] for p in prompts} == {"code-edit", "chat-repeat", "passage"}


def test_the_report_and_the_figure_show_the_lookup_pair_first():
    """The fixture's lookup block (a quick demo's, in the shape `lookup_line` writes): the figure's first panel, every
    rule with its own interval; the report's wall-clock section gives its line."""
    content = json.loads(SUMMARY.read_text())
    result = content["lookup"]
    first = panels(content)[0]
    assert first.title.startswith("prompt-lookup pair (no draft model): wall clock, B = 1, T = 0")
    assert [row.value for row in first.rows] == [row["speedup"] for row in result["rules"].values()]
    assert [row.interval for row in first.rows] == [tuple(row["interval"]) for row in result["rules"].values()]
    assert [row.head for row in first.rows] == [rule.startswith("lookup_plan") for rule in result["rules"]]
    text = demo_markdown(content, {})
    section = text[text.index("## Wall clock on this machine"):text.index("## What ran")]
    lines = lookup.lookup_lines(result)
    assert f"- **prompt-lookup pair**: {lines[0].strip().removeprefix('lookup').strip()}" in section
    assert all(f"- {line.strip()}" in section for line in lines[1:])
