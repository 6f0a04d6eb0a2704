"""A head's forwards are priced wherever speed is: a head forward costs its weights over the draft's weights read per
token (the shipped on-time head, 0.0315 of its draft); every token a head scores is counted (chains, and every node of a
head-valued tree) and charged in the counted speedup; a served round adds the head's forwards of each draft step."""

from __future__ import annotations

import pytest
import torch
from test_eval import tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.companion import head_forward_cost, weights_read_per_token
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts, round_seconds, served_throughput
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.eval.serving import replay, request_rounds
from specheads.eval.sweep import DecodePrompt, Setting, aggregate, record_of
from specheads.heads import OnTimeAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform

C = 0.2
VOCAB = 12
PROMPTS = [[1, 2, 3], [4, 5], [7, 1, 1, 9], [2, 8, 3]]


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(seed=21, vocab=VOCAB, init=0.5), tiny_lm(seed=22, vocab=VOCAB, init=0.5)


def on_time_head(depth: int = 1, seed: int = 3) -> OnTimeAcceptanceHead:
    """A random on-time head (at_draft) whose scores vary with the state and the candidate."""
    torch.manual_seed(seed)
    head = OnTimeAcceptanceHead(16, depth=depth, extra_features=["logq", "entropy"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(head.out.weight, std=1.0)
    return head


def test_the_shipped_on_time_head_costs_about_3_percent_of_the_embedded_draft():
    """SmolLM2-135M without layers 20-21 reads its 28 layers, final norm and tied output head per token (127.4 M
    weights; the embedding table is a lookup, its tied head counted once); the shipped head's 4.0 M weights are 0.0315
    of that. The model is built on the meta device: only shapes are read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.heads import load_head
    from specheads.pair.models import without_layers

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    with torch.device("meta"):
        target = LlamaForCausalLM(config)
    draft = without_layers(target, [20, 21])
    layer = sum(p.numel() for p in draft.model.layers[0].parameters())
    assert weights_read_per_token(draft) == 28 * layer + 576 + 49152 * 576
    head = load_head("smollm2-ontime")[0]
    assert head.num_parameters() == pytest.approx(4.0e6, rel=0.01)
    assert head_forward_cost(head, draft) == pytest.approx(0.0315, abs=5e-4)


def test_a_head_rules_counted_speedup_falls_by_the_heads_share(pair):
    """The same runs counted with and without the head's forwards: 1/S grows by c × head forwards per token, and a
    free signal's rule (draft confidence) pays nothing."""
    target, draft = pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head = on_time_head()
    for name, threshold, reads in (("head", 0.5, head), ("confidence", 0.3, None)):
        results = engine.decode(PROMPTS, make_policy(name, threshold, 4), 12, list(range(len(PROMPTS))), reads)
        records = [record_of(Setting(name, threshold), DecodePrompt(f"p{n}", (), "test"), r, 0.0)
                   for n, r in enumerate(results)]
        scored = sum(r.head_scored for r in records)
        assert scored == (sum(r.drafted for r in records) if reads else 0)  # an on-time head scores every candidate
        assert sum(r.head_forwards for r in records) == pytest.approx(scored * (head_forward_cost(head, draft) if reads else 0))
        emitted, calls = sum(r.emitted for r in records), sum(r.target_calls for r in records)
        free = emitted / (C * sum(r.draft_forwards for r in records) + calls)
        charged = aggregate(records, "test", C, None)[0]["modelled_speedup"]
        assert 1 / charged == pytest.approx(1 / free + C * sum(r.head_forwards for r in records) / emitted)
        assert (charged < free) == (reads is not None)


def test_a_tree_charges_every_node_its_head_scored_at_that_heads_cost(pair):
    """A head-valued tree scores every node (a sibling head its later siblings, at its own cost); the nodes are
    recorded per draft forward and charged in the counted speedup. A confidence-valued tree scores nothing."""
    target, draft = pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head, sibling = on_time_head(depth=1), on_time_head(depth=4, seed=5)
    sibling.set_role("sibling")  # a head of second children
    cheap, dear = head_forward_cost(head, draft), head_forward_cost(sibling, draft)
    assert dear > cheap
    rule = TreeRule("head", floor=0.0, budget=6, width=3)
    seeds = list(range(len(PROMPTS)))
    for results, per_node in ((decode_tree(engine, PROMPTS, rule, 12, seeds, head), cheap),
                              (decode_tree(engine, PROMPTS, rule, 12, seeds, head, sibling_head=sibling), None)):
        for result in results:
            assert result.head_scored == result.drafted > 0  # every node
            assert [sum(w) for w in result.head_widths_per_round] == result.drafted_per_round
            assert [len(w) for w in result.head_widths_per_round] == [len(w) for w in result.draft_widths_per_round]
            if per_node is not None:
                assert result.head_forwards == pytest.approx(result.head_scored * per_node)
            else:  # later siblings at the sibling head's cost: between all-cheap and all-dear
                assert result.head_scored * cheap < result.head_forwards < result.head_scored * dear
        records = [record_of(Setting("tree_head_n6", 0.0), DecodePrompt(f"p{n}", (), "test"), r, 0.0)
                   for n, r in enumerate(results)]
        emitted, calls = sum(r.emitted for r in records), sum(r.target_calls for r in records)
        charged = sum(r.draft_forwards + r.head_forwards for r in records)
        assert aggregate(records, "test", C, None)[0]["modelled_speedup"] == pytest.approx(emitted / (C * charged + calls))
    for result in decode_tree(engine, PROMPTS, TreeRule("confidence", floor=0.0, budget=6, width=3), 12, seeds):
        assert (result.head_scored, result.head_forwards, result.head_widths_per_round) == (0, 0.0, [])


DRAFT = CostCurve((1, 8), (1.0, 1.7))
TARGET = CostCurve((1, 8), (5.0, 6.4))


def test_round_seconds_adds_the_heads_forwards_of_each_draft_step():
    """Two rows drafting 3 and 2 candidates, their head scoring each: three head forwards over 2, 2 and 1 tokens, at
    the head's share of the draft's curve, or on the head's own curve where one was measured."""
    record = RoundRecord(requests=[0, 1], drafted=[3, 2], verified=[3, 2], emitted=[4, 3],
                         head_widths=[[1, 1, 1], [1, 1]], head_cost=0.05)
    plain = DRAFT(2) * 2 + DRAFT(1) + TARGET(7)
    assert round_seconds(record, ServingCosts(DRAFT, TARGET)) == pytest.approx(plain + 0.05 * (DRAFT(2) * 2 + DRAFT(1)))
    head = CostCurve((1, 8), (0.3, 0.37))
    assert round_seconds(record, ServingCosts(DRAFT, TARGET, head)) == pytest.approx(plain + head(2) * 2 + head(1))
    # a head timed beside the real draft does not carry over to a draft scaled to c × the target: priced by weights
    assert ServingCosts(DRAFT, TARGET, head).scaled_draft(0.2).head is None
    unscored = RoundRecord(requests=[0, 1], drafted=[3, 2], verified=[3, 2], emitted=[4, 3], head_cost=0.05)
    assert round_seconds(unscored, ServingCosts(DRAFT, TARGET, head)) == pytest.approx(plain)


def test_served_rounds_live_and_replayed_carry_the_heads_forwards(pair):
    """The round engine logs the tokens each row's head scored per draft step and the head's cost; a run's rounds
    replayed from its record carry the same; either way the served seconds are the rounds' without the head plus the
    head's forwards."""
    target, draft = pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head = on_time_head()
    log: list[RoundRecord] = []
    results = engine.decode(PROMPTS, make_policy("head", 0.5, 4), 12, list(range(len(PROMPTS))), head, batch_size=2,
                            log=log)
    assert all(record.head_cost == pytest.approx(head_forward_cost(head, draft)) for record in log)
    assert all(scored == [1] * drafted for record in log for scored, drafted in zip(record.head_widths, record.drafted))
    costs = ServingCosts(DRAFT, TARGET)

    def without_head(rounds: list[RoundRecord]) -> list[RoundRecord]:
        return [RoundRecord(r.requests, r.drafted, r.verified, r.emitted, r.draft_widths) for r in rounds]

    def head_part(rounds: list[RoundRecord]) -> float:
        return served_throughput(rounds, costs)["seconds"] - served_throughput(without_head(rounds), costs)["seconds"]

    per_step = [sum(row[s] for row in r.head_widths if len(row) > s) for r in log for s in range(max(r.drafted))]
    assert sum(per_step) > 0
    assert head_part(log) == pytest.approx(head_forward_cost(head, draft) * sum(DRAFT(n) for n in per_step))
    records = [record_of(Setting("head", 0.5), DecodePrompt(f"p{n}", (), "test"), r, 0.0) for n, r in enumerate(results)]
    replayed = replay([request_rounds(r) for r in records], 2, head_forward_cost(head, draft))
    assert [r.head_widths for r in replayed] == [[[1] * k for k in r.drafted] for r in replayed]
    assert head_part(replayed) > 0


def decode_at(monkeypatch, module, head_cost: float, decode):
    """`decode()` with every head priced at `head_cost` draft forwards (h) where `module` prices heads."""
    monkeypatch.setattr(module, "head_forward_cost", lambda head, draft: head_cost)
    return decode()


def test_the_planners_that_read_a_head_draft_less_when_its_forward_is_dear(pair, monkeypatch):
    """The engine tells the planner h once a decode: a head priced at h = 1 draft forward makes the cost rule draft
    fewer candidates, the cost-grown head tree fewer nodes and the goodput planner plan smaller rounds than at h = 0."""
    import specheads.decoding.engine as engine_module
    import specheads.decoding.tree as tree_module
    from specheads.heads import ExpectedAcceptanceHead

    target, draft = pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head, seeds = on_time_head(), list(range(len(PROMPTS)))
    torch.manual_seed(4)
    expected = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy", "top1"]).eval()
    torch.nn.init.constant_(expected.out.bias, 2.0)  # survivals high enough that the planner drafts at h = 0
    costs = ServingCosts(DRAFT, TARGET)
    runs = {
        "head_cost": (engine_module, lambda: engine.decode(PROMPTS, make_policy("head_cost", C, 8), 16, seeds, head)),
        "tree": (tree_module, lambda: decode_tree(engine, PROMPTS, TreeRule("head", 0.0, budget=8, width=3, cost_ratio=C),
                                                  16, seeds, head)),
        "goodput": (engine_module, lambda: engine.decode(PROMPTS, make_policy("goodput", 4), 16, seeds, expected,
                                                         batch_size=4, costs=costs)),
    }
    for name, (module, decode) in runs.items():
        free, dear = (sum(r.drafted for r in decode_at(monkeypatch, module, h, decode)) for h in (0.0, 1.0))
        assert dear < free, (name, dear, free)


def test_the_free_signal_planners_decide_as_before_whatever_a_head_costs(pair, monkeypatch):
    """D-Cut, vLLM's adaptive verification, SmartSpec, the confidence rule and the confidence tree read what the draft
    computed: a head passed beside them, a dear h and a measured head curve change none of their decisions."""
    import specheads.decoding.engine as engine_module
    import specheads.decoding.tree as tree_module

    target, draft = pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head, seeds = on_time_head(), list(range(len(PROMPTS)))
    plain, with_head = ServingCosts(DRAFT, TARGET), ServingCosts(DRAFT, TARGET, CostCurve((1, 8), (5.0, 9.0)))

    def decisions(results) -> list:
        return [(r.tokens, r.drafted_per_round, r.accepted_per_round) for r in results]

    for name, threshold in (("dcut", 4), ("vllm_adaptive", 4), ("smartspec", 4), ("confidence", 0.3)):
        before = engine.decode(PROMPTS, make_policy(name, threshold, 4), 16, seeds, batch_size=2, costs=plain)
        after = decode_at(monkeypatch, engine_module, 1.0, lambda name=name, threshold=threshold: engine.decode(
            PROMPTS, make_policy(name, threshold, 4), 16, seeds, head, batch_size=2, costs=with_head))
        assert decisions(after) == decisions(before), name
    rule = TreeRule("confidence", 0.0, budget=8, width=3, cost_ratio=C)
    before = decode_tree(engine, PROMPTS, rule, 16, seeds)
    after = decode_at(monkeypatch, tree_module, 1.0, lambda: decode_tree(engine, PROMPTS, rule, 16, seeds))
    assert decisions(after) == decisions(before)
