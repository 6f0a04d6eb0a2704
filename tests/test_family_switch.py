"""benchmarks/family_switch.py (issue 62): a served queue whose prompts switch family midway, windows of rounds and
the rounds each online planner takes to re-settle after a switch."""

from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark
from test_eval import tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts
from specheads.heads import ExpectedAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform

WIDE = ServingCosts(CostCurve((1, 8), (0.01, 0.08)), CostCurve((1, 25, 30), (1.0, 1.0, 4.0)))


@pytest.fixture(scope="module")
def family_switch():
    return load_benchmark("family_switch")


def test_resettling_counts_the_rounds_until_the_prediction_stays_near_where_the_family_settles(family_switch):
    """Family a settles at 0.8 from its first window; b starts at round 60 and its prediction falls 0.8, 0.7, 0.62,
    0.6, 0.61, 0.6 (settled at 0.605): the last window further than 0.05 from that ends at round 100, 40 rounds after
    the switch. A family of two windows is too short to judge."""
    predicted = [0.8, 0.8, 0.8, 0.8, 0.7, 0.62, 0.6, 0.61, 0.6, 0.5, 0.5]
    series = [{"start": 20 * i, "rounds": 20, "predicted": p} for i, p in enumerate(predicted)]
    settled = family_switch.resettle(series, {"a": 0, "b": 60, "c": 180}, 220, 0.05)
    assert settled["a"]["rounds_to_settle"] == 0 and settled["a"]["settled"] == pytest.approx(0.8)
    assert settled["b"] == {"first_round": 60, "settled": pytest.approx(0.605), "rounds_to_settle": 40}
    assert settled["c"] == {"first_round": 180, "settled": None, "rounds_to_settle": None}


def test_the_queue_switches_family_and_every_policy_serves_it_exactly_as_without_the_recording(family_switch):
    """Three families of four requests served four rows at a time: each window's rows are shared among the families
    it serves, the online planners refit (every round here) and report their re-settling per family, and recording
    their predictions changes nothing: the same rounds as the planner decoded unrecorded."""
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    torch.manual_seed(5)
    head = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy", "top1"]).eval()
    rows = [{"id": f"{family}-{i}", "category": family} for family in ("code", "chat", "general") for i in range(2)]
    queue = family_switch.family_queue(rows, ["general", "code", "chat"], per_family=2, samples=2)
    assert [row["category"] for row in queue] == ["general"] * 4 + ["code"] * 4 + ["chat"] * 4
    assert [row["seed"] for row in queue] == list(range(12))
    prompts = {"general": [0, 1], "code": [1, 2], "chat": [2, 0]}
    tokens = [prompts[row["category"]] for row in queue]
    family_of = [row["category"] for row in queue]
    config = family_switch.Config(max_draft=2, constant_k=2, batch_size=4, max_new_tokens=3, window=1, refit_every=1)
    for policy in ("goodput_online", "vllm_current_adaptive", "dcut", "constant_k"):
        recorded: list[RoundRecord] = []
        result = family_switch.serve(engine, tokens, list(range(12)), family_of, policy, config, WIDE, head, recorded)
        assert result["tokens"] == 12 * 3 and sum(w["rounds"] for w in result["windows"]) == result["rounds"]
        assert all(sum(w["families"].values()) == pytest.approx(1.0) for w in result["windows"])
        assert list(result["windows"][0]["families"]) == ["general"]
        if policy in family_switch.ONLINE:
            assert result["refits"] == result["rounds"] and set(result["resettle"]) == {"general", "code", "chat"}
            assert all(0 <= w["predicted"] <= 1 for w in result["windows"] if w["predicted"] is not None)
        plain: list[RoundRecord] = []
        rule = make_policy(policy, 2, max_draft=2)
        planner = rule.planner(WIDE)
        if planner is not None and hasattr(planner.signal, "fit"):
            planner.signal.fit.refit_every = 1
        engine.decode(tokens, rule, 3, list(range(12)), head if rule.reads_head else None, batch_size=4, costs=WIDE,
                      log=plain, planner=planner)
        assert [(r.requests, r.drafted, r.verified, r.emitted) for r in plain] == \
            [(r.requests, r.drafted, r.verified, r.emitted) for r in recorded], policy


@pytest.mark.parametrize("head, drafter, refused", [
    (("EAGLE-3 runs/eagle3/drafter", {"kind": "eagle3", "weights_sha256": "x"}), ("eagle3", "runs/eagle3/drafter"), True),
    (("EAGLE-3 runs/eagle3/drafter", {"kind": "eagle3"}), None, True),
    (("target minus layers 20-21", {"derived_from_target": True}), None, False),
    (("target minus layers 18-21", {"derived_from_target": True}), None, True),
    (("target minus layers 20-21", {"derived_from_target": True}), ("eagle3", "runs/eagle3/drafter"), True),
    (("DSpark runs/dspark/drafter", {"kind": "dspark"}), ("eagle3", "runs/eagle3/drafter"), True)])
def test_a_head_of_another_draft_than_the_run_drafts_with_is_named_with_the_fix(head, drafter, refused, tmp_path):
    """A head is refused unless its data's draft is the run's: the same feature drafter's kind and files (a digest
    "x" never matches), or the same draft model by name; a drafter folder that does not exist is named."""
    from specheads.decoding.drafters import head_draft_refusal

    if drafter is not None:
        folder = tmp_path / "drafter"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
        assert "there is no EAGLE-3 drafter folder at runs/none" in head_draft_refusal(*head, ("eagle3", "runs/none"))
        drafter = (drafter[0], str(folder))
    refusal = head_draft_refusal(head[0], {"draft": head[1]}, drafter, "target minus layers 20-21")
    assert (refusal is not None) == refused
    if refused:
        assert f"it read the state of {head[0]}" in refusal and "give a head trained on" in refusal


def test_a_drafters_own_data_passes_by_its_files(tmp_path):
    from pathlib import Path

    from specheads.decoding.drafters import head_draft_refusal
    from specheads.pair.drafters import drafter_weights_sha256

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    identity = {"draft": {"kind": "eagle3", "weights_sha256": drafter_weights_sha256(folder)}}
    assert head_draft_refusal(f"EAGLE-3 {folder}", identity, ("eagle3", str(Path(folder)))) is None
    (folder / "model.safetensors").write_bytes(b"retrained")  # the same folder, other files
    assert "other files" in head_draft_refusal(f"EAGLE-3 {folder}", identity, ("eagle3", str(folder)))


def test_the_family_switch_refuses_a_head_of_another_draft_before_loading_a_model(family_switch, monkeypatch):
    from types import SimpleNamespace

    import specheads.artifacts.checkpoint as checkpoint
    import specheads.pair.models as models

    head = SimpleNamespace(draft="EAGLE-3 runs/eagle3/drafter", data_identity={"draft": {"kind": "eagle3"}})
    monkeypatch.setattr(checkpoint, "load_trained", lambda path: head)
    monkeypatch.setattr(models, "load_pair", lambda *args: pytest.fail("a model loaded"))
    monkeypatch.setattr("sys.argv", ["family_switch.py", "--head", "h.ckpt"])
    with pytest.raises(SystemExit, match="family_switch.py: --head h.ckpt: it read the state of EAGLE-3"):
        family_switch.main()
