"""A block drafter priced as it runs (issue 60's "every forward priced", for DSpark): a round that drafts runs one
draft forward however many of its block's candidates it uses, so the oracle's counted forwards, the cost rule, the
goodput planner, SmartSpec and cost-weighed trees all price one forward a round, not one a candidate."""

import pytest

from specheads.decoding.cost_rule import CostPlanner
from specheads.decoding.costs import CostCurve, ServingCosts, hindsight_forwards
from specheads.decoding.planners import SmartSpecPlanner, plan_round, planned_goodput
from specheads.decoding.rules import Drafted
from specheads.decoding.tree import TreeCosts
from specheads.eval.sweep import RunRecord, as_oracle

FLAT_TARGET = CostCurve((1, 256), (1.0, 1.0))
LINEAR_DRAFT = CostCurve((1, 2), (0.5, 0.6))  # half a target forward at one token, 0.1 a token more


def test_a_block_round_is_priced_as_one_forward_over_its_slots_and_every_emitted_token_as_later_context():
    chain = ServingCosts(LINEAR_DRAFT, FLAT_TARGET)
    block = chain.shaped(4)
    survival, rows = [0.8, 0.6, 0.4], 2
    assert block.drafting(rows, 3) == block.drafting(rows, 1) == pytest.approx(LINEAR_DRAFT(8))  # one forward, 2 × 4 slots
    assert chain.drafting(rows, 3) == pytest.approx(3 * LINEAR_DRAFT(2))
    assert block.drafting(rows, 0) == 0.0 and block.draft_step(rows) == 0.0  # the next candidate comes from the block
    assert block.catch_up(rows) == pytest.approx(LINEAR_DRAFT(10) - LINEAR_DRAFT(8))  # one more context token a row
    expected = rows * sum(survival)
    by_hand = (rows + expected) / (LINEAR_DRAFT(8) + 1.0 + (1 + expected / rows) * block.catch_up(rows))
    assert planned_goodput(survival, rows, 3, block) == pytest.approx(by_hand, rel=1e-12)
    assert block.scaled_draft(0.3).block == 4  # the 7B/70B view keeps the draft's shape


def test_the_goodput_plan_and_smartspec_draft_the_whole_block_where_a_chain_of_forwards_would_not_pay():
    """A draft at half the target's cost: a chain's second forward does not pay at these acceptances, a block's
    candidates come from the one forward the first already paid for."""
    chain = ServingCosts(CostCurve((1, 256), (0.5, 0.5)), FLAT_TARGET)
    survival = [0.7 ** j for j in range(1, 5)]
    assert plan_round(survival, 1, 4, chain)[0] == 1
    k, rate = plan_round(survival, 1, 4, chain.shaped(4))
    assert k == 4 and rate == pytest.approx((1 + sum(survival)) / 1.5)
    smartspec = SmartSpecPlanner(chain, max_k=4)
    assert smartspec.round_cap(1, 4) == 1
    smartspec.price_draft(4)
    assert smartspec.round_cap(1, 4) == 4


def test_the_cost_rule_drafts_on_from_a_block_it_already_paid_for():
    planner = CostPlanner(cost_ratio=0.5)
    candidate = Drafted(index=1, prob=0.5, entropy=1.0, acceptance=0.6, score=0.6)
    assert planner.stops(0, candidate)  # 0.36 < ρ · c: another forward does not pay
    planner.price_draft(4)
    assert not planner.stops(1, candidate)  # the block's next candidate costs no forward
    assert planner.drafting_cost(3) == planner.drafting_cost(1) == 0.5 and planner.drafting_cost(0) == 0.0


def test_a_cost_weighed_tree_reads_a_block_drafters_nodes_without_paying_a_forward():
    chain, block = TreeCosts(0.5), TreeCosts(0.5, block=True)
    assert chain.read_gain(0.6, 2) == pytest.approx(0.6 - 0.5)
    assert block.read_gain(0.6, 2) == pytest.approx(0.6) == block.slot_gain(0.6, 1, 2)


def test_the_oracle_counts_one_block_a_round_that_keeps_a_candidate():
    record = RunRecord("constant_k", 4.0, "p", "test", emitted=10, drafted=12, accepted=6, target_calls=4,
                       draft_forwards=3, seconds=1.0, forward_seconds=1.0, accepted_per_round=[0, 3, 2, 1],
                       target_logprob=0.0, drafted_per_round=[0, 4, 4, 4], draft_widths_per_round=[[], [6], [8], [7]])
    assert hindsight_forwards(record.accepted_per_round, None) == 6
    oracle = as_oracle(record, block=4)
    assert oracle.draft_forwards == 3 and oracle.draft_widths_per_round == [[], [6], [8], [7]]
    assert as_oracle(record).draft_forwards == 6  # a chain: one forward a kept candidate
