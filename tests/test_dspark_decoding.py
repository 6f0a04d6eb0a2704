"""DSpark drafts in the decoding core (`specheads.decoding.dspark`): a block per forward with the Markov head's bias,
exactly. The output follows the target's distribution (chi-square on an enumerable tiny target, drafters of
speculators' classes whose vocabulary lacks a token), greedy decoding gives the target's own tokens, the block computes
what speculators' training forward computes (logits with the Markov bias, the confidence head), and the round engine's
cached, batched block decodes as the B = 1 loop."""

import json

import pytest
import torch
from conftest import target_greedy, vocabulary_maps
from test_eagle3_decoding import check_profile, randomised
from test_eval import PROMPT, chi_square_p, sequence_probabilities, tiny_lm
from test_exactness_power import exactness_p

from specheads.model_outputs.sampling import SamplingTransform

pytest.importorskip("speculators.models.dspark")

from specheads.decoding import RoundEngine, make_policy  # noqa: E402
from specheads.decoding.costs import CostCurve, ServingCosts, round_seconds  # noqa: E402
from specheads.decoding.dspark import DSparkModel, block_forward, candidate_logits, dspark_decode  # noqa: E402
from specheads.decoding.planners import DSparkScaledSignal, DSparkSignal  # noqa: E402
from specheads.decoding.rules import StopPolicy  # noqa: E402
from specheads.decoding.tree import TreeRule, decode_tree  # noqa: E402
from specheads.heads.calibration import PositionCalibration  # noqa: E402
from specheads.pair.drafters import fill_from_target, save_drafter, target_features  # noqa: E402
from specheads.pair.dspark import build_drafter, load_drafter  # noqa: E402
from specheads.plumbing.errors import UsageError  # noqa: E402

LENGTH = 4  # the first token, then a round of two candidates and its bonus: candidate 2 reads candidate 1's bias
P_MIN = 0.64  # the tiny drafter's confidence is mostly 0.59 to 0.71: p_min drops some candidates, checks most
STEP_COSTS = ServingCosts(CostCurve((1, 64), (0.05, 0.1)), CostCurve((1, 16, 24, 64), (1.0, 1.1, 2.5, 6.0)))
"""A target whose forward of 8 rows costs little more for 2 tokens a row and much more for 3: the goodput planner
then drafts one candidate where it could draft two, on the rounds of 8 rows."""


def random_dspark(target, layer_ids, d2t, t2d, seed=0, std=0.5, **settings):
    """A DSpark drafter of speculators' classes with random trained weights, filled from `target`."""
    options = {"mask_token_id": 2, "num_layers": 1, "block_size": 3, "markov_rank": 4, **settings}
    drafter = build_drafter(target.config, layer_ids, len(d2t), "tiny", **options)
    fill_from_target(drafter, target, torch.tensor(d2t), torch.tensor(t2d))
    return randomised(drafter, seed, std)


@pytest.fixture(scope="module")
def tiny_dspark():
    target = tiny_lm(seed=1)
    # the draft vocabulary is tokens 0 and 2: q(1) = 0 everywhere, the target's p(1) is real mass
    return target, random_dspark(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True])


@pytest.fixture(scope="module")
def recurrent_dspark(tiny_dspark):
    """The same target, a drafter without `sample_from_anchor` (slot 0 unused) and a recurrent Markov head."""
    target, _ = tiny_dspark
    return target, random_dspark(target, [0, 2], d2t=[0, 1], t2d=[True, False, True], seed=1, block_size=3,
                                 sample_from_anchor=False, markov_head_type="rnn")


@pytest.fixture(scope="module")
def wide_dspark(tiny_model):
    """The tiny target of 320 tokens and a drafter over every third token (rarely accepted: random weights)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    return target, random_dspark(target, [1, 2, 3], *vocabulary_maps(vocabulary, 3), std=0.3, mask_token_id=0, block_size=4,
                                 markov_rank=8, markov_head_type="gated")


def test_dspark_blocks_sample_the_target_distribution(tiny_dspark):
    target, drafter = tiny_dspark
    transform = SamplingTransform(1.0)
    # 400 sequences, one request at a time: residual p fails at p = 1e-7 (2e-14 on 800)
    results = [dspark_decode(target, drafter, PROMPT, transform, 3, LENGTH, seed) for seed in range(400)]
    assert chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform, LENGTH)) > 1e-3
    assert all(r.draft_forwards == r.reached[0] for r in results)  # one block per round that drafts
    reached, accepted = (sum(sum(getattr(r, name)) for r in results) for name in ("reached", "accepted"))
    assert 0 < accepted < reached and sum(r.reached[1] for r in results) > 100  # the second candidate is drafted


@pytest.mark.parametrize("pair", ["tiny_dspark", "recurrent_dspark"])
def test_the_round_engine_with_a_dspark_draft_samples_the_target_distribution_in_batches(pair, request):
    target, drafter = request.getfixturevalue(pair)
    transform = SamplingTransform(1.0)
    draft = DSparkModel(drafter, target)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    runs = 800
    results = engine.decode([PROMPT] * runs, make_policy("constant_k", 3, max_draft=3), LENGTH, list(range(runs)),
                            batch_size=8)  # continuous batching: a finished row takes the next request
    assert chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform, LENGTH)) > 1e-3
    assert 0 < sum(r.accepted for r in results) < sum(r.drafted for r in results)
    assert max(r.drafted_per_round[1] for r in results) == 2  # two candidates from one block
    # one block a round that drafts, and each candidate's Markov bias at its share of one
    assert all(r.draft_forwards == pytest.approx(sum(1 for drafted in r.drafted_per_round if drafted)
                                                 + draft.candidate_cost * r.drafted) for r in results)


class ConfidenceStop(StopPolicy):
    """Stop after candidate k when the drafter's own Π_{j≤k} of its confidence falls below the threshold (what it
    predicts before each draw; the test's rule, reading `Drafted.drafter_score`)."""

    name = "test_dspark_confidence"

    def signal_says_stop(self, drafted):
        return drafted.drafter_score < self.threshold


def test_a_rule_reading_the_confidence_head_stays_exact_and_sees_the_b1_loops_scores(tiny_dspark, monkeypatch):
    """The confidence head's prediction for candidate k reaches the rule with k (`Drafted.drafter_score`), as the B = 1
    loop computes it; a rule stopping on it decides at k before candidate k + 1 is drawn, and the output stays the
    target's."""
    target, drafter = tiny_dspark
    transform = SamplingTransform(1.0)
    seen = []
    original = ConfidenceStop.signal_says_stop
    monkeypatch.setattr(ConfidenceStop, "signal_says_stop", lambda self, d: seen.append(d.drafter_score) or original(self, d))
    engine = RoundEngine(target, DSparkModel(drafter, target), transform, stop_ids=[])
    engine.decode([PROMPT], ConfidenceStop(threshold=0.0, max_draft=3), 12, [0])
    alone = dspark_decode(target, drafter, PROMPT, transform, 3, 12, 0)
    # the rule is asked about every candidate but a round's last, which the cap ends
    assert len(seen) > 4 and seen == pytest.approx([s for scores in alone.confidence for s in scores[:-1]], abs=1e-6)
    runs = 800
    results = engine.decode([PROMPT] * runs, ConfidenceStop(threshold=0.7, max_draft=3), LENGTH, list(range(runs)),
                            batch_size=64)
    assert exactness_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform, LENGTH)) > 1e-3
    assert {r.drafted_per_round[1] for r in results} == {1, 2}  # the rule ended some rounds after one candidate


@pytest.mark.parametrize("rule", ["dspark_confidence", "dspark_adaptive", "dspark_confidence_ts", "dspark_adaptive_ts"])
def test_the_drafters_confidence_as_a_free_rule_stays_exact(tiny_dspark, rule):
    """llama.cpp's p_min on the confidence head (the candidate below it ends the round unchecked) and vLLM's adaptive
    verification planning on it (the goodput planner ranking the rows' candidates by its survival products), raw and
    through per-position temperatures (SGLang's table): all read a score known before the draw, so the output stays
    the target's."""
    target, drafter = tiny_dspark
    transform = SamplingTransform(1.0)
    model = DSparkModel(drafter, target)
    scaled = rule.endswith("_ts")
    if scaled:
        model.score_temperatures = PositionCalibration(scale=(4.0, 0.25, 2.0), bias=(0.0, 0.0, 0.0))
    engine = RoundEngine(target, model, transform, stop_ids=[])
    runs, log = 800, []
    p_min = 0.7 if scaled else P_MIN  # where the scaled and the raw confidence disagree about it
    policy = make_policy(rule, p_min if "confidence" in rule else 3, max_draft=3)
    decisions, planned = [], []
    original, signals = type(policy).stop, (DSparkSignal, DSparkScaledSignal)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(policy), "stop", lambda self, d: decisions.append((d, original(self, d))) or decisions[-1][1])
        for signal in signals:  # which of the two signals the planner reads
            patch.setattr(signal, "acceptance", lambda self, d, read=signal.acceptance: planned.append(self.name)
                          or read(self, d))
        results = engine.decode([PROMPT] * runs, policy, LENGTH, list(range(runs)), batch_size=8, costs=STEP_COSTS,
                                log=log)
    assert exactness_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform, LENGTH)) > 1e-3
    raw = [(d.index, d.drafter_score, d.drafter_score_scaled) for d, _ in decisions]
    if scaled:  # candidate k's confidence z reaches the rule as σ(scale_k · z)
        assert all(s == pytest.approx(1 / (1 + (p / (1 - p)) ** -(4.0, 0.25, 2.0)[k - 1]), abs=1e-6) for k, p, s in raw)
    else:
        assert all(s is None for _, _, s in raw)
    if "confidence" in rule:  # where the raw and the scaled score disagree about p_min, the rule follows its own
        split = [(d, stopped) for d, stopped in decisions if d.index < 3
                 and (d.drafter_score < p_min) != (d.drafter_score_scaled is not None and d.drafter_score_scaled < p_min)]
        read = (lambda d: d.drafter_score_scaled) if scaled else (lambda d: d.drafter_score)
        assert not scaled or split
        assert all(stopped == (read(d) < p_min) for d, stopped in split)
    else:
        assert set(planned) == {"dspark_confidence_ts" if scaled else "dspark_confidence"}
    checked = [(v, d) for record in log for v, d in zip(record.verified, record.drafted) if d]
    if "confidence" in rule:  # a candidate whose confidence was below p_min ended its round unchecked
        assert any(v == d - 1 for v, d in checked) and any(v == d for v, d in checked)
    else:  # the confidence planned each row's drafting: a first round of two candidates' room drafted one, or two
        assert {r.drafted_per_round[1] for r in results} == {1, 2}


def test_a_temperature_scaled_rule_is_refused_on_a_drafter_given_no_temperatures(tiny_dspark):
    """`dspark_confidence_ts` / `dspark_adaptive_ts` read the confidence through temperatures: without them the engine
    refuses in one line before any forward, instead of deciding on the unscaled score."""
    target, drafter = tiny_dspark
    engine = RoundEngine(target, DSparkModel(drafter, target), SamplingTransform(1.0), stop_ids=[])
    for rule in ("dspark_confidence_ts", "dspark_adaptive_ts"):
        with pytest.raises(UsageError, match="was given none") as refused:
            engine.decode([PROMPT], make_policy(rule, 0.5 if "confidence" in rule else 3, max_draft=3), 4, [0])
        assert "\n" not in str(refused.value)


def drafters_own_head(drafter):
    """A `dspark_confidence` head of ours holding the drafter's own confidence head's weights (no standardisation,
    no correction, no calibration): the same function of [state ; Markov embedding]."""
    from specheads.heads.dspark import DSparkConfidenceHead

    proj = drafter.confidence_head.proj
    head = DSparkConfidenceHead(drafter.config.transformer_layer_config.hidden_size,
                                markov_rank=drafter.markov_head.markov_rank)
    with torch.no_grad():
        head.out.weight.copy_(proj.weight.float())
        head.out.bias.copy_(proj.bias.float())
    return head.eval()


@pytest.mark.parametrize("tiny", ["tiny_dspark", "recurrent_dspark"])
def test_a_head_of_ours_reading_the_drafters_state_and_markov_embedding_scores_as_its_own_head(tiny, request,
                                                                                              monkeypatch):
    """A head trained on a DSpark drafter's data (`dspark_confidence`, markov_rank R) is fed in decoding what it was
    trained on: the slot's state and markov_w1[the token before the candidate]. Holding the drafter's own head's
    weights, it scores every candidate as the drafter's head does, in B > 1 batches."""
    from specheads.decoding.rules import HeadStop

    target, drafter = request.getfixturevalue(tiny)
    seen = []
    original = HeadStop.signal_says_stop
    monkeypatch.setattr(HeadStop, "signal_says_stop",
                        lambda self, d: seen.append((d.score, d.drafter_score)) or original(self, d))
    engine = RoundEngine(target, DSparkModel(drafter, target), SamplingTransform(1.0), stop_ids=[])
    results = engine.decode([PROMPT, [2, 0, 1, 1], [1]], make_policy("head", 0.6, max_draft=3), 12, [0, 1, 2],
                            drafters_own_head(drafter), batch_size=2)
    ours, theirs = zip(*seen)
    assert len(seen) > 6 and ours == pytest.approx(theirs, abs=1e-5) and len(set(theirs)) > 3
    assert all(result.head_scored for result in results)


def test_a_head_reading_a_markov_embedding_is_refused_with_a_draft_that_makes_none(tiny_dspark):
    target, drafter = tiny_dspark
    head = drafters_own_head(drafter)
    engine = RoundEngine(target, tiny_lm(seed=2), SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="reads a DSpark drafter's Markov embedding of rank 4, which this draft does "
                                         "not make") as raised:
        engine.decode([PROMPT], make_policy("head", 0.5), 4, [0], head)
    assert "\n" not in str(raised.value)
    tree = RoundEngine(target, DSparkModel(drafter, target), SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="a tree feeds a head no DSpark Markov embedding.*decode chains with it"):
        decode_tree(tree, [PROMPT], TreeRule(values="head", floor=0.1, budget=4), 4, [0], head=head)


def test_a_rule_reading_the_drafters_confidence_is_refused_with_a_draft_that_has_none(tiny_dspark):
    target, drafter = tiny_dspark
    plain = random_dspark(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True], confidence_head=False)
    for draft in (DSparkModel(plain, target), tiny_lm(seed=2)):
        engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
        for rule in ("dspark_confidence", "dspark_adaptive"):
            with pytest.raises(UsageError, match=f"the {rule} rule reads a DSpark drafter's confidence head") as raised:
                engine.decode([PROMPT], make_policy(rule, 0.5 if rule == "dspark_confidence" else 3), 4, [0],
                              costs=ServingCosts(CostCurve((1, 2), (0.1, 0.1)), CostCurve((1, 2), (1.0, 1.0))))
            assert "\n" not in str(raised.value)


@pytest.mark.parametrize("pair, prompts", [("tiny_dspark", [[0, 1], [2, 0, 1, 1], [1]]),
                                           ("recurrent_dspark", [[0, 1], [2, 0, 1, 1], [1]]),
                                           ("wide_dspark", [[5, 9, 30, 41], [8, 3], [12, 60, 7, 99, 14, 2]])])
def test_the_round_engine_decodes_as_the_b1_dspark_loop_and_greedy_as_the_target(pair, prompts, request):
    target, drafter = request.getfixturevalue(pair)
    for temperature in (1.0, 0.0):
        transform = SamplingTransform(temperature)
        draft = DSparkModel(drafter, target)
        engine = RoundEngine(target, draft, transform, stop_ids=[])
        batched = engine.decode(prompts, make_policy("constant_k", 4, max_draft=4), 14, [0, 1, 2], batch_size=2)
        for seed, (prompt, result) in enumerate(zip(prompts, batched)):
            alone = dspark_decode(target, drafter, prompt, transform, 4, 14, seed)  # its blocks, the Markov bias apart
            assert result.tokens == alone.tokens, (temperature, seed)
            assert result.draft_forwards == pytest.approx(alone.draft_forwards + draft.candidate_cost * result.drafted)
            if temperature == 0:
                assert result.tokens == target_greedy(target, prompt, 14)


@pytest.mark.parametrize("anchor_first, head", [(True, "vanilla"), (False, "vanilla"), (True, "gated"), (True, "rnn"),
                                                (False, "rnn")])
def test_the_block_computes_what_speculators_training_forward_computes(tiny_model, monkeypatch, anchor_first, head):
    """speculators trains a DSpark drafter with one forward over a sequence and random anchors, the Markov head reading
    the sequence's own tokens; the decoding core drafts a block from the target's streams before the anchor and reads
    the drafted tokens back one by one. Given the same tokens, both give the same logits and confidence."""
    from speculators.models.dflash import core as dflash_core
    from speculators.models.dspark import core as dspark_core
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    drafter = random_dspark(target, [1, 2, 3], *vocabulary_maps(vocabulary, 2), std=0.3, mask_token_id=1, block_size=4,
                            markov_rank=8, markov_head_type=head, sample_from_anchor=anchor_first)
    tokens = [5, 9, 30, 41, 7, 12, 60, 3, 99, 14, 21, 8, 2, 17]
    anchors = torch.tensor([3, 7])
    size = len(tokens)
    aux, last = target_features(target, torch.tensor([tokens]), torch.ones(1, size, dtype=torch.long), [1, 2, 3])
    monkeypatch.setattr(dflash_core, "select_anchors", lambda mask, count, block: (anchors, torch.ones(2, dtype=torch.bool)))
    captured = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        captured.update(logits=logits[0], confidence=confidence_logits[0].sigmoid())
        return torch.zeros(()), {}

    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    with torch.no_grad():
        drafter(hidden_states=aux, input_ids=torch.tensor([tokens]), loss_mask=torch.ones(1, size, dtype=torch.long),
                verifier_last_hidden_states=last, document_ids=torch.zeros(1, size, dtype=torch.long),
                position_ids=torch.arange(size)[None], max_anchors=2)
    offset = 0 if anchor_first else 1
    for index, anchor in enumerate(anchors.tolist()):
        block = block_forward(drafter, aux[0, :anchor], tokens[anchor])
        for candidate in range(1, 5 - offset):
            logits, confidence = candidate_logits(drafter, block, tokens[anchor: anchor + candidate])
            row = index * 4 + candidate - 1 + offset
            assert torch.allclose(logits, captured["logits"][row].float(), atol=1e-4), (anchor, candidate)
            assert confidence == pytest.approx(float(captured["confidence"][row]), abs=1e-5)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_dspark_tree_drafts_sample_the_target_distribution(tiny_dspark, batch_size):
    target, drafter = tiny_dspark
    transform = SamplingTransform(1.0)
    engine = RoundEngine(target, DSparkModel(drafter, target), transform, stop_ids=[])
    runs = 300 if batch_size == 1 else 400  # residual p fails at p = 9e-11 and 1e-11 (each row draws alike at any B)
    results = decode_tree(engine, [PROMPT] * runs, TreeRule(values="confidence", floor=0.05, budget=4, width=2), LENGTH,
                          list(range(runs)), batch_size=batch_size)
    assert chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform, LENGTH)) > 1e-3
    assert 0 < sum(r.accepted for r in results) < sum(r.drafted for r in results)
    assert all(len(widths) <= 1 for r in results for widths in r.draft_widths_per_round)  # one block forward a round


def test_a_dspark_decode_is_counted_and_planned_at_one_block_forward_a_round(tiny_dspark):
    """The oracle keeps a round's accepted candidates, one block forward for all of them (not one each); SmartSpec,
    told the draft's shape, drafts the whole block where a chain's second forward would not pay (a draft at half the
    target's cost, a flat target: its prior a = 0.7 picks K = 1 for a chain); the served rounds' prices read one
    forward a round."""
    target, drafter = tiny_dspark
    draft = DSparkModel(drafter, target)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    results = engine.decode([PROMPT] * 60, make_policy("oracle", 3, max_draft=3), 12, list(range(60)), batch_size=8)
    assert all(r.draft_forwards == pytest.approx(sum(1 for a in r.accepted_per_round if a)
                                                 + draft.candidate_cost * r.accepted) for r in results)
    assert any(a > 1 for r in results for a in r.accepted_per_round)  # rounds that keep several candidates of a block
    costs = ServingCosts(CostCurve((1, 64), (0.5, 0.5)), CostCurve((1, 64), (1.0, 1.0)))
    log = []
    planner = make_policy("smartspec", 3, max_draft=3).planner(costs)
    result = engine.decode([PROMPT], make_policy("smartspec", 3, max_draft=3), 12, [0], costs=costs, log=log,
                           planner=planner)[0]
    assert planner.costs.block == 3 and result.drafted_per_round[1] == 3  # round 1 reads the prompt: it drafts none
    # one forward: the first token read as context (the prompt's prefill is not priced) and the block's three slots
    assert [widths for record in log for widths in record.draft_widths][1] == [1 + 3]
    # and each of the three candidates' Markov bias at its share of a forward (0.5 s at any tokens)
    assert round_seconds(log[1], costs.shaped(3)) == pytest.approx(0.5 + 1.0 + 3 * draft.candidate_cost * 0.5)


def test_greedy_dspark_trees_give_the_targets_greedy_tokens(wide_dspark):
    target, drafter = wide_dspark
    prompts = [[5, 9, 30, 41], [8, 3], [12, 60, 7, 99, 14, 2]]
    engine = RoundEngine(target, DSparkModel(drafter, target), SamplingTransform(0.0), stop_ids=[])
    results = decode_tree(engine, prompts, TreeRule(values="confidence", floor=0.0, budget=6, width=2), 16, [0, 1, 2],
                          batch_size=2)
    for prompt, result in zip(prompts, results):
        assert result.tokens == target_greedy(target, prompt, 16)
        assert 1 < max(result.drafted_per_round) <= 6


def test_a_saved_drafter_loads_back_and_drafts_the_same(wide_dspark, tmp_path):
    target, drafter = wide_dspark
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    loaded = load_drafter(tmp_path / "drafter", target)
    for seed in range(3):
        assert (dspark_decode(target, loaded, [5, 9, 30], SamplingTransform(1.0), 4, 12, seed).tokens
                == dspark_decode(target, drafter, [5, 9, 30], SamplingTransform(1.0), 4, 12, seed).tokens)


@pytest.mark.parametrize("change, problem", [({"transformer_layer_config": {"layer_types": ["sliding_attention"]}},
                                               "sliding-window layers"),
                                              ({"mask_token_id": None}, "mask_token_id None is not a token"),
                                              ({"speculators_model_type": "eagle3"}, "names speculators_model_type 'eagle3'")])
def test_a_drafter_folder_the_core_cannot_draft_with_is_refused_in_one_line(wide_dspark, tmp_path, change, problem):
    target, drafter = wide_dspark
    save_drafter(drafter, tmp_path / "drafter")
    path = tmp_path / "drafter" / "config.json"
    config = json.loads(path.read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(config))
    with pytest.raises(UsageError, match=problem) as raised:
        load_drafter(tmp_path / "drafter", target)
    assert "\n" not in str(raised.value)


def test_what_the_engine_cannot_do_yet_with_a_dspark_draft_is_refused_in_one_line(tiny_dspark):
    target, drafter = tiny_dspark
    engine = RoundEngine(target, DSparkModel(drafter, target), SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="earns no bonus token, which a DSpark draft's first round needs"):
        engine.decode([PROMPT], make_policy("sprinter", 0.5), 4, [0])


def test_dspark_drafts_through_transformers_generate(tiny_dspark, wide_dspark):
    """`target.generate(custom_generate=speculative_generate, draft=DSparkModel(...))`: without a head it drafts its
    whole block each round; sampled it follows the target's distribution, greedy it is the target's own greedy output,
    as a chain and as a tree."""
    from specheads.integrations.transformers import speculative_generate

    target, drafter = tiny_dspark
    torch.manual_seed(0)
    runs = 800
    ids = torch.tensor([PROMPT] * runs)
    stats = []
    out = target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=speculative_generate,
                          draft=DSparkModel(drafter, target), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=LENGTH, eos_token_id=None, pad_token_id=0, stats=stats)
    samples = [tuple(row) for row in out[:, len(PROMPT):].tolist()]
    assert chi_square_p(samples, sequence_probabilities(target, SamplingTransform(1.0), LENGTH)) > 1e-3
    assert max(r.drafted_per_round[1] for r in stats) == 2  # the block's candidates, as room allows
    target, drafter = wide_dspark
    ids = torch.tensor([[5, 9, 30, 41]])
    common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 16, "do_sample": False, "eos_token_id": None,
              "pad_token_id": 0}
    greedy = target.generate(ids, **common)
    for tree in (None, {"values": "confidence", "floor": 0.05, "budget": 4, "width": 2}):
        speculative = target.generate(ids, custom_generate=speculative_generate, draft=DSparkModel(drafter, target),
                                      tree=tree, **common)
        assert torch.equal(speculative, greedy), tree


def test_profile_measures_a_dspark_drafter_as_the_draft(wide_dspark, tiny_model, tmp_path):
    check_profile("--dspark", "DSpark", wide_dspark[1], tiny_model, tmp_path)


def test_profile_refuses_two_drafters_or_a_dspark_folder_that_is_not_one_before_loading_anything(tmp_path, capsys):
    from specheads.cli import main

    (tmp_path / "empty").mkdir()
    for flags in (["--dspark", str(tmp_path / "empty")], ["--dspark", str(tmp_path), "--eagle3", str(tmp_path)]):
        assert main(["profile", *flags, "--out", str(tmp_path / "costs.json")]) == 2
        error = capsys.readouterr().err.strip()
        assert ("give the folder of a drafter" in error or "give one of them" in error) and error.count("\n") == 0
    assert not (tmp_path / "costs.json").exists()


def test_the_wall_clock_benchmark_decodes_each_rule_with_a_dspark_drafter(wide_dspark, tiny_model, prompts_file, tmp_path):
    """benchmarks/dspark_decode.py (the code it shares with eagle3_decode.py: `specheads.eval.wall_clock`): every
    rule beside the target alone on the same prompts and seeds, at most one block forward a target call."""
    from conftest import load_benchmark

    save_drafter(wide_dspark[1], tmp_path / "drafter", dtype=torch.float32)
    bench = load_benchmark("dspark_decode")
    args = bench.DSparkBenchmark(drafter=str(tmp_path / "drafter"), target=str(tiny_model), prompt_file=str(prompts_file),
                                 prompts=3, max_new_tokens=8, rules=["constant_k:4", "dspark_confidence:0.7", "tree:0.1"],
                                 resamples=20, out=str(tmp_path / "out.json"))
    report = bench.benchmark_drafter(args, "dspark")
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(json.dumps(report))
    assert report["kind"] == "dspark" and set(report["rules"]) == set(args.rules)
    for rule, row in report["rules"].items():
        markov = DSparkModel(wide_dspark[1], wide_dspark[0]).candidate_cost * args.max_draft  # a round's Markov biases
        assert row["tokens_per_s"] > 0 and 0 < row["draft_forwards_per_target_call"] <= 1 + markov, rule
        assert (row["acceptance_per_position"] is None) == rule.startswith("tree:")
        assert len(row["speedup_interval"]) == 2
        if counts := row["acceptance_counts"]:  # a chain's: position k is reached only where k - 1 accepted
            accepted, reached = counts["accepted"], counts["reached"]
            assert [round(a / r, 3) for a, r in zip(accepted, reached)] == row["acceptance_per_position"]
            assert all(later <= a <= r for later, a, r in zip(reached[1:] + [0], accepted, reached)), rule
