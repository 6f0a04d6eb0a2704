"""Every served round priced as it is served: each forward on the rows live in it (a roofline preset prices them
exactly, a measured curve by its tokens), a draft's catch-up on the tokens it reads, the planners planning on the
same prices (plain decoding's deferred catch-up included), and cost curves that never fall."""

import json

import pytest
from test_eval import tiny_lm

import specheads.decoding.cost_table as cost_table
from specheads.cli import main
from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.cost_table import PRESETS, read_cost_table, roofline_seconds
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts, monotone_curve, round_seconds
from specheads.decoding.online import PassivePlanner
from specheads.decoding.planners import goodput_verify_lengths, plan_round, planned_goodput, threshold_verify_lengths
from specheads.eval.sweep import DecodePrompt, Setting, as_oracle, record_of
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

PRESET = "h100-llama3.1-8b-llama3.2-1b"
# Llama-3.1-8B at context 1024 on an H100 SXM (worked in tests/test_profile.py): weights 16.06e9 B, each row's cache
# 134 217 728 B, 3.35e12 B/s, launch 0.32 ms; 256 tokens stay memory-bound however many rows hold them
ON_64_ROWS = (16.06e9 + 64 * 134_217_728) / 3.35e12 + 0.32e-3
ON_256_ROWS = (16.06e9 + 256 * 134_217_728) / 3.35e12 + 0.32e-3


def exact(role: str, tokens: int, rows: int) -> float:
    """The preset's `role` model over `tokens` tokens of `rows` rows at its default context."""
    preset = PRESETS[PRESET]
    return roofline_seconds(getattr(preset, role), preset.accelerator, tokens, 1024, rows)


def test_a_round_of_64_live_rows_checking_4_tokens_each_is_priced_on_64_rows_not_256():
    costs = read_cost_table(PRESET).at_batch_size(256)
    assert (ON_64_ROWS, ON_256_ROWS) == (pytest.approx(7.68e-3, abs=1e-5), pytest.approx(15.37e-3, abs=1e-5))
    record = RoundRecord(requests=list(range(64)), drafted=[3] * 64, verified=[3] * 64, emitted=[4] * 64)
    assert round_seconds(record, costs) == pytest.approx(3 * exact("draft", 64, 64) + ON_64_ROWS, rel=1e-9)
    assert costs.target.price(256, 64) == pytest.approx(ON_64_ROWS, rel=1e-9)
    assert costs.target(256) == pytest.approx(ON_256_ROWS, rel=1e-9)  # the curve tabulated for B = 256: all rows live
    # a measured or given curve was timed as n rows of one token: it prices a forward by its tokens
    measured = CostCurve((1, 256), (1.0, 2.0))
    assert measured.price(256, 64) == measured(256) == 2.0


def test_the_planners_plan_on_the_rows_live_in_the_round():
    """64 rows of a batch of 256: the target's forward over them stays memory-bound, so a checked candidate costs
    (nearly) nothing; priced as 256 rows, each token would cost another row's cache reads."""
    costs, rows, survival = read_cost_table(PRESET).at_batch_size(256), 64, [0.8, 0.6, 0.4]
    catch_up = exact("draft", 2 * rows, rows) - exact("draft", rows, rows)
    by_hand = rows * (1 + sum(survival)) / (3 * exact("draft", rows, rows) + exact("target", 4 * rows, rows)
                                            + survival[-1] * catch_up)
    assert planned_goodput(survival, rows, 3, costs) == pytest.approx(by_hand, rel=1e-9)
    best = {k: max(planned_goodput(survival, rows, k, costs, v) for v in range(rows * k + 1)) for k in range(4)}
    k, rate = plan_round(survival, rows, 3, costs)
    assert rate == pytest.approx(max(best.values()), rel=1e-9) and best[k] == pytest.approx(rate, rel=1e-9)
    cheap = {row: [0.05] * 3 for row in range(rows)}  # three candidates a row, unlikely but nearly free to check
    assert threshold_verify_lengths(cheap, 1e4, costs.target) == dict.fromkeys(range(rows), 3)
    assert goodput_verify_lengths(cheap, costs.target)[0] == dict.fromkeys(range(rows), 3)


class PlainTwiceThenDraft(PassivePlanner):
    """Two rounds of plain decoding (K = 0), then one that drafts to the cap, over and over."""

    def __init__(self) -> None:
        self.rounds = 0

    def round_cap(self, rows: int, cap: int) -> int:
        self.rounds += 1
        return cap if self.rounds % 3 == 0 else 0


def test_a_drafts_catch_up_after_plain_decoding_is_priced_on_the_tokens_it_reads_and_counted_once():
    target, draft = tiny_lm(seed=31), tiny_lm(seed=32)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    reads: list[int] = []
    hook = draft.get_input_embeddings().register_forward_hook(lambda _, args, __: reads.append(args[0].shape[1]))
    log: list[RoundRecord] = []
    try:
        [result] = engine.decode([[1, 2, 0]], make_policy("constant_k", 3), 24, [5], log=log, planner=PlainTwiceThenDraft())
    finally:
        hook.remove()
    reads[0] -= 2  # the first forward also reads the prompt but its last token (no prompt cache): not priced
    recorded = [width for record in log for width in record.draft_widths[0]]
    assert recorded == reads and max(reads) >= 3  # a catch-up reads the tokens of the rounds the draft sat out
    assert result.draft_widths_per_round == [record.draft_widths[0] for record in log]
    assert result.draft_forwards == len(reads)  # counted: a catch-up is the one forward that also drafts ŷ_1
    # on a draft curve of one second a token and a flat target, the draft's seconds are the tokens it reads
    costs = ServingCosts(CostCurve((1, 2), (1.0, 2.0)), CostCurve((1, 2), (1.0, 1.0)))
    assert sum(round_seconds(record, costs) for record in log) == pytest.approx(sum(reads) + len(log))
    # the oracle's accounting of a run: one forward per accepted candidate, the first reading the run's catch-up
    oracle = as_oracle(record_of(Setting("constant_k", 3.0), DecodePrompt("p", (), "test"), result, -1.0))
    assert sum(map(len, oracle.draft_widths_per_round)) == oracle.draft_forwards == result.accepted


def test_a_falling_curve_is_refused_and_extrapolation_never_falls():
    with pytest.raises(UsageError, match=r"falls from 1 s at 8 tokens to 0.5 s at 64.*on a quiet machine"):
        CostCurve((1, 8, 64), (0.5, 1.0, 0.5))  # it gave negative seconds past 64 tokens
    assert CostCurve((1, 8, 64), (1.0, 2.0, 2.0))(10_000) == 2.0
    curve = monotone_curve((1, 2, 4, 8), [1.0, 0.5, 2.0, 1.5])
    assert (curve.seconds, curve.raised, curve.as_dict()["raised"]) == ((1.0, 1.0, 2.0, 2.0), (2, 8), [2, 8])


def test_profile_makes_a_falling_measurement_monotone_and_says_so(tiny_model, tmp_path, monkeypatch, capsys):
    def falling(model, context, tokens, repeats):  # a busy machine: the larger forwards timed faster
        return monotone_curve(tuple(tokens), [1.0 / n for n in tokens])

    monkeypatch.setattr(cost_table, "measure_cost_curve", falling)
    out = tmp_path / "costs.json"
    assert main(["profile", "--target.path", str(tiny_model), "--draft.skip-layers", "[2]", "--device", "cpu",
                 "--contexts", "[8]", "--tokens", "[1, 2, 4]", "--repeats", "1", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["raised"] == [{"context": 8, "model": role, "tokens": [2, 4]} for role in ("draft", "target")]
    assert table["target"] == {"tokens": [1, 2, 4], "seconds": [1.0, 1.0, 1.0], "raised": [2, 4]}
    said = capsys.readouterr().out
    assert "the target's time fell at [2, 4] token(s)" in said and "re-run on a quiet machine" in said
    assert read_cost_table(str(out)).costs.target.raised == (2, 4)
