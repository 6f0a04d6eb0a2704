"""benchmarks/lookup_serving.py: prompt lookup served at B rows with no model forward, the batch planner fed vLLM's
table, the token head, a constant K or an oracle; rounds counted by hand, continuous batching and the flags' refusals."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

from specheads.decoding.cost_table import PRESETS, roofline_costs
from specheads.decoding.costs import CostCurve
from specheads.heads.lookup import TokenHeadModel
from specheads.lookup.token_head import TokenHead

LINEAR = CostCurve((1, 10), (1.0, 2.8))  # t(n) = 1 + 0.2 (n - 1)
STEEP = CostCurve((1, 4000), (1.0, 4000.0))  # a verified token costs a whole forward
# prompt 0 proposes [3, 4, 1] after [1, 2] (its earliest match); its response takes 3 and 4, then ends after one more
# round with no room to verify; prompt 1 proposes [7, 5], both taken, and ends after its first round.
PAIRS = [([1, 2, 3, 4, 1, 2], [3, 4, 9, 6]), ([5, 6, 7, 5, 6], [7, 5, 8])]


@pytest.fixture(scope="module")
def serving():
    return load_benchmark("lookup_serving")


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head")
    TokenHeadModel("lookup_token_stop", width=8, depth=1, draft_kind="lookup").export(folder)
    return TokenHead.load(folder, "lookup")


def repetitive_pairs(count: int = 6, length: int = 40) -> list[tuple[list[int], list[int]]]:
    """Prompts that repeat a phrase with edits and responses that copy parts of them, so lookup proposes and is
    sometimes wrong."""
    pairs = []
    for seed in range(count):
        phrase = [(seed * 7 + i * 3) % 23 + 1 for i in range(9)]
        prompt = phrase + [50 + seed] + phrase[:5] + [60] + phrase
        response = [(phrase[i % 9] if (i // 5 + seed) % 3 else 70 + i % 11) for i in range(length - seed)]
        pairs.append((prompt, response))
    return pairs


def test_two_rows_two_rounds_priced_by_hand(serving):
    """Constant K = 2, B = 2, queue [0, 1, 1]. Round 1: both rows verify 2 and take 2 (3 tokens each; row 1's
    request ends, prompt 1's second request takes the row), a forward of 6 tokens, t(6) = 2.0. Round 2: row 0 has one
    token of room left: no proposal, 1 token; row 1 verifies 2, takes 2 (3 tokens); a forward of 4, t(4) = 1.6; row 0
    ends with no request waiting: the run stops. 10 tokens for 3.6 s against the target alone's 2 for t(2) = 1.2."""
    responses = serving.Responses(PAIRS, 32)
    served = serving.serve(responses, serving.ConstantK(responses, 2), 2, LINEAR, [0, 1, 1])
    assert (served.rounds, served.verified, served.accepted, served.finished) == (2, 6, 6, 3)
    assert served.tokens.tolist() == [4, 6]
    # each round's price shared by the tokens each row put into the forward
    assert served.seconds.tolist() == pytest.approx([2.0 * 3 / 6 + 1.6 * 1 / 4, 2.0 * 3 / 6 + 1.6 * 3 / 4])
    assert served.speedup(serving.target_alone(LINEAR, 2)) == pytest.approx((10 / 3.6) / (2 / 1.2))


def test_the_table_feeds_the_planner_its_counts(serving):
    """vLLM's empty table says 1/2 at every position: the planner takes one token of each row (2.5/1.4, then 3/1.6;
    a third at 1/4 would give 3.25/1.8, less); both are accepted, and the table then says (2 + 1)/(2 + 2) there."""
    responses = serving.Responses(PAIRS, 32)
    rule = serving.TableFed(responses)
    rows = {0: serving.Request(0), 1: serving.Request(1)}
    proposals = {row: responses.proposal(request) for row, request in rows.items()}
    assert [proposals[0].tokens, proposals[1].tokens] == [(3, 4, 1), (7, 5)]
    lengths = rule.lengths(rows, proposals, LINEAR)
    assert lengths == {0: 1, 1: 1}
    rule.observe(proposals, lengths, {0: 1, 1: 1})
    assert rule.estimates(0, rows[0], proposals[0]) == pytest.approx([0.75, 0.5, 0.5])


def test_a_warmed_table_verifies_where_the_cold_one_is_locked_out(serving):
    """At t(n) = 1 + 0.55 (n - 1) a position worth 1/2 (the empty table's prior) does not pay at B = 2 (2.5/2.1 <
    2/1.55): the cold table verifies nothing, so it never learns. Warmed by PAIRS' rounds verified whole (the first
    two positions of prompt-matched proposals accepted twice: 3/4), it verifies the first of each row (2.75/2.1 and
    3.5/2.65 > 2/1.55; a second, worth 3/4 · 3/4, would give 4.06/3.2, less)."""
    curve = CostCurve((1, 10), (1.0, 5.95))
    responses = serving.Responses(PAIRS, 32)
    rows = {0: serving.Request(0), 1: serving.Request(1)}
    proposals = {row: responses.proposal(request) for row, request in rows.items()}
    assert serving.TableFed(responses).lengths(rows, proposals, curve) == {0: 0, 1: 0}
    warm = serving.warm_table(responses, serving.Responses(PAIRS, 32), 2, curve)
    assert warm.estimates(0, rows[0], proposals[0]) == pytest.approx([0.75, 0.75, 1 / 3])
    assert warm.lengths(rows, proposals, curve) == {0: 1, 1: 1}


@pytest.mark.parametrize("curve", [LINEAR, roofline_costs(PRESETS["4xh100-llama3.1-70b-llama3.1-8b"], 64, 4).target])
def test_no_rule_beats_the_oracle(serving, head, curve):
    """The oracle verifies exactly the tokens that will be accepted (where they pay: here always); no rule does better."""
    responses = serving.Responses(repetitive_pairs(), 32, head)
    queue = serving.queue_of(len(responses.pairs), 4, 2)
    alone = serving.target_alone(curve, 4)
    runs = {name: serving.serve(responses, rule, 4, curve, queue) for name, rule in serving.make_rules(responses, 8).items()}
    found = {name: run.speedup(alone) for name, run in runs.items()}
    assert min(found.values()) < found["oracle"]  # the rules differ: the claim is not vacuous
    assert runs["oracle"].verified == runs["oracle"].accepted > 0  # it verifies what will be accepted, nothing else
    assert all(found["oracle"] >= value - 1e-12 for value in found.values()), found


def test_a_token_worth_a_forward_is_never_verified(serving, head):
    """Where a verified token costs a whole forward, no estimate below 1 pays for it: the planner fed the table or the
    head verifies nothing (plain target steps, the target alone's throughput); the oracle's accepted tokens pay
    exactly their price."""
    responses = serving.Responses(repetitive_pairs(), 32, head)
    queue = serving.queue_of(len(responses.pairs), 3, 2)
    rules = serving.make_rules(responses, 8)
    for name in ("table", "head", "oracle"):
        served = serving.serve(responses, rules[name], 3, STEEP, queue)
        assert served.speedup(serving.target_alone(STEEP, 3)) == pytest.approx(1.0)
        assert (served.verified == 0) == (name != "oracle")
    cheap = serving.serve(responses, serving.make_rules(responses, 8)["table"], 3, LINEAR, queue)
    assert cheap.verified > 0


def test_continuous_batching_refills_rows_until_the_queue_is_empty(serving):
    """Each prompt is queued ceil(turnover · B / prompts) times; every queued request enters a row, so all but the
    B − 1 still running when the run stops have finished, and a prompt served twice counts both requests."""
    pairs = repetitive_pairs(count=5, length=12)
    responses = serving.Responses(pairs, 32)
    queue = serving.queue_of(5, 3, 4)
    assert queue == [0, 1, 2, 3, 4] * 3
    served = serving.serve(responses, serving.ConstantK(responses, 4), 3, LINEAR, queue)
    assert served.finished >= len(queue) - 2
    assert served.tokens.sum() >= sum(len(pairs[index][1]) for index in queue[:-2])


def labels_at(tmp_path, temperature: float):
    folder = tmp_path / "labels"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"identity": {"sampling": {"temperature": temperature}}}))
    return str(folder)


@pytest.mark.parametrize("flags, says", [
    (["--batch-sizes", "[0,8]"], "--batch-sizes"),
    (["--presets", "[h100]"], "--presets h100: not a roofline preset"),
    (["--batch-sizes", "[]"], "--batch-sizes is empty"),
    (["--presets", "[]"], "no cost view"),
    (["--max-draft", "0"], "--max-draft"),
])
def test_bad_flags_are_refused_in_one_line(serving, tmp_path, flags, says):
    with pytest.raises(SystemExit) as refused:
        serving.main(["--labels", labels_at(tmp_path, 0.0), "--head", str(tmp_path), *flags])
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_sampled_labels_a_missing_head_and_a_bad_curve_are_refused(serving, tmp_path, head):
    labels = labels_at(tmp_path, 1.0)
    with pytest.raises(SystemExit, match="labelled at T = 1.0, not greedy"):
        serving.main(["--labels", labels, "--head", str(head.folder)])
    (tmp_path / "labels" / "manifest.json").write_text(json.dumps({"identity": {"sampling": {"temperature": 0.0}}}))
    with pytest.raises(SystemExit, match="not a token head folder"):
        serving.main(["--labels", labels, "--head", str(tmp_path / "none")])
    (tmp_path / "curve.json").write_text("{}")
    with pytest.raises(SystemExit, match="--verify-curve .* no verify_curve read"):
        serving.main(["--labels", labels, "--head", str(head.folder), "--verify-curve", str(tmp_path / "curve.json")])


def test_the_table_reports_each_rule_over_the_target_alone_and_the_head_over_each_table(serving, head, tmp_path):
    (tmp_path / "curve.json").write_text(json.dumps({"verify_curve": LINEAR.as_dict()}))
    config = serving.Config(labels="unused", head="unused", batch_sizes=[3], presets=[],
                            verify_curve=str(tmp_path / "curve.json"), resamples=200)
    found = serving.run(config, repetitive_pairs(), head, warm_pairs=repetitive_pairs(count=3))["views"]["cpu"]["3"]
    speedups = {rule: value["speedup"]["value"] for rule, value in found["rules"].items()}
    assert set(speedups) == {"table", "table_warm", "head", "constant_k:8", "oracle"}
    assert len(set(speedups.values())) == len(speedups)  # every rule served differently: the ratios are not 1
    for table in ("table", "table_warm"):
        ratio = found[f"head_over_{table}"]
        assert ratio["value"] == pytest.approx(speedups["head"] / speedups[table])
        assert ratio["interval"][0] <= ratio["value"] <= ratio["interval"][1]
