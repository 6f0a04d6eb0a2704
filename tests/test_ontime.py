"""The on-time head (specdecpp_ontime): what it reads, its stop rule in decoding, and the per-position calibration."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_eval import PROMPT, tiny_pair  # noqa: F401  (a fixture)

from specheads.artifacts.checkpoint import load_trained
from specheads.artifacts.metrics import expected_calibration_error, soft_auc
from specheads.cli import main
from specheads.dataset.targets import head_inputs
from specheads.decoding import RoundEngine, make_policy
from specheads.heads import OnTimeAcceptanceHead, PositionCalibration, ResNetAcceptanceHead, load_head
from specheads.heads.calibration import cumulative_products, round_windows, window_starts
from specheads.heads.calibration_fit import fit_position_calibration
from specheads.heads.loading import COST_RULE, STOP_RULE, cost_rule_refusal
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError
from specheads.train.loss import weighted_bce

CONFIGS = Path(__file__).parents[1] / "configs" / "train"


# ---- what the head reads: a planted signal in the candidate token, or in the state before it


def planted_batch(seed: int, rows: int = 64, width: int = 12, hidden: int = 8, vocab: int = 40) -> dict:
    """Drafted positions whose label depends on the candidate token (even ids accepted) and, separately, on the sign of
    the state *before* the candidate (features[:, j]) — while the state after it (features[:, j + 1]) is noise."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, width + 1, hidden, generator=generator)
    draft_ids = torch.randint(0, vocab, (rows, width), generator=generator)
    token_label = (draft_ids % 2 == 0).float()
    state_label = (features[:, :-1, 0] > 0).float()
    signals = {name: torch.randn(rows, width, generator=generator) for name in ("logq", "entropy", "top1")}
    return {"valid": torch.ones(rows, width, dtype=torch.bool), "is_draft": torch.ones(rows, width, dtype=torch.bool),
            "draft_ids": draft_ids, "features": features, "token_label": token_label, "state_label": state_label,
            **signals}


def held_out_auc(head, label_name: str, embeddings: torch.nn.Embedding) -> float:
    """Train `head` on one planted batch with the weighted BCE (through `head_inputs`, as training does) and return
    its AUC on another."""
    def inputs(seed: int):
        batch = planted_batch(seed)
        batch["accept"] = batch[label_name]
        return head_inputs(batch, batch["features"], head.reads, head.purpose, [],
                           embeddings=embeddings if head.candidate_embedding_size else None)

    hidden, _, embedding, label, _ = inputs(0)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    head.train()
    for _ in range(150):
        optimizer.zero_grad()
        weighted_bce(head(hidden, None, embedding), label, 1.0, 1.0).backward()
        optimizer.step()
    head.eval()
    hidden, _, embedding, label, _ = inputs(1)
    return soft_auc(label.numpy(), head.predict(hidden, None, embedding).numpy())


def test_the_on_time_head_learns_a_label_of_the_candidate_token_and_of_the_state_before_it():
    torch.manual_seed(0)
    embeddings = torch.nn.Embedding(40, 8).requires_grad_(False)
    with_embedding = held_out_auc(OnTimeAcceptanceHead(8, depth=1, candidate_embedding_size=8), "token_label", embeddings)
    without = held_out_auc(OnTimeAcceptanceHead(8, depth=1), "token_label", embeddings)
    assert with_embedding > 0.95 and without < 0.6, (with_embedding, without)
    on_time = held_out_auc(OnTimeAcceptanceHead(8, depth=1), "state_label", embeddings)
    lagged = held_out_auc(ResNetAcceptanceHead(8, depth=1), "state_label", embeddings)  # reads the state after
    assert on_time > 0.95 and lagged < 0.6, (on_time, lagged)


# ---- the stop rule on time in the decoding loop


class Counted(OnTimeAcceptanceHead):
    """An on-time head that counts its forwards."""

    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)


def certain_rejection(head):
    """Set `head` to predict acceptance ~0 for every candidate."""
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(-20.0)
    return head.eval()


def test_the_on_time_head_stops_at_the_candidate_it_scores_without_an_extra_draft_forward(tiny_pair):  # noqa: F811
    target, draft = tiny_pair
    decoder = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    policy = make_policy("head", 0.5, max_draft=4)
    on_time = certain_rejection(Counted(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16))
    lagged = certain_rejection(ResNetAcceptanceHead(16, depth=1, extra_features=["logq", "q"]))
    Counted.calls = 0
    result = decoder.decode_one(PROMPT, policy, 10, seed=0, head=on_time)
    assert result.drafted == result.target_calls  # it saw â_1 ≈ 0 the moment ŷ_1 was drafted: one candidate a round
    assert result.draft_forwards == result.drafted  # one draft forward per candidate, none to score it
    assert Counted.calls == result.drafted  # each candidate scored once, at its own step
    late = decoder.decode_one(PROMPT, policy, 10, seed=0, head=lagged)
    room, expected = 10, []  # the lagged head learns â_1 only after drafting ŷ_2: two a round, where the cap allows
    for accepted in late.accepted_per_round:
        expected.append(min(2, policy.cap(room)))
        room -= accepted + 1
    assert late.drafted_per_round == expected and 2 in expected
    assert late.draft_forwards == late.drafted


# ---- the calibration map


def test_window_starts_follow_runs_of_consecutive_drafted_positions():
    row = np.array([0, 0, 0, 0, 1, 1, 2])
    position = np.array([0, 1, 2, 4, 3, 4, 0])  # row 0 skips position 3 (a target token)
    assert window_starts(row, position, 1).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert window_starts(row, position, 2).tolist() == [0, 1, 4]
    assert window_starts(row, position, 3).tolist() == [0]
    assert [len(w) for w in round_windows(row, position, 4)] == [7, 3, 1, 0]


def test_the_map_is_monotone_per_position_and_refuses_a_decreasing_one():
    calibration = PositionCalibration((0.5, 2.0), (1.0, -1.0))
    logits = torch.linspace(-6, 6, 50)
    for k in (1, 2, 3):  # positions past the last use the last map
        mapped = calibration.logits(logits, torch.full((50,), k))
        assert (mapped.diff() > 0).all()
    assert torch.equal(calibration.logits(logits, torch.full((50,), 3)), calibration.logits(logits, torch.full((50,), 2)))
    with pytest.raises(UsageError, match="scales > 0"):
        PositionCalibration((1.0, -0.5), (0.0, 0.0))
    with pytest.raises(UsageError, match="a SPRINTER|feeds no stop rule"):
        from specheads.heads import LinearVerifier

        LinearVerifier(4).set_calibration(calibration)


def synthetic_rounds(seed: int, rows: int = 400, width: int = 10):
    """Drafted runs with true acceptances a = σ(t) and a head that is over-confident and biased: z = 2.5 t + 1."""
    generator = np.random.default_rng(seed)
    truth = generator.normal(0.8, 1.2, (rows, width))
    accept = 1 / (1 + np.exp(-truth))
    row, position = np.divmod(np.arange(rows * width), width)
    return (2.5 * truth + 1.0).ravel(), accept.ravel(), row, position


def test_fitted_calibration_brings_the_cumulative_ece_down_on_held_out_rounds():
    calibration = fit_position_calibration(*synthetic_rounds(0), max_positions=6)
    logits, accept, row, position = synthetic_rounds(1)
    windows = round_windows(row, position, 6)
    before = cumulative_products(logits, accept, windows, None)
    after = cumulative_products(logits, accept, windows, calibration)
    for (raw, label), (fitted, _) in zip(before, after):
        raw_ece, fitted_ece = expected_calibration_error(label, raw), expected_calibration_error(label, fitted)
        assert raw_ece > 0.05 and fitted_ece < 0.02 and fitted_ece < raw_ece / 3, (raw_ece, fitted_ece)
        assert soft_auc(label, fitted) > 0.7
    assert all(0.3 < s < 0.5 for s in calibration.scale[:3])  # it found the over-confidence (true scale 1 / 2.5)


def test_calibration_round_trips_through_save_and_load_head(tmp_path):
    head = OnTimeAcceptanceHead(8, depth=1, extra_features=["logq"], candidate_embedding_size=4,
                                calibration={"scale": [0.5, 0.8], "bias": [0.2, -0.3]})
    head.set_class_weights(1.0, 6.0)
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["calibration"]["scale"] == [0.5, 0.8] and config["decides"] == "at_draft"
    loaded, rule = load_head(str(tmp_path))
    hidden, signals, embedding = torch.randn(5, 8), torch.randn(5, 1), torch.randn(5, 4)
    raw = head.predict(hidden, signals, embedding)
    for k in (1, 2, 7):
        assert torch.equal(loaded.predict(hidden, signals, embedding, position=k), head.predict(hidden, signals, embedding, k))
    logit = torch.logit(raw.double())
    assert torch.allclose(head.predict(hidden, signals, embedding, 1).double(), torch.sigmoid(0.5 * logit + 0.2), atol=1e-5)
    assert rule.rule == "stop_drafting_when_rejection_risk_above"


# ---- the whole path: train with calibration, eval, export


def test_trained_calibration_travels_from_checkpoint_to_report_and_export(trained, tmp_path):
    data, _ = trained
    root = tmp_path / "ontime"
    assert main(["train", "fit", "--config", str(CONFIGS / "specdecpp-ontime.yaml"), "--data.path", str(data),
                 "--data.val_fraction", "0.3", "--data.calibration_fraction", "0.3", "--data.batch_size", "4",
                 "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
                 "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "2",
                 "--model.calibrate_positions", "3"]) == 0
    checkpoint = root / "checkpoints" / "last.ckpt"
    head = load_trained(str(checkpoint))
    assert head.head.calibration is not None and head.head.calibration.positions == 3
    split = json.loads((root / "split.json").read_text())
    calibration_prompts = set(split["calibration"]["prompt_digests"])
    assert calibration_prompts and head.used_prompts == set(split["train"]["prompt_digests"]) | calibration_prompts
    out = tmp_path / "report"
    assert main(["eval", "--head", str(checkpoint), "--data", str(data), "--out", str(out), "--num-decode-prompts", "4",
                 "--max-new-tokens", "6", "--max-draft", "3", "--constant-ks", "[1,3]", "--head-thresholds", "[0.5]",
                 "--bootstrap", "10", "--progress", "false"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    # only validation prompts are reported: neither the training nor the calibration prompts
    assert metrics["data"]["prompts_trained_on"] >= len(split["train"]["prompt_ids"]) + len(split["calibration"]["prompt_ids"])
    assert 0 < metrics["data"]["prompts"] <= len(split["val"]["prompt_ids"])
    stages = {(row["k"], row["stage"]) for row in metrics["cumulative"]}
    assert (1, "raw") in stages and (1, "calibrated") in stages
    assert (out / "cumulative_reliability.png").stat().st_size > 1000
    assert "Cumulative acceptance per round position" in (out / "report.md").read_text()
    exported = tmp_path / "head"
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(exported), "--report", str(out)]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["decides"] == "at_draft" and config["reads"] == "context_state"
    assert config["calibration"] == head.head.calibration.as_dict()
    # the rule read from the costs was decoded beside the others at the stated c, and export chose by the calibration
    assert any(r["policy"] == "head_cost" and r["threshold"] == 0.2 and r["tuned"] for r in metrics["decoding"]["policies"])
    assert "rule read from the costs (c = 0.2, tuned nowhere)" in (out / "report.md").read_text()
    # and beside it the same rule on the head calibrated while serving, compared with the head's own rule and head_cost
    assert any(r["policy"] == "head_cost_online" and r["tuned"] for r in metrics["decoding"]["policies"])
    assert {"head", "head_cost"} <= set(metrics["decoding"]["head_cost_online_gain_intervals"])
    assert "on the head calibrated while serving (c = 0.2, tuned nowhere)" in (out / "report.md").read_text()
    refusal = cost_rule_refusal(head.head, metrics["cumulative"], 3)
    assert config["decision_rule"]["rule"] == (STOP_RULE if refusal else COST_RULE)
    assert config["rule_choice"]["why"].endswith(refusal) if refusal else "tuned nowhere" in config["rule_choice"]["why"]
    loaded, _ = load_head(str(exported))
    hidden, signals, embedding = torch.randn(3, 32), torch.randn(3, 4), torch.randn(3, 32)
    assert torch.equal(loaded.predict(hidden, signals, embedding, 2), head.head.predict(hidden, signals, embedding, 2))


def test_the_cumulative_ece_carries_its_sampling_noise_over_prompts():
    """An ECE goal is judged against the ECE's own noise: each k's row has a 95 % interval over resampled prompts,
    which is the point itself when every window belongs to one prompt, and wider on 40 prompts than on 400."""
    from specheads.eval.offline import TokenTable, cumulative_calibration

    logits, accept, row, position = synthetic_rounds(2, rows=400, width=6)

    def table(rows, prompts):
        keep = row < rows
        zeros = np.zeros(int(keep.sum()))
        return TokenTable(label=accept[keep], prediction=1 / (1 + np.exp(-logits[keep])), logit=logits[keep], logp=zeros,
                          logq=zeros, entropy=zeros, top1=zeros, beta=zeros, accept=accept[keep],
                          group=row[keep] % prompts, row=row[keep], position=position[keep], prompts=prompts)

    one = cumulative_calibration(table(400, 1), None, 3, resamples=30)
    assert all(r["ece_ci"] == [pytest.approx(r["ece"])] * 2 for r in one)
    many = {r["k"]: r for r in cumulative_calibration(table(400, 400), None, 3, resamples=200)}
    few = {r["k"]: r for r in cumulative_calibration(table(40, 40), None, 3, resamples=200)}
    for k in (1, 2, 3):
        (low, high), (few_low, few_high) = many[k]["ece_ci"], few[k]["ece_ci"]
        assert 0 <= low < high and high - low < (few_high - few_low) / 2
