"""The expected-acceptance label and head, and the batch-level planners: the goodput greedy, exactness of the verify
budget and SmartSpec's K at B >= 4, and the distortion the same greedy makes when fed a score that read the token."""

import math

import pytest
import torch
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.data_gen.labels import label_positions
from specheads.dataset.targets import token_targets
from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts, round_seconds, served_throughput
from specheads.decoding.online import Outcome
from specheads.decoding.planners import BudgetPlanner, SmartSpecPlanner, goodput_verify_lengths
from specheads.decoding.rules import Drafted
from specheads.heads import ExpectedAcceptanceHead, OnTimeAcceptanceHead, build_head
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


def test_the_label_is_the_acceptance_of_a_draw_averaged_over_q():
    """α = Σ_v min(p_v, q_v) = E_{ŷ∼q}[min(1, p(ŷ)/q(ŷ))] = 1 − TV(p, q), enumerated on a 5-token vocabulary."""
    torch.manual_seed(0)
    target, draft = torch.randn(4, 5) * 2, torch.randn(4, 5) * 2
    for temperature in (1.0, 0.7):
        transform = SamplingTransform(temperature)
        labels = label_positions(target, draft, transform, torch.rand(4, dtype=torch.float64))
        p, q = transform.log_probs(target).exp(), transform.log_probs(draft).exp()
        for i in range(4):
            mean_acceptance = sum(float(q[i, v]) * min(1.0, float(p[i, v] / q[i, v])) for v in range(5))
            total_variation = 0.5 * float((p[i] - q[i]).abs().sum())
            assert float(labels.beta[i]) == pytest.approx(mean_acceptance, abs=1e-6)
            assert float(labels.beta[i]) == pytest.approx(1 - total_variation, abs=1e-6)


def test_an_expected_acceptance_head_reads_nothing_of_the_drawn_token():
    head = build_head("expected_acceptance", hidden_size=8, depth=1, extra_features=["entropy", "top1"])
    assert head.decides == "before_draw" and head.purpose == "expect" and head.config["decides"] == "before_draw"
    for features, embedding in ((["logq"], 0), (["entropy", "q"], 0), ([], 8)):
        with pytest.raises(UsageError, match="before the candidate is drawn"):
            build_head("expected_acceptance", hidden_size=8, extra_features=features, candidate_embedding_size=embedding)
    head.set_calibration(None)  # a survival product to calibrate, like a stop head's
    batch = {"valid": torch.tensor([[True, True, False]]), "is_draft": torch.tensor([[False, True, True]]),
             "beta": torch.tensor([[0.7, 0.4, 0.1]]), "accept": torch.tensor([[1.0, 0.2, 0.3]])}
    mask, label = token_targets(batch, "expect")
    assert mask.tolist() == [[True, True, False]] and label[mask].tolist() == pytest.approx([0.7, 0.4])
    mask, label = token_targets(batch, "expect", realised=True)  # judged on the drafted candidates' acceptance
    assert mask.tolist() == [[False, True, False]] and label[mask].tolist() == pytest.approx([0.2])


def test_the_goodput_greedy_on_hand_computed_cases():
    flat = CostCurve((1, 64), (1.0, 1.0))  # a forward costs the same whatever it holds: verify everything drafted
    assert goodput_verify_lengths({0: [0.9, 0.5], 1: [0.2]}, flat) == ({0: 2, 1: 1}, 0.0)
    linear = CostCurve((1, 2), (1.0, 2.0))  # t(n) = n: a candidate pays only if its S >= the goodput, which is 1
    assert goodput_verify_lengths({0: [0.9, 0.5], 1: [0.2]}, linear) == ({0: 0, 1: 0}, 0.9)
    # t(n) = 4 + n: B = 2 gives 2/6; + S 0.9 -> 2.9/7 = 0.414; + 0.5 -> 3.4/8 = 0.425; + 0.2 -> 3.6/9 = 0.4 stops
    affine = CostCurve((1, 2), (5.0, 6.0))
    assert goodput_verify_lengths({0: [0.9, 0.5], 1: [0.2]}, affine) == ({0: 2, 1: 0}, 0.2)
    # the greedy takes positions across rows by S, each row a prefix; the refused S is the next round's drafting floor
    assert goodput_verify_lengths({0: [0.9, 0.3], 1: [0.8, 0.7]}, affine) == ({0: 1, 1: 2}, 0.3)
    planner = BudgetPlanner(ServingCosts(affine, affine), floor=0.1)
    assert not planner.stops(0, Drafted(index=1, prob=0.5, entropy=1.0, acceptance=0.25))
    rounds = {row: [Drafted(index=i, prob=0.5, entropy=1.0, acceptance=s) for i, s in enumerate(survival, 1)]
              for row, survival in {0: [0.9, 0.3], 1: [0.8, 0.7]}.items()}
    assert planner.verify_lengths(rounds) == {0: 1, 1: 2}
    assert planner.stops(0, Drafted(index=1, prob=0.5, entropy=1.0, acceptance=0.25))


def test_round_costs_and_smartspec_k_on_hand_computed_cases():
    costs = ServingCosts(CostCurve((1, 2), (2.0, 3.0)), CostCurve((1, 2), (11.0, 12.0)))  # 1 + n and 10 + n
    record = RoundRecord(requests=[0, 1], drafted=[2, 1], verified=[1, 1], emitted=[2, 1])
    assert round_seconds(record, costs) == (3 + 2) + 14  # draft steps with 2 rows then 1; target over 2 + 2 tokens
    served = served_throughput([record], costs)
    assert served["tokens"] == 3 and served["per_request"][0] == [2, 9.5]
    planner = SmartSpecPlanner(costs)
    # a = 0.9: 4 Σ 0.9^j / (5 K + 14 + 4 K + 4 · 0.9^K), the last term the draft's catch-up a round defers when its
    # rows' last token goes unread (K = 0; or every candidate accepted): t_draft(8) − t_draft(4) = 4; K = 3
    planner.accepted, planner.rejections = 9.0, 1.0
    assert planner.round_cap(4, 6) == 3 == max(
        range(7), key=lambda k: 4 * sum(0.9**j for j in range(k + 1)) / (5 * k + 14 + 4 * k + 4 * 0.9**k))
    planner.accepted, planner.rejections = 0.1, 9.9  # a = 0.01: drafting does not pay, plain target decoding
    assert planner.round_cap(4, 6) == 0
    # one row checked 2 (accepted 1, then a rejection; its third candidate has no outcome), the other none
    planner.observe({0: [Outcome(1, 0.9, True), Outcome(2, 0.5, False)], 1: []})
    assert planner.accepted == pytest.approx(0.9 * 0.1 + 0.1) and planner.rejections == pytest.approx(0.9 * 9.9 + 0.1)
    before = planner.rate
    planner.observe({0: [], 1: []})  # a K = 0 round checks nothing: the estimate drifts back towards the prior 0.7
    assert before < planner.rate < 0.7 and planner.round_cap(4, 6) == 0
    for _ in range(60):
        planner.observe({0: []})
    assert planner.rate == pytest.approx(0.7, abs=0.01) and planner.round_cap(4, 6) > 0  # drafting is tried again
    assert SmartSpecPlanner(costs, max_k=2, accepted=9.0, rejections=1.0).round_cap(4, 6) <= 2


def test_the_budget_rule_refuses_a_head_that_read_the_drawn_token(tiny_pair):
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["q"], candidate_embedding_size=16)
    costs = ServingCosts(CostCurve((1, 2), (1.0, 1.5)), CostCurve((1, 2), (1.0, 1.5)))
    with pytest.raises(UsageError, match="expected_acceptance"):
        engine.decode([PROMPT], make_policy("budget", 0.1, max_draft=3), LENGTH, [0], on_time, costs=costs)
    with pytest.raises(UsageError, match="cost curves"):
        engine.decode([PROMPT], make_policy("smartspec", 3, max_draft=3), LENGTH, [0])


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


def ended_rounds(results, rule) -> set[str]:
    """How the rounds that could draft ended: "early" (the rule stopped before the cap) or "at the cap" (the cap the
    tokens left allow: one fewer than them, the last slot being the target's token)."""
    ends = set()
    for result in results:
        room = LENGTH
        for drafted, accepted in zip(result.drafted_per_round, result.accepted_per_round):
            if rule.cap(room) > 0:
                ends.add("early" if drafted < rule.cap(room) else "at the cap")
            room -= accepted + 1  # no stop tokens: every round adds its accepted candidates and the target's token
    return ends


def test_the_batch_and_run_time_rules_sample_the_target_distribution_at_batch_10(tiny_pair):
    """500 requests served 10 rows at a time with continuous batching: the budget's verify lengths (from a random
    expected-acceptance head, on a cost curve that makes it verify some prefixes and drop the rest), SmartSpec's
    per-round K, and the stop rules refitted at run time (vLLM's online estimator, transformers' ROC-tuned
    confidence, its heuristic K schedule) leave every request's output the target's distribution."""
    target, draft = tiny_pair
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    head = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy", "top1"]).eval()
    torch.manual_seed(5)
    torch.nn.init.normal_(head.out.weight, std=2.0)  # survival products that vary with the state
    # flat up to 15 tokens, then steep: the greedy cuts inside a round even where the head's survivals are all alike
    budget_costs = ServingCosts(CostCurve((1, 8), (1.0, 1.6)), CostCurve((1, 15, 20), (1.0, 1.0, 4.0)))
    smartspec_costs = ServingCosts(CostCurve((1, 8), (0.1, 0.16)), CostCurve((1, 5, 30), (1.0, 1.2, 1.8)))
    runs = 500
    for name, threshold, costs in (("budget", 0.05, budget_costs), ("smartspec", 3, smartspec_costs),
                                   ("vllm_online", 0.4, None), ("adaedl", 0.65, None), ("transformers", 0.4, None),
                                   ("transformers_heuristic", 2, None)):
        log: list[RoundRecord] = []
        results = engine.decode([PROMPT] * runs, make_policy(name, threshold, max_draft=3), LENGTH, list(range(runs)),
                                head, batch_size=10, costs=costs, log=log)
        assert chi_square_p([tuple(r.tokens) for r in results], exact) > 1e-3, name
        assert max(len(r.requests) for r in log) == 10 and sum(sum(r.emitted) for r in log) == runs * LENGTH
        if name == "budget":  # it dropped drafted candidates in some rounds and kept all in others
            assert any(v < d for r in log for v, d in zip(r.verified, r.drafted))
            assert any(v == d > 0 for r in log for v, d in zip(r.verified, r.drafted))
        elif name in ("smartspec", "transformers_heuristic"):  # the batch's K moved with the observed acceptance
            assert len({max(r.drafted) for r in log}) > 1
        else:  # the run-time adapted stop rules ended some rounds early and let others run to the cap
            assert ended_rounds(results, make_policy(name, threshold, max_draft=3)) == {"early", "at the cap"}, name


def output_distribution(p: list[float], q: list[float], survival_of, checks=None) -> list[float]:
    """The exact distribution of one emitted token when the draft proposes ŷ ~ q and a planner, fed `survival_of(ŷ)`,
    decides whether the target checks ŷ (accept with min(1, p/q), else resample from norm(max(0, p − q))) or draws
    its own token from p. `checks(survival)` is the planner's decision; SV's greedy by default."""
    cost = CostCurve((1, 2), (1.0, 1.5))  # the greedy checks ŷ exactly when its survival is at least 0.5
    checks = checks or (lambda survival: goodput_verify_lengths({0: [survival]}, cost)[0][0] == 1)
    residual = [max(0.0, a - b) for a, b in zip(p, q)]
    residual = [r / sum(residual) for r in residual]
    out = [0.0] * len(p)
    for drafted, q_drafted in enumerate(q):
        if checks(survival_of(drafted)):
            accept = min(1.0, p[drafted] / q_drafted)
            out[drafted] += q_drafted * accept
            out = [o + q_drafted * (1 - accept) * r for o, r in zip(out, residual)]
        else:
            out = [o + q_drafted * x for o, x in zip(out, p)]
    return out


def test_the_greedy_fed_a_score_that_read_the_drawn_token_distorts_the_output():
    """The trap the budget avoids: ranking a drafted token by a score that has read it (here its own acceptance
    min(1, p/q), what an on-time head predicts) drops exactly the tokens likely to be rejected, and the output is no
    longer p. The same greedy fed the score known before the draw (α = Σ min(p, q)) returns p exactly."""
    p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    alpha = sum(min(a, b) for a, b in zip(p, q))
    exact = output_distribution(p, q, lambda drafted: alpha)
    assert exact == pytest.approx(p, abs=1e-12)
    lossy = output_distribution(p, q, lambda drafted: min(1.0, p[drafted] / q[drafted]))
    assert lossy == pytest.approx([0.5, 0.45, 0.05], abs=1e-12)
    assert 0.5 * sum(abs(a - b) for a, b in zip(lossy, p)) == pytest.approx(0.15) and not math.isclose(lossy[2], p[2])


@pytest.fixture(scope="module")
def expected_checkpoint(trained, tmp_path_factory):
    """An expected-acceptance head trained on the tiny data for two epochs, calibrated at 3 positions."""
    from pathlib import Path

    from specheads.cli import main

    data, _ = trained
    root = tmp_path_factory.mktemp("expected")
    config = Path(__file__).parents[1] / "configs" / "train" / "expected-acceptance.yaml"
    assert main(["train", "fit", "--config", str(config), "--data.path", str(data), "--data.val_fraction", "0.3",
                 "--data.calibration_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir", str(root),
                 "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "2",
                 "--model.calibrate_positions", "3"]) == 0
    return root / "checkpoints" / "last.ckpt"


def test_an_expected_acceptance_head_trains_calibrates_serves_live_and_exports(trained, expected_checkpoint, tmp_path):
    """The whole path on the tiny pair: train on α with a per-position calibration, eval (its AUC against the realised
    acceptance, the verify budget decoded live with continuous batching), export with `decides: before_draw`."""
    import json

    from specheads.artifacts.checkpoint import load_trained
    from specheads.cli import main
    from specheads.heads import load_head

    data, _ = trained
    checkpoint = expected_checkpoint
    head = load_trained(str(checkpoint))
    assert head.head.head_type == "expected_acceptance" and head.head.calibration.positions == 3
    out = tmp_path / "report"
    assert main(["eval", "--head", str(checkpoint), "--data", str(data), "--out", str(out), "--num-decode-prompts", "6",
                 "--max-new-tokens", "6", "--max-draft", "3", "--constant-ks", "[1,3]", "--head-thresholds", "[0.5]",
                 "--stop-shares", "[0.5]", "--bootstrap", "10", "--progress", "false",
                 "--serving-batch-sizes", "[1, 3]", "--test-samples", "3", "--serving-costs", str(write_costs(tmp_path))]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data"]["label"].startswith("accept = min(1, p/q) of the drafted candidate")
    assert 0 <= metrics["offline"]["head"]["auc"] <= 1 and {r["k"] for r in metrics["cumulative"]} == {1, 2, 3}
    serving = metrics["decoding"]["serving"]
    budget = [r for r in serving["rows"] if r["policy"] == "budget"]
    assert {(r["batch_size"], r["decoded"]) for r in budget} == {(1, "live"), (3, "live")} and "budget" not in serving["left_out"]
    assert all(r["tokens_per_s"] > 0 and r["vs_constant_k"] is not None for r in budget)
    assert all(r["best_per_request"] not in (None, "oracle", "budget", "smartspec") for r in budget)
    report = (out / "report.md").read_text()
    assert "| budget |" in report and "budget against the best per-request policy: B = 1:" in report
    exported = tmp_path / "head"
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(exported), "--report", str(out)]) == 0
    card = (exported / "README.md").read_text()
    assert json.loads((exported / "config.json").read_text())["decides"] == "before_draw" and "before_draw" in card
    loaded, rule = load_head(str(exported))
    hidden, signals = torch.randn(3, 32), torch.randn(3, 2)
    assert torch.equal(loaded.predict(hidden, signals, position=2), head.head.predict(hidden, signals, position=2))


def test_eval_serves_the_online_planners_beside_dcut_at_every_batch_size_in_both_accelerator_views(
        trained, expected_checkpoint, tmp_path):
    """Issue 62's serving table, scaled down: the goodput planner fed the head calibrated online, the same planner fed
    vLLM's merged estimator and D-Cut, decoded live at three batch sizes in both accelerator views (roofline presets),
    the queue filled by --test-samples; every cell decoded, and the head's planner compared with the free ones in
    every view and B, in the order the flag names them; how often each online estimate refitted is reported, and
    that a few rounds never refit it."""
    import json

    from specheads.cli import main

    data, _ = trained
    views = ["h100-llama3.1-8b-llama3.2-1b", "4xh100-llama3.1-70b-llama3.1-8b"]
    policies = ["vllm_current_adaptive", "goodput_online", "dcut"]
    out = tmp_path / "serving"
    args = ["eval", "--head", str(expected_checkpoint), "--data", str(data), "--out", str(out), "--num-decode-prompts",
            "3", "--max-new-tokens", "4", "--max-draft", "3", "--bootstrap", "10", "--progress", "false",
            "--fixed-thresholds", json.dumps({"constant_k": 2, "head": 0.6}), "--test-samples", "3",
            "--serving-batch-sizes", "[2, 4, 8]", "--serving-costs", json.dumps(views),
            "--serving-batch-policies", "[vllm_current_adaptive, goodput_online, dcut]"]
    assert main(args) == 0
    serving = json.loads((out / "metrics.json").read_text())["decoding"]["serving"]
    named = serving["views"]
    assert serving["requests"] == 9 and [f"roofline {view} (modelled)" for view in views] == named
    live = [(r["policy"], r["batch_size"], r["costs"]) for r in serving["rows"] if r["decoded"] == "live"]
    assert live == [(p, b, v) for p in policies for b in (2, 4, 8) for v in named]
    online = [r for r in serving["rows"] if r["policy"] == "goodput_online"]
    assert all(set(r["vs_live"]) == {"vllm_current_adaptive", "dcut"} and r["tokens_per_s"] > 0 for r in online)
    # a few rounds each: the online estimates never refit (one every 100 rounds), and the table says so
    assert all(r["refits"] == 0 for r in serving["rows"] if r["policy"] in policies[:2])
    assert not any("refits" in r for r in serving["rows"] if r["policy"] == "dcut")
    report = (out / "report.md").read_text()
    for view in named:
        assert f"Costs: {view}" in report
    assert report.count("goodput_online (the trained head) against the planners of free signals: B = 2") == 2
    assert report.count("goodput_online's refits from verify outcomes: B = 2: 0, B = 4: 0, B = 8: 0. At B = 2, 4, 8 it "
                        "never refitted") == 2


def write_costs(folder):
    """Given cost curves (a flat-ish target: verifying candidates is cheap, so the budget verifies some)."""
    import json

    path = folder / "costs.json"
    path.write_text(json.dumps({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]},
                                "target": {"tokens": [1, 8, 32], "seconds": [1.0, 1.2, 2.5]}}))
    return path
