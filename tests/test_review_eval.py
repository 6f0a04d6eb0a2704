"""The review's eval defects: a split target keeps its placement, the grid-edge warning under a TV budget, stale
plots, the ROC legend, the eval folder's lock, a damaged runs.json, SPRINTER in the serving table."""

import json

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from test_eval import eval_args, table_of
from test_split_target import CPU, SPLIT_MAP

from specheads.cli import main
from specheads.decoding import RoundEngine, make_policy
from specheads.eval import plots
from specheads.eval.report import rival_lines, serving_lines
from specheads.eval.reuse import ACCOUNTING, load_reusable
from specheads.eval.run import place, tune_on_dev
from specheads.eval.serving import NOT_SERVED, CostCurve, request_rounds, serve
from specheads.eval.sweep import RunRecord
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, load_pair
from specheads.plumbing.errors import UsageError
from specheads.plumbing.lock import folder_lock


def test_decoding_keeps_a_split_targets_placement_and_its_tokens(tiny_model):
    whole = load_pair(ModelSpec(path=str(tiny_model)), ModelSpec(skip_layers=[2]), devices=CPU)
    split = load_pair(ModelSpec(path=str(tiny_model), device_map=SPLIT_MAP), ModelSpec(skip_layers=[2]), devices=CPU)
    offloaded = split.target.model.layers[3].self_attn.q_proj.weight
    for model in (split.target, split.draft):
        place(model, torch.device("cpu"))
    assert split.target.hf_device_map == SPLIT_MAP
    assert split.target.model.layers[3].self_attn.q_proj.weight is offloaded and offloaded.device.type == "meta"
    policy = make_policy("constant_k", 3)
    runs = [RoundEngine(pair.target, pair.draft, SamplingTransform(1.0), stop_ids=[]).decode_one([5, 9, 11], policy,
                                                                                                      10, seed=3)
            for pair in (whole, split)]
    assert runs[0].tokens == runs[1].tokens and runs[0].target_calls == runs[1].target_calls


def test_a_threshold_the_tv_budget_stops_at_is_no_grid_edge():
    # every drafted token has accept 0.5 and prediction 0.4: threshold 0.3 passes all (distance 0.5), 0.5 and 0.7 none
    table = table_of(np.full(50, 1.0), np.full(50, 0.4), np.repeat(np.arange(5), 10))
    table.accept = np.full(50, 0.5)
    dev = [{"policy": "sprinter", "threshold": t, "modelled_speedup": s} for t, s in ((0.3, 2.0), (0.5, 1.5), (0.7, 1.2))]
    dev += [{"policy": "constant_k", "threshold": k, "modelled_speedup": s} for k, s in ((1.0, 1.1), (2.0, 1.3), (3.0, 1.2))]
    tuned, edges = tune_on_dev(dev, table, "verify", max_tv=0.05)
    assert tuned == {"sprinter": 0.5, "constant_k": 2.0}
    assert edges == {}  # 0.5 is the end of what the budget allows, not of the grid
    assert [row["within_tv_budget"] for row in dev if row["policy"] == "sprinter"] == [False, True, True]
    dev[2]["modelled_speedup"] = 1.6  # the closest threshold now wins within the budget: the grid's real end
    assert tune_on_dev(dev, table, "verify", max_tv=0.05)[1] == {"sprinter": "highest"}


def test_the_roc_legend_names_which_auc_each_figure_is(monkeypatch, tmp_path):
    rng = np.random.default_rng(1)
    labels = rng.random(400)
    table = table_of(labels, np.clip(labels + rng.normal(0, 0.3, 400), 0.01, 0.99), np.repeat(np.arange(20), 20))
    drawn = {}
    monkeypatch.setattr(plots, "save", lambda figure, path: drawn.update(legend=[t.get_text() for t in
                                                                                   figure.axes[0].get_legend().get_texts()]))
    draws = np.random.default_rng(0).random(400) < labels
    offline = {name: {"auc": 0.6, "auc_bernoulli": float(roc_auc_score(draws, score))}
               for name, score in table.scores().items()}
    plots.roc_plot(table, offline, tmp_path / "roc.png", seed=0)
    head = next(text for text in drawn["legend"] if text.startswith("learned head"))
    assert head == f"learned head (AUC {offline['head']['auc_bernoulli']:.3f} on draws, 0.600 soft)"
    table.label = (labels > 0.5).astype(float)  # hard labels: one AUC, the curve's own
    plots.roc_plot(table, offline, tmp_path / "roc.png", seed=0)
    assert "learned head (AUC 0.600)" in drawn["legend"]


def test_a_report_lists_only_its_own_plots_and_runs(trained, tmp_path):
    data, root = trained
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    out = tmp_path / "report"
    assert main(eval_args(head, data, out)) == 0
    assert (out / "pareto.png").exists() and (out / "runs.json").exists()
    assert main(eval_args(head, data, out, "--num-decode-prompts", "0")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["plots"]) == {"roc", "reliability"} | ({"cumulative_reliability"} if metrics.get("cumulative") else set())
    assert not (out / "pareto.png").exists() and not (out / "acceptance_lengths.png").exists()
    assert not (out / "runs.json").exists() and "pareto.png" not in (out / "report.md").read_text()


def test_a_second_eval_into_a_folder_being_written_is_refused(trained, tmp_path, capsys):
    data, root = trained
    out = tmp_path / "report"
    with folder_lock(out, "eval"):
        code = main(eval_args(root / "specdecpp" / "checkpoints" / "last.ckpt", data, out, "--num-decode-prompts", "0"))
    assert code != 0 and not (out / "metrics.json").exists()
    assert "is being written by another `specheads eval`" in capsys.readouterr().err


def test_a_damaged_or_older_runs_file_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "earlier"
    folder.mkdir()
    context = {"models": {}, "sampling": {}, "max_new_tokens": 8, "max_draft": 4, "seed": 0, "device": "cpu",
               "accounting": ACCOUNTING, "prompts": []}
    (folder / "runs.json").write_text('{"context": {"models": ')
    with pytest.raises(UsageError, match=r"runs.json is not readable JSON .*drop --reuse-runs"):
        load_reusable(str(folder), context)
    (folder / "runs.json").write_text(json.dumps({"context": context, "runs": [{"policy": "svip"}]}))
    with pytest.raises(UsageError, match=r"run 0 is not a decoding run record"):
        load_reusable(str(folder), context)
    older = {k: v for k, v in context.items() if k != "accounting"}  # decoded before runs ended at a stop token
    (folder / "runs.json").write_text(json.dumps({"context": older, "runs": []}))
    with pytest.raises(UsageError, match=r"another accounting than this run"):
        load_reusable(str(folder), context)


def test_the_serving_table_says_why_sprinter_is_not_in_it_and_counts_what_runs_emitted():
    lines = serving_lines({"batch_sizes": [1, 8], "cost_curves": {"source": "given"}, "rows": [], "best": {},
                           "left_out": {"sprinter": NOT_SERVED["sprinter"]}}, "##", "serving.png")
    assert any(line.startswith("sprinter is not in this table: SPRINTER's target call checks one") for line in lines)
    # a run that ended at a stop token inside its last round: 3 rounds of 2 accepted would be 9 tokens, it emitted 7
    run = RunRecord("constant_k", 3.0, "p", "test", emitted=7, drafted=9, accepted=6, target_calls=3, draft_forwards=9,
                    seconds=1.0, forward_seconds=1.0, accepted_per_round=[2, 2, 2], target_logprob=-1.0,
                    drafted_per_round=[3, 3, 3])
    assert request_rounds(run) == [(3, 3, [1, 1, 1]), (3, 3, [1, 1, 1]), (3, 1, [1, 1, 1])]
    flat = CostCurve((1, 128), (1.0, 1.0))
    assert serve([request_rounds(run)], 1, flat, flat)["tokens"] == 7


def test_a_batch_policy_is_compared_with_the_best_per_request_policy_at_each_batch_size_and_view():
    """The serving bar asks the verify budget to beat the best per-request policy, not only constant K: each live row
    names that policy (the oracle aside) and its paired change against it."""
    from specheads.eval.serving import compare

    def row(policy, size, tokens, how):  # prompts 0..3, one second each, `tokens` tokens each
        return {"policy": policy, "batch_size": size, "costs": "measured", "decoded": how,
                "tokens_per_s": float(tokens), "per_request": {p: [float(tokens), 1.0] for p in range(4)}}

    rows = [row("constant_k", 8, 10, "replayed"), row("head", 8, 12, "replayed"), row("oracle", 8, 20, "replayed"),
            row("budget", 8, 15, "live"), row("constant_k", 32, 10, "replayed"), row("budget", 32, 9, "live")]
    compare(rows, resamples=50, seed=0)
    budget8, budget32 = rows[3], rows[5]
    assert budget8["best_per_request"] == "head" and budget8["vs_best_per_request"] == pytest.approx(0.25)
    assert budget8["vs_best_per_request_ci"] == pytest.approx([0.25, 0.25])
    assert budget32["best_per_request"] == "constant_k" and budget32["vs_best_per_request"] == pytest.approx(-0.1)
    assert "best_per_request" not in rows[1] and all("per_request" not in r for r in rows)
    lines = rival_lines(rows, "measured")
    assert lines == ["budget against the best per-request policy: B = 8: +25.0% [+25.0%, +25.0%] against head; "
                     "B = 32: -10.0% [-10.0%, -10.0%] against constant_k."]
