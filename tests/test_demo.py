"""`specheads demo`: its stage configs are valid (fast tier) and the quick demo runs end to end (integration)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from specheads.cli import main
from specheads.demo.config import CONFIGS, DemoConfig
from specheads.demo.stages import HEADS

SIZES = ("full", "quick")


@pytest.mark.parametrize("size", SIZES)
def test_demo_gen_and_eval_configs_are_valid(size):
    from specheads.data_gen.cli import parse_config as gen_config
    from specheads.eval.cli import parse_config as eval_config

    gen = gen_config(["--config", str(CONFIGS / "gen/smollm2-demo.yaml"), "--config", str(CONFIGS / f"demo/{size}/gen.yaml")])
    gen.validate()
    assert gen.target.path == "embedded:smollm2" and gen.mixing.ratios() == [0.15, 1.0]  # rows for both heads
    evaluation = eval_config(["--config", str(CONFIGS / f"demo/{size}/eval.yaml"), "--head", "h", "--data", "d"])
    evaluation.validate()
    assert evaluation.num_decode_prompts >= 2 and max(evaluation.constant_ks) <= evaluation.max_draft


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("head", HEADS)
def test_demo_train_configs_are_valid(size, head, tmp_path, capsys):
    override = CONFIGS / f"demo/{size}/{head}.yaml"
    assert main(["train", "fit", "--config", str(CONFIGS / f"train/{head}.yaml"), "--config", str(override),
                 "--data.path", str(tmp_path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    wanted = yaml.safe_load(override.read_text())
    for section, values in wanted.items():
        assert {k: printed[section][k] for k in values} == values  # the override reached the resolved config


def test_demo_defaults_and_refusal(tmp_path, capsys):
    assert DemoConfig().folder == Path("runs/demo") and DemoConfig(quick=True).folder == Path("runs/demo-quick")
    assert main(["demo", "--bogus"]) == 2
    assert "specheads demo" in capsys.readouterr().err


def numbers(text: str) -> set[str]:
    return set(re.findall(r"[-+]?\d+\.\d{3}", text))


def test_the_summary_says_what_the_demo_is_too_small_to_settle():
    from specheads.demo.summary import scale_lines

    def figures(margin_ci: list[float], gain_ci: list[float], test_prompts: int) -> dict:
        return {"title": "SpecDec++ head", "held_out_tokens": 538, "best_baseline": "draft_prob",
                "auc_margin_ci": margin_ci, "decoding": {"gain_vs_constant_k_ci": gain_ci, "test_prompts": test_prompts,
                                                         "indicative": test_prompts < 8}}

    settled = scale_lines({"heads": {"specdecpp": figures([0.01, 0.04], [0.02, 0.09], 16)}})
    assert settled == []
    small = "\n".join(scale_lines({"heads": {"specdecpp": figures([-0.014, 0.018], [0.02, 0.09], 16)}}))
    assert "538 held-out tokens and 16 test prompts do not settle whether it ranks tokens better than draft_prob" in small
    assert "decodes faster" not in small and "docs/results.md" in small
    few = "\n".join(scale_lines({"heads": {"specdecpp": figures([0.01, 0.04], [0.02, 0.09], 3)}}))
    assert "3 test prompts do not settle whether it decodes faster than the best constant K" in few


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
    assert set(summary["heads"]) == set(HEADS)
    report = (out / "report.html").read_text()
    for head in HEADS:
        assert (out / "train" / head / "checkpoints" / "last.ckpt").is_file()
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
            learned = "head" if head == "specdecpp" else "sprinter"
            assert figures["decoding"]["modelled_speedup"] == tuned[learned]["modelled_speedup"]
            assert f"{figures['decoding']['modelled_speedup']:.3f}x" in printed
        assert {f"{figures['auc']:.3f}", f"{figures['binary_kl']:.3f}", f"{figures['best_baseline_auc']:.3f}"} <= numbers(printed)
        # every plot of both heads is in the demo report and on disk
        for plot in metrics["plots"].values():
            assert f'src="eval/{head}/{plot}"' in report and (out / "eval" / head / plot).is_file()
        stop_head_plots = {"cumulative_reliability"} if head == "specdecpp" else set()  # Π â per round position
        assert set(metrics["plots"]) == {"roc", "reliability", "pareto", "acceptance_lengths", *stop_head_plots}
        # the exported head loads (here, from the editable install) and carries the rule eval tuned
        module, rule = load_head(str(out / "heads" / head))
        assert module.reads == ("candidate_state" if head == "specdecpp" else "context_state")
        assert rule.as_dict() == metrics["decision_rule"]
    assert "report.html" in printed
    # the quick demo is too small to rank anything, and its summary says so and where the larger runs are
    assert "do not settle" in printed and "docs/results.md" in printed
    stamps = {head: (out / "train" / head / "checkpoints" / "last.ckpt").stat().st_mtime_ns for head in HEADS}
    # a second run resumes: no retraining, no re-evaluation
    again = demo("--quick")
    assert again.returncode == 0 and again.stdout.count("already evaluated") == 2, again.stderr[-3000:]
    assert stamps == {head: (out / "train" / head / "checkpoints" / "last.ckpt").stat().st_mtime_ns for head in HEADS}
    # the full-size demo into the quick demo's folder is refused, naming what differs
    full = demo()
    assert full.returncode == 2
    assert "prompts" in full.stderr and "--overwrite" in full.stderr and "demo stopped at `gen`" in full.stderr
    where = subprocess.run([sys.executable, "-c", "import specheads.train, train"], cwd=user, capture_output=True,
                           text=True, env=env)
    assert "the user's own module was imported" in where.stderr  # `train` is the user's; specheads.train imported first
