"""`specheads demo`: its stage configs are valid (fast tier) and the quick demo runs end to end (integration)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import yaml

from specheads.cli import main
from specheads.demo.config import CONFIGS, DemoConfig
from specheads.demo.stages import EVALUATED, HEADS, SHIPPED, TRAIN_CONFIGS

SIZES = ("full", "quick")


@pytest.mark.parametrize("size", SIZES)
def test_demo_gen_and_eval_configs_are_valid(size):
    from specheads.data_gen.cli import parse_config as gen_config
    from specheads.eval.cli import parse_config as eval_config

    gen = gen_config(["--config", str(CONFIGS / "gen/smollm2-demo.yaml"), "--config", str(CONFIGS / f"demo/{size}/gen.yaml")])
    gen.validate()
    assert gen.target.path == "embedded:smollm2" and gen.mixing.ratios() == [0.15, 1.0]  # rows for both heads
    for head in EVALUATED:
        evaluation = eval_config(["--config", str(CONFIGS / f"demo/{size}/eval-{head}.yaml"), "--head", "h", "--data", "d"])
        evaluation.validate()
        # thresholds tuned elsewhere (docs/results.md), so every decoded prompt is a test prompt; both evals decode the
        # prompts the data does not hold, so the verifier's eval can take the stop head's constant-K runs
        assert evaluation.fixed_thresholds and not evaluation.tunes_here and evaluation.unseen_prompts_only
        assert evaluation.fixed_thresholds["constant_k"] <= evaluation.max_draft
        learned = "head" if head == "ontime" else "sprinter"
        assert learned in evaluation.fixed_thresholds
        if size == "full":  # the headline rests on 40 test prompts, against confidence and the field's free rules
            assert evaluation.num_decode_prompts >= 40
            if head == "ontime":
                assert {"confidence", "svip"} <= set(evaluation.fixed_thresholds)
                assert evaluation.serving_batch_sizes == [8, 32] and evaluation.serving_batch_policies == ["goodput"]
                # the CPU's curves and an accelerator's side by side in the serving line
                assert evaluation.serving_cost_sources == ["measured", "h100-llama3.1-8b-llama3.2-1b"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("head", HEADS)
def test_demo_train_configs_are_valid(size, head, tmp_path, capsys):
    override = CONFIGS / f"demo/{size}/{head}.yaml"
    assert main(["train", "fit", "--config", str(CONFIGS / TRAIN_CONFIGS[head]), "--config", str(override),
                 "--data.path", str(tmp_path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    wanted = yaml.safe_load(override.read_text())
    for section, values in wanted.items():
        assert {k: printed[section][k] for k in values} == values  # the override reached the resolved config


def test_demo_defaults_and_refusal(tmp_path, capsys):
    assert DemoConfig().folder == Path("runs/demo") and DemoConfig(quick=True).folder == Path("runs/demo-quick")
    assert main(["demo", "--bogus"]) == 2
    assert "specheads demo" in capsys.readouterr().err


def wall_clock_row(speedup: float, c: float, **head: float) -> dict:
    return {"speedup": speedup, "speedup_interval": [speedup - 1.05, speedup - 0.95], "tokens_per_target_call": 1.3,
            "draft_forwards_per_target_call": 1.0, "timed_cost_ratio": c, **head}


def test_the_demos_eagle3_line_reads_the_wall_clock_beside_the_modelled_speedup_and_says_how_without_a_drafter(
        tmp_path, monkeypatch):
    """`specheads demo --eagle3 DIR`: per rule the wall-clock speedup with its interval beside the speedup modelled
    from the same runs' counted forwards at the timed c (the head's forwards at their own timed cost); a kept line with
    the same settings is reused without decoding; without a drafter the line says how to make one."""
    from specheads.demo import eagle3
    from specheads.demo.stages import Layout

    config = DemoConfig(out=str(tmp_path / "demo"), eagle3="runs/eagle3/drafter", eagle3_head="head.ckpt")
    settings = eagle3.benchmark_settings(config)
    assert settings.rules == ["constant_k:1", "transformers:0.4", "head_cost:0.086"] and settings.head == "head.ckpt"
    identity = {"settings": vars(settings), "drafter_sha256": "d1", "head_weights_digest": "h1"}
    monkeypatch.setattr(eagle3, "line_identity", lambda settings: dict(identity))
    result = {**identity, "prompts": 16, "max_new_tokens": 32, "target_alone_tokens_per_s": 34.5,
              "rules": {"constant_k:1": wall_clock_row(1.06, 0.1),
                        "head_cost:0.086": wall_clock_row(1.02, 0.1, head_forwards_per_target_call=0.5,
                                                          timed_head_cost_ratio=0.02)}}
    folder = tmp_path / "demo" / "eagle3"
    folder.mkdir(parents=True)
    (folder / "wall_clock.json").write_text(json.dumps(result))
    monkeypatch.setattr(eagle3, "benchmark_drafter", lambda *_: pytest.fail("a kept line was decoded again"))
    kept = eagle3.eagle3_line(config, Layout(tmp_path / "demo"))
    lines = eagle3.eagle3_lines(kept)
    assert "target alone 34.5 tokens/s" in lines[0] and "16 held-out prompts × 32 tokens" in lines[0]
    assert "constant K = 1: 1.06× [1.01, 1.11]; modelled from its forwards at the timed c = 0.100: 1.18×" in lines[1]
    assert "the head's rule read from the costs (head.ckpt): 1.02×" in lines[2]
    assert lines[2].endswith("1.17×")  # 1.3 / (1 + 0.1 · 1.0 + 0.02 · 0.5) = 1.171…: the head priced
    assert eagle3.modelled(kept["rules"]["head_cost:0.086"]) == pytest.approx(1.3 / 1.11)
    assert "specheads train drafter --config eagle3-smollm2" in eagle3.eagle3_lines(None)[0]
    # the drafter trained again into the same folder: decoded again, not reused
    identity["drafter_sha256"] = "d2"
    monkeypatch.setattr(eagle3, "benchmark_drafter", lambda *_: {"prompts": 1, "rules": {}})
    again = eagle3.eagle3_line(config, Layout(tmp_path / "demo"))
    assert again["drafter_sha256"] == "d2" and again["prompts"] == 1
    assert json.loads((folder / "wall_clock.json").read_text()) == again


def numbers(text: str) -> set[str]:
    return set(re.findall(r"[-+]?\d+\.\d{3}", text))


def test_the_summary_says_what_the_demo_is_too_small_to_settle():
    from specheads.demo.summary import scale_lines

    def figures(margin_ci: list[float], gain_ci: list[float], test_prompts: int) -> dict:
        return {"title": "SpecDec++ head", "held_out_tokens": 538, "best_baseline": "draft_prob",
                "auc_margin_ci": margin_ci, "decoding": {"gain_vs_constant_k_ci": gain_ci, "test_prompts": test_prompts,
                                                         "indicative": test_prompts < 8}}

    data = {"labelled_tokens": 3600}
    settled = scale_lines({"data": data, "heads": {"ontime": figures([0.01, 0.04], [0.02, 0.09], 16)}})
    assert settled == []
    small = "\n".join(scale_lines({"data": data, "heads": {"ontime": figures([-0.014, 0.018], [0.02, 0.09], 16)}}))
    assert "538 held-out tokens and 16 test prompts do not settle whether it ranks tokens better than draft_prob" in small
    assert "decodes faster" not in small and "docs/results.md" in small
    assert "a head trained on 3,600 labelled tokens" in small
    few = "\n".join(scale_lines({"data": data, "heads": {"ontime": figures([0.01, 0.04], [0.02, 0.09], 3)}}))
    assert "3 test prompts do not settle whether it decodes faster than the best constant K" in few
    slower = figures([0.01, 0.04], [0.02, 0.09], 40)
    slower["decoding"] |= {"strongest_baseline": "confidence", "gain_vs_strongest_baseline": -0.06,
                           "gain_vs_strongest_baseline_ci": [-0.1, -0.02]}
    lost = "\n".join(scale_lines({"data": data, "heads": {"ontime": slower}}))
    assert "confidence decodes faster on these 40 test prompts (-6.0 % [-10.0, -2.0 %])" in lost
    assert "whether it decodes faster than confidence" not in lost and "reads little beyond" in lost
    # the shipped head's open questions are its own: the demo's data size does not explain them
    shipped = "\n".join(scale_lines({"data": data, "heads": {"shipped": figures([-0.014, 0.018], [0.02, 0.09], 16)}}))
    assert "do not settle" in shipped and "a head trained on 3,600" not in shipped


def test_the_headline_names_constant_k_confidence_and_the_strongest_field_rule_and_the_serving_line_the_budget():
    from specheads.demo.summary import decoding_line, serving_line, serving_summary

    decoding = {"policy": "head", "modelled_speedup": 1.40, "threshold": 0.6, "t_draft_over_t_target": 0.2,
                "test_prompts": 40, "max_new_tokens": 16, "constant_k_threshold": 3.0}
    for name, speedup, ci in (("constant_k", 1.30, [0.02, 0.12]), ("confidence", 1.41, [-0.04, 0.03]),
                              ("svip", 1.38, [-0.01, 0.05]), ("vllm_online", 1.35, [0.0, 0.07])):
        decoding |= {f"{name}_speedup": speedup, f"gain_vs_{name}": 1.40 / speedup - 1, f"gain_vs_{name}_ci": ci}
    line = decoding_line({"decoding": decoding})
    assert "vs best constant K (K = 3) 1.300x: +7.7 % [+2.0, +12.0 %]" in line
    assert "vs confidence 1.410x: -0.7 % [-4.0, +3.0 %]" in line
    assert "the strongest field rule, svip 1.380x: +1.4 % [-1.0, +5.0 %]" in line and "vllm" not in line
    view = "draft at 0.2 × target"
    rows = [{"policy": "budget", "batch_size": size, "costs": view, "vs_constant_k": gain, "vs_constant_k_ci": [gain - 0.05, gain + 0.05],
             "best_per_request": "confidence", "vs_best_per_request": gain - 0.1, "vs_best_per_request_ci": None}
            for size, gain in ((1, -0.1), (32, 0.2))]
    rows.append({**rows[1], "costs": "measured", "vs_constant_k": 9.0})  # the unscaled CPU view: not in the line
    accelerator = "roofline h100-llama3.1-8b-llama3.2-1b (modelled)"  # an accelerator view: beside the CPU's
    rows.append({**rows[1], "costs": accelerator, "vs_constant_k": 0.3, "vs_constant_k_ci": None,
                 "best_per_request": None})
    figures = {"serving": serving_summary({"rows": rows, "left_out": {}}, 0.2)}
    assert serving_line(figures) == (f"serving, verify budget vs constant K — {view}: B = 1 -10.0 % [-15.0, -5.0 %] "
                                     "(vs confidence -20.0 %); B = 32 +20.0 % [+15.0, +25.0 %] (vs confidence +10.0 %) | "
                                     f"{accelerator}: B = 32 +30.0 %")
    # the goodput planner fed the head is the one shown where it was decoded
    goodput = [{**row, "policy": "goodput"} for row in rows]
    line = serving_line({"serving": serving_summary({"rows": rows + goodput, "left_out": {}}, 0.2)})
    assert line.startswith("serving, verify budget (goodput planner, the head) vs constant K")
    assert serving_line({}) is None


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """`pip install .` (not editable) into a folder of its own, and the environment that imports it from there."""
    import shutil
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    shutil.copytree(Path(__file__).parents[1], source,
                    ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", "__pycache__"))
    site = root / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == ["specheads"]
    return site, {**__import__("os").environ, "PYTHONPATH": str(site)}


def check_the_lookup_line(summary: dict, printed: str, report: str) -> None:
    """The prompt-lookup pair decoded in wall clock (nothing trained): fixed K = 8, vLLM's table and, where a token
    head ships, its rule, each with its speedup and interval on the screen, in the report and first in the figure, and
    every rule's tokens the target alone's at T = 0."""
    from specheads.demo.figure import panels

    line = summary["lookup"]
    ships = (Path(__file__).parents[1] / "heads" / "shipped" / "smollm2-lookup" / "config.json").is_file()
    rules = {"constant_k:8", "lookup_table:0.043", *(["lookup_plan:0.043"] if ships else [])}
    assert set(line["rules"]) == rules and (line["prompts"], line["max_new_tokens"], line["threads"]) == (3, 80, 1)
    assert line["packed_layers"] > 0 and summary["seconds"]["lookup_wall_clock"] > 0
    screen = printed[printed.index("  lookup   prompt lookup as the draft"):]
    assert ("3 copy-heavy prompts (code-edit, chat-repeat, passage) × 80 tokens, T = 0, B = 1, 1 thread, both sides "
            "reading prepacked weights") in screen
    assert "one-token forwards here (the planners' price)" in screen  # the verify curve timed on this machine
    for rule, row in line["rules"].items():
        assert row["same_as_target"] == 3, rule  # exact: at T = 0 the target alone's tokens on every prompt
        assert row["interval"][0] <= row["speedup"] <= row["interval"][1]
        shown = f"{row['speedup']:.2f}× [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}]"
        assert shown in screen and html.escape(shown) in report, rule
    if not ships:
        assert "the token head's rule: no token head ships at heads/shipped/smollm2-lookup" in screen
    first = panels(summary)[0]
    assert first.title.startswith("prompt-lookup pair") and len(first.rows) == len(rules)


@pytest.mark.integration
def test_an_installed_copy_runs_the_quick_demo_end_to_end_beside_a_users_train_and_eval(installed, tmp_path):
    """An installed copy (only `specheads` in site-packages, no configs/ beside it) runs the quick demo from a folder
    with the user's own train.py and eval.py; `import train` there finds the user's file. The demo's outputs agree
    with each other, a second run resumes, and the full-size demo into its folder is refused."""
    import subprocess
    import sys

    from specheads.heads import load_head

    site, env = installed
    user = tmp_path / "user"
    user.mkdir()
    for name in ("train.py", "eval.py"):
        (user / name).write_text("raise SystemExit('the user\\'s own module was imported instead of specheads')\n")

    def demo(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specheads", "demo", "--out", "demo", "--progress", "false", *extra],
                              cwd=user, capture_output=True, text=True, timeout=900, env=env)

    first = demo("--quick")
    assert first.returncode == 0, first.stderr[-3000:]
    printed, out = first.stdout, user / "demo"
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["complete"] and summary["data"]["labelled_tokens"] == manifest["counts"]["labelled_tokens"] > 500
    assert set(summary["heads"]) == {*EVALUATED, SHIPPED}
    report = (out / "report.html").read_text()
    # the report opens on the figure of speedup by rule, then the table (tests/test_demo_report_browser.py renders it)
    assert (out / "speedup.png").is_file() and report.index('src="speedup.png"') < report.index("<table")
    for head in HEADS:
        assert (out / "train" / head / "checkpoints" / "last.ckpt").is_file()
    module, _ = load_head(str(out / "heads" / "expected"))
    assert module.decides == "before_draw"  # the verify budget's planner, exported beside the evaluated heads
    # the head that ships with specheads (package data of the installed copy) decoded beside the demo's, on the demo's
    # prompts less the ones it trained or calibrated on, with the rule its folder carries read from the costs
    shipped = json.loads((out / "eval" / SHIPPED / "metrics.json").read_text())
    assert summary["heads"][SHIPPED]["exported"] == 'load_head("smollm2-ontime")' in printed
    assert summary["heads"][SHIPPED]["auc"] == shipped["offline"]["head"]["auc"]
    assert shipped["decoding"]["prompts_dropped_as_seen_in_training"] > 0 and shipped["data"]["prompts"] >= 1
    assert summary["heads"][SHIPPED]["decoding"]["head_cost_speedup"] > 0
    for head in EVALUATED:
        metrics = json.loads((out / "eval" / head / "metrics.json").read_text())
        figures = summary["heads"][head]
        # the summary's numbers are metrics.json's, and the printed screen shows them
        assert figures["auc"] == metrics["offline"]["head"]["auc"]
        assert figures["binary_kl"] == metrics["offline"]["head"]["binary_kl"]
        assert figures["best_baseline_auc"] == metrics["offline"][metrics["offline_comparison"]["baseline"]]["auc"]
        assert figures["binary_kl_constant"] == metrics["offline"]["constant"]["binary_kl"]
        assert figures["decision_rule"] == metrics["decision_rule"]
        tuned = {r["policy"]: r for r in metrics["decoding"]["policies"] if r.get("tuned")}
        assert figures["decoding"]["constant_k_speedup"] == tuned["constant_k"]["modelled_speedup"]
        if "modelled_speedup" in figures["decoding"]:
            learned = "head" if head == "ontime" else "sprinter"
            assert figures["decoding"]["modelled_speedup"] == tuned[learned]["modelled_speedup"]
            assert f"{figures['decoding']['modelled_speedup']:.3f}x" in printed
        assert {f"{figures['auc']:.3f}", f"{figures['binary_kl']:.3f}", f"{figures['best_baseline_auc']:.3f}"} <= numbers(printed)
        # every plot of both heads is in the demo report and on disk
        for plot in metrics["plots"].values():
            assert f'src="eval/{head}/{plot}"' in report and (out / "eval" / head / plot).is_file()
        # Π â per round position, and the serving table's plot (the quick demo serves at B = 2)
        stop_head_plots = {"cumulative_reliability", "serving"} if head == "ontime" else set()
        assert set(metrics["plots"]) == {"roc", "reliability", "pareto", "acceptance_lengths", *stop_head_plots}
        # the exported head loads (here, from the editable install) and carries the rule eval tuned
        module, rule = load_head(str(out / "heads" / head))
        # the on-time head decides the moment a candidate is drafted, from the state that produced q for it
        assert module.reads == "context_state" and (head != "ontime" or module.decides == "at_draft")
        assert rule.as_dict() == metrics["decision_rule"]
    assert "report.html" in printed
    # the quick demo is too small to rank anything, and its summary says so and where the larger runs are
    assert "do not settle" in printed and "docs/results.md" in printed and "smoke run" in printed
    # the headline names constant K, confidence and the strongest field rule; the serving line the verify budget
    line = next(text for text in printed.splitlines() if "modelled speedup" in text and "at h =" in text)
    assert "vs best constant K" in line and "vs confidence" in line and "strongest field rule" in line
    assert "verify budget (goodput planner, the head) vs constant K — draft at 0.2 × target: B = 2" in printed
    check_the_lookup_line(summary, printed, report)
    lookup_kept = (out / "lookup" / "wall_clock.json").stat().st_mtime_ns
    sprinter_runs = json.loads((out / "eval" / "sprinter" / "runs.json").read_text())["runs"]
    assert all(r["reused"] for r in sprinter_runs if r["policy"] == "constant_k")  # taken from the on-time head's eval
    stamps = {head: (out / "train" / head / "checkpoints" / "last.ckpt").stat().st_mtime_ns for head in HEADS}
    # a second run resumes: no retraining, no re-evaluation
    again = demo("--quick")
    assert again.returncode == 0 and again.stdout.count("already evaluated") == 3, again.stderr[-3000:]
    assert stamps == {head: (out / "train" / head / "checkpoints" / "last.ckpt").stat().st_mtime_ns for head in HEADS}
    assert (out / "lookup" / "wall_clock.json").stat().st_mtime_ns == lookup_kept  # the wall-clock line kept too
    # the full-size demo into the quick demo's folder is refused, naming what differs
    full = demo()
    assert full.returncode == 2
    assert "prompts" in full.stderr and "--overwrite" in full.stderr and "demo stopped at `gen`" in full.stderr
    where = subprocess.run([sys.executable, "-c", "import specheads.train, train"], cwd=user, capture_output=True,
                           text=True, env=env)
    assert "the user's own module was imported" in where.stderr  # `train` is the user's; specheads.train imported first
