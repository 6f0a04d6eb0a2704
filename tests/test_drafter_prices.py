"""Every forward on a feature drafter priced from the modules decoding runs (issue 70): a head's share of an EAGLE-3 or
DSpark drafter counts the weights its forward multiplies (not `verifier_lm_head`, read only by training); DSpark's
Markov bias is charged for each candidate in the counted draft forwards, the serving rounds, the planners and trees;
EAGLE-3's fusion layer is in its measured curve; and the wall-clock baseline computes what the engine computes (the
prompt's last logits only), after a warm-up."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from test_eval import PROMPT, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.cost_rule import CostPlanner
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts, hindsight_forwards, round_seconds
from specheads.decoding.tree import TreeCosts
from specheads.model_outputs.sampling import SamplingTransform

pytest.importorskip("speculators.models.dspark")

from test_dspark_decoding import random_dspark  # noqa: E402
from test_eagle3_decoding import random_drafter  # noqa: E402

from specheads.decoding.companion import head_forward_cost, weights_read_per_token  # noqa: E402
from specheads.decoding.dspark import DSparkModel  # noqa: E402
from specheads.decoding.eagle3 import Eagle3Model  # noqa: E402
from specheads.heads import LinearVerifier  # noqa: E402

PER_CANDIDATE = ("markov_head", "confidence_head")  # what a DSpark drafter runs for each candidate after its block
DRAFT = CostCurve((1, 2, 8), (0.5, 0.6, 1.2))


@pytest.fixture(scope="module")
def drafts():
    target = tiny_lm(seed=1)
    eagle = random_drafter(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True])
    dspark = random_dspark(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True], markov_head_type="gated")
    return target, {"eagle3": Eagle3Model(eagle, target), "dspark": DSparkModel(dspark, target)}


def weights_that_ran(drafter, run) -> tuple[dict[str, int], set[str]]:
    """(per module that holds parameters, its weights multiplied, lookups left out; the names of those `run()` ran)."""
    held = {name: module for name, module in drafter.named_modules() if list(module.parameters(recurse=False))}
    weights = {name: 0 if isinstance(module, torch.nn.Embedding) else sum(p.numel() for p in module.parameters(recurse=False))
               for name, module in held.items()}
    ran: set[str] = set()
    hooks = [module.register_forward_pre_hook(lambda *_, name=name: ran.add(name)) for name, module in held.items()]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return weights, ran


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_a_drafters_forward_is_priced_by_the_weights_its_decoding_runs(drafts, kind):
    """The weights a draft forward is priced by are those of the modules a decode runs, found by hooks on every module
    (the per-candidate Markov and confidence heads apart), never `verifier_lm_head` or `verifier_norm`; a head's share
    of the drafter is its weights over those."""
    target, models = drafts
    draft = models[kind]
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    weights, ran = weights_that_ran(draft.drafter, lambda: engine.decode([PROMPT] * 2, make_policy("constant_k", 2, 3), 6,
                                                                         [0, 1]))
    assert not any(name.startswith("verifier") for name in ran)
    forward = sum(weights[name] for name in ran if not name.startswith(PER_CANDIDATE))
    candidate = sum(weights[name] for name in ran if name.startswith(PER_CANDIDATE))
    head = LinearVerifier(draft.config.hidden_size)
    assert weights_read_per_token(draft) == forward
    assert head_forward_cost(head, draft) == pytest.approx(head.num_parameters() / forward)
    assert draft.candidate_cost == pytest.approx(candidate / forward)
    assert (candidate > 0) == (kind == "dspark")  # EAGLE-3 draws each candidate from its forward's logits


@contextmanager
def counting(*modules: torch.nn.Module) -> Iterator[list[int]]:
    """While open, how many times each of `modules` ran its forward."""
    counts = [0] * len(modules)
    hooks = [module.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
             for i, module in enumerate(modules)]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def test_a_dspark_chains_counted_forwards_charge_its_markov_bias_for_each_candidate(drafts):
    """The counted draft forwards are the blocks (one fusion of the target's streams each, B = 1) plus each candidate's
    Markov bias (one `markov_w2` product each) at its share of a forward; the rounds' records price it, and the
    oracle is charged it for each candidate it keeps."""
    target, models = drafts
    draft = models["dspark"]
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    log: list[RoundRecord] = []
    with counting(draft.drafter.fc, draft.drafter.markov_head.markov_w2) as counts:
        results = engine.decode([PROMPT] * 3, make_policy("constant_k", 3, 3), 8, [0, 1, 2], log=log, batch_size=1)
    blocks, markov = counts
    drafted = sum(result.drafted for result in results)
    assert markov == drafted > 0 and draft.candidate_cost > 0
    assert sum(result.draft_forwards for result in results) == pytest.approx(blocks + draft.candidate_cost * drafted)
    assert all(record.candidate_cost == pytest.approx(draft.candidate_cost) for record in log)
    oracle = engine.decode([PROMPT], make_policy("oracle", 3, 3), 8, [0])[0]
    rounds = oracle.accepted_per_round
    assert oracle.draft_forwards == pytest.approx(sum(1 for kept in rounds if kept) + draft.candidate_cost * sum(rounds))


def test_a_dspark_trees_counted_forwards_charge_a_markov_bias_for_each_node_read(drafts):
    from specheads.decoding.tree import TreeRule, decode_tree

    target, models = drafts
    draft = models["dspark"]
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    with counting(draft.drafter.fc, draft.drafter.markov_head.markov_w2) as counts:
        results = decode_tree(engine, [PROMPT] * 2, TreeRule(values="confidence", floor=0.0, budget=4), 8, [0, 1])
    blocks, markov = counts
    assert markov > 0
    assert sum(result.draft_forwards for result in results) == pytest.approx(blocks + draft.candidate_cost * markov)


def test_a_rounds_seconds_planners_and_trees_price_each_candidates_markov_bias():
    """m draft forwards a candidate (a DSpark drafter's Markov bias): a round's seconds add, at each draft step, m times
    the draft's forward over the rows that drew a candidate there; the goodput planners' drafting and next-candidate
    prices, the cost rule's candidate and the cost-weighed tree's read add it as well."""
    m, target = 0.25, CostCurve((1, 256), (1.0, 1.0))
    record = RoundRecord(requests=[0, 1], drafted=[3, 1], verified=[3, 1], emitted=[2, 1], draft_widths=[[6], [4]])
    free = round_seconds(record, ServingCosts(DRAFT, target))
    record.candidate_cost = m
    assert round_seconds(record, ServingCosts(DRAFT, target)) - free == pytest.approx(m * (DRAFT(2) + DRAFT(1) + DRAFT(1)))
    plain, markov = ServingCosts(DRAFT, target).shaped(4), ServingCosts(DRAFT, target).shaped(4, m)
    assert markov.drafting(2, 3) - plain.drafting(2, 3) == pytest.approx(3 * m * DRAFT(2))
    assert markov.draft_step(2) - plain.draft_step(2) == pytest.approx(m * (DRAFT(2) - DRAFT(1)))
    assert markov.scaled_draft(0.5).candidate == m
    planner = CostPlanner(cost_ratio=0.2, head_cost=0.1)
    planner.price_draft(4, m)
    assert planner.candidate_cost == pytest.approx(0.2 * (0.1 + m))
    tree, priced = TreeCosts(0.2, block=True), TreeCosts(0.2, block=True, candidate=m)
    assert tree.read_gain(0.6, 2) - priced.read_gain(0.6, 2) == pytest.approx(0.2 * m)  # ρ = 1 before any round
    assert hindsight_forwards([0, 3, 2], 4, m) == pytest.approx(2 + 5 * m)


def test_an_eagle3_drafters_measured_curve_runs_its_fusion_layer(drafts):
    """`specheads profile` times a drafter's forward as a catch-up runs it: its tokens' target streams through `fc`."""
    from specheads.decoding.costs import measure_cost_curve

    _, models = drafts
    draft = models["eagle3"]
    with counting(draft.drafter.fc) as fused:
        measure_cost_curve(draft, context=4, tokens=(1, 2), repeats=1)
    assert fused[0] > 0


def test_the_wall_clock_baseline_computes_the_last_logits_of_its_prefill_and_warms_up(drafts, monkeypatch):
    """The target alone's prefill runs the LM head on the prompt's last position only, as the engine's does; and one
    short untimed run of the target alone and of each rule comes before the first timed one."""
    from specheads.eval import wall_clock

    target, models = drafts
    rows: list[int] = []
    hook = target.get_output_embeddings().register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[-2]))
    try:
        tokens, _ = wall_clock.target_alone(target, PROMPT * 3, SamplingTransform(1.0), 4, 0, set())
    finally:
        hook.remove()
    assert len(tokens) == 4 and rows == [1] * 4
    calls = []
    alone, rule = wall_clock.target_alone, wall_clock.run_rule
    monkeypatch.setattr(wall_clock, "target_alone", lambda *args: calls.append(("alone", args[3])) or alone(*args))
    monkeypatch.setattr(wall_clock, "run_rule", lambda *args: calls.append(("rule", args[3].max_new_tokens)) or rule(*args))
    engine = RoundEngine(target, models["eagle3"], SamplingTransform(1.0), stop_ids=[])
    args = wall_clock.DrafterBenchmark(drafter="unused", max_new_tokens=8, rules=["constant_k:2"])
    timed, _, _ = wall_clock.decode_interleaved(engine, [PROMPT, PROMPT], args, SamplingTransform(1.0), set(), None)
    assert calls[:2] == [("alone", wall_clock.WARM_UP_TOKENS), ("rule", wall_clock.WARM_UP_TOKENS)]
    assert calls[2:] == [("alone", 8), ("rule", 8)] * 2 and sorted(timed) == [0, 1]
