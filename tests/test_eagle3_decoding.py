"""EAGLE-3 drafts in the decoding core (`specheads.decoding.eagle3`): the output follows the target's distribution
(chi-square on an enumerable tiny target, a drafter of speculators' classes whose vocabulary lacks a token), greedy
decoding gives the target's own tokens, and the cached drafter computes what speculators' training forward computes."""

import itertools
import json

import pytest
import torch
from conftest import target_greedy, vocabulary_maps
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm
from test_exactness_power import exactness_p

from specheads.model_outputs.sampling import SamplingTransform

pytest.importorskip("speculators.models.eagle3")

from specheads.decoding.eagle3 import Eagle3Draft, eagle3_decode  # noqa: E402
from specheads.decoding.features import FeatureTarget  # noqa: E402
from specheads.pair.drafters import fill_from_target, target_features  # noqa: E402
from specheads.pair.eagle3 import build_drafter  # noqa: E402


def randomised(drafter, seed=0, std=0.5, also=()):
    """`drafter` with random weights in place of its trained ones (and of the weights named in `also`), in eval mode,
    frozen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if parameter.requires_grad or name in also:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std + (1.0 if "norm" in name else 0.0))
    return drafter.eval().requires_grad_(False)


def random_drafter(target, layer_ids, d2t, t2d, seed=0, std=0.5):
    """A drafter of speculators' classes with random trained weights (its head too), filled from `target`."""
    drafter = build_drafter(target.config, layer_ids, len(d2t), "tiny")
    fill_from_target(drafter, target, torch.tensor(d2t), torch.tensor(t2d))
    return randomised(drafter, seed, std, also=("lm_head.weight",))


def check_profile(flag, name, drafter, tiny_model, tmp_path):
    """`specheads profile --target.path TINY FLAG DIR` times the drafter saved in DIR as the draft, named `name`."""
    from specheads.cli import main
    from specheads.pair.drafters import save_drafter

    save_drafter(drafter, tmp_path / "drafter")
    out = tmp_path / "costs.json"
    assert main(["profile", "--target.path", str(tiny_model), flag, str(tmp_path / "drafter"), "--out", str(out),
                 "--tokens", "[1, 2]", "--repeats", "1", "--device", "cpu"]) == 0
    table = json.loads(out.read_text())
    facts = table["models"]["draft"]
    assert facts["name"] == f"{name} {tmp_path / 'drafter'}" and facts["layers"] == 1
    assert facts["parameters"] == sum(p.numel() for p in drafter.parameters())  # the drafter was timed, not the target
    assert len(table["draft"]["seconds"]) == 2 and all(s > 0 for s in table["draft"]["seconds"])


@pytest.fixture(scope="module")
def tiny_eagle():
    target = tiny_lm(seed=1)
    # the draft vocabulary is tokens 0 and 2: q(1) = 0 everywhere, the target's p(1) is real mass
    return target, random_drafter(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True])


def test_eagle3_drafts_sample_the_target_distribution(tiny_eagle):
    target, drafter = tiny_eagle
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    for max_draft in (1, 3):
        results = [eagle3_decode(target, drafter, PROMPT, transform, max_draft, LENGTH, seed) for seed in range(600)]
        samples = [tuple(result.tokens) for result in results]
        assert chi_square_p(samples, exact) > 1e-3, max_draft
        accepted = sum(sum(result.accepted) for result in results)
        assert 0 < accepted < sum(sum(result.reached) for result in results)  # some drafts stand, some do not


def test_greedy_eagle3_decoding_gives_the_targets_greedy_tokens(tiny_model):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    drafter = random_drafter(target, [1, 2, 3], *vocabulary_maps(vocabulary, 3), std=0.3)
    prompt = [5, 9, 30, 41]
    expected = target_greedy(target, prompt, 20)
    result = eagle3_decode(target, drafter, prompt, SamplingTransform(0.0), 4, 20, seed=0)
    assert result.tokens == expected and result.target_calls == result.rounds + 1


def test_the_cached_drafter_computes_what_speculators_training_forward_computes(tiny_model):
    """speculators trains a drafter with one masked forward over a whole sequence, three drafted steps at once; the
    decoding core feeds it through a KV cache, the verified positions with the target's features and the drafted ones
    with its own states. Both must give the same logits for the same inputs."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    kept = list(range(0, 128))
    drafter = random_drafter(target, [1, 2, 3], [t - i for i, t in enumerate(kept)],
                             [i in set(kept) for i in range(vocabulary)], std=0.3)
    tokens = [5, 9, 30, 41, 7, 12, 60, 3, 99, 14]
    aux, _ = target_features(target, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), [1, 2, 3])
    captured = []
    hook = drafter.lm_head.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    size = len(tokens) - 1  # speculators' shifted layout: token t + 1 with the features of t, positions from 1
    with torch.no_grad():
        drafter(hidden_states=aux[:, :size], input_ids=torch.tensor([tokens[1:]]), document_ids=torch.zeros(1, size, dtype=torch.long),
                position_ids=torch.arange(1, size + 1).unsqueeze(0), ttt_steps=3)
    hook.remove()
    for verified in (3, 6):  # positions 0..verified−1 stand; the drafted tokens are the sequence's next ones
        draft = Eagle3Draft(drafter, vocabulary)
        verifier = FeatureTarget(target, [1, 2, 3])
        verifier.feed(tokens[:verified])
        logits, own = draft.feed(tokens[1:verified], verifier.features[: verified - 1], fused=True)
        index = verified - 2  # speculators' row of position verified − 1
        assert torch.allclose(logits[-1], captured[0][index].float(), atol=1e-4)
        for step in (1, 2):
            logits, own = draft.feed([tokens[verified - 1 + step]], own[-1:], fused=False)
            assert torch.allclose(logits[-1], captured[step][index].float(), atol=1e-4), (verified, step)


def test_every_round_feeds_the_drafter_the_target_features_of_the_position_before_each_token(tiny_model, monkeypatch):
    """As vLLM's proposer: a token read with the target's features gets those of the position before it, computed on
    the standing tokens; a drafted token gets the drafter's own state."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    drafter = random_drafter(target, [1, 2, 3], [0] * 64, [i < 64 for i in range(vocabulary)], std=0.3)
    fed = []
    original = Eagle3Draft.feed

    def recording(self, tokens, features, fused):
        fed.append((self.first_position + self.length, list(tokens), features.clone(), fused))
        return original(self, tokens, features, fused)

    monkeypatch.setattr(Eagle3Draft, "feed", recording)
    prompt = [5, 9, 30, 41]
    result = eagle3_decode(target, drafter, prompt, SamplingTransform(1.0), 3, 16, seed=3)
    sequence = prompt + result.tokens
    aux, _ = target_features(target, torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.long), [1, 2, 3])
    catch_ups = [(start, tokens, features) for start, tokens, features, fused in fed if fused]
    assert result.rounds - 1 <= len(catch_ups) <= result.rounds and catch_ups[0][0] == 1 and result.rounds > 2
    covered = 1
    for start, tokens, features in catch_ups:  # every position read once with the target's features, in order
        assert start == covered and tokens == sequence[start:start + len(tokens)]
        assert torch.allclose(features, aux[0, start - 1:start - 1 + len(tokens)], atol=1e-4)
        covered = start + len(tokens)
    assert covered <= len(sequence) and sum(not fused for *_, fused in fed) == result.draft_forwards - len(catch_ups)


def test_the_round_engine_with_an_eagle3_draft_samples_the_target_distribution_in_batches(tiny_eagle):
    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.eagle3 import Eagle3Model

    target, drafter = tiny_eagle
    transform = SamplingTransform(1.0)
    length = LENGTH + 1  # a first round of two candidates: a residual draw at either
    exact = sequence_probabilities(target, transform, length)
    engine = RoundEngine(target, Eagle3Model(drafter, target), transform, stop_ids=[])
    runs = 1200
    for name, threshold in (("constant_k", 2), ("confidence", 0.5)):
        results = engine.decode([PROMPT] * runs, make_policy(name, threshold, max_draft=3), length, list(range(runs)),
                                batch_size=64)  # continuous batching: a finished row takes the next request
        assert exactness_p([tuple(result.tokens) for result in results], exact) > 1e-3, name
        assert 0 < sum(result.accepted for result in results) < sum(result.drafted for result in results)


@pytest.fixture(scope="module")
def wide_eagle(tiny_model):
    """The tiny target of 320 tokens and a drafter over its even ones (rarely accepted: random weights)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    return target, random_drafter(target, [1, 2, 3], *vocabulary_maps(vocabulary, 2), std=0.3)


@pytest.mark.parametrize("pair, prompts", [("tiny_eagle", [[0, 1], [2, 0, 1, 1], [1]]),  # most drafts accepted
                                           ("wide_eagle", [[5, 9, 30, 41], [8, 3], [12, 60, 7, 99, 14, 2]])])
def test_the_round_engine_decodes_as_the_b1_eagle3_loop_and_greedy_as_the_target(pair, prompts, request):
    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.eagle3 import Eagle3Model

    target, drafter = request.getfixturevalue(pair)
    drafted = accepted = 0
    for temperature in (1.0, 0.0):
        transform = SamplingTransform(temperature)
        engine = RoundEngine(target, Eagle3Model(drafter, target), transform, stop_ids=[])
        batched = engine.decode(prompts, make_policy("constant_k", 3, max_draft=3), 16, [0, 1, 2], batch_size=2)
        for seed, (prompt, result) in enumerate(zip(prompts, batched)):
            alone = eagle3_decode(target, drafter, prompt, transform, 3, 16, seed)
            assert result.tokens == alone.tokens, (temperature, seed)
            drafted, accepted = drafted + result.drafted, accepted + result.accepted
            if temperature == 0:
                assert result.tokens == target_greedy(target, prompt, 16)
    assert accepted < drafted and (pair == "wide_eagle" or accepted > drafted / 3)


def test_a_catch_up_of_many_rows_fuses_their_target_streams_in_one_fc(wide_eagle, monkeypatch):
    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.eagle3 import Eagle3BatchCache, Eagle3Model

    target, drafter = wide_eagle
    fused: list[int] = []  # the rows (positions) of each `fc` forward
    hook = drafter.fc.register_forward_hook(lambda module, args, output: fused.append(args[0].shape[0]))
    runs = []  # per drafter forward, the `fc` forwards it ran
    original = Eagle3BatchCache.feed

    def feed(self, tokens, logits_rows=None):
        before = len(fused)
        result = original(self, tokens, logits_rows)
        runs.append(len(fused) - before)
        return result

    monkeypatch.setattr(Eagle3BatchCache, "feed", feed)
    try:
        engine = RoundEngine(target, Eagle3Model(drafter, target), SamplingTransform(1.0), stop_ids=[])
        engine.decode([[5, 9, 30, 41], [8, 3], [12, 60, 7, 99, 14, 2]], make_policy("constant_k", 3, max_draft=3), 12,
                      [0, 1, 2], batch_size=3)
    finally:
        hook.remove()
    assert max(runs) == 1  # one `fc` a forward, never one a row
    assert fused[0] == 3 + 1 + 5 + 3  # the first catch-up: each row's prompt and first token but position 0


def test_what_the_engine_cannot_do_yet_with_an_eagle3_draft_is_refused_in_one_line(tiny_eagle):
    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.eagle3 import Eagle3Model
    from specheads.plumbing.errors import UsageError

    target, drafter = tiny_eagle
    engine = RoundEngine(target, Eagle3Model(drafter, target), SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="earns no bonus token"):
        engine.decode([PROMPT], make_policy("sprinter", 0.5), 4, [0])


@pytest.mark.parametrize("batch_size", [1, 4])
def test_eagle3_tree_drafts_sample_the_target_distribution(tiny_eagle, batch_size):
    from specheads.decoding import RoundEngine
    from specheads.decoding.eagle3 import Eagle3Model
    from specheads.decoding.tree import TreeRule, decode_tree

    target, drafter = tiny_eagle
    transform = SamplingTransform(1.0)
    engine = RoundEngine(target, Eagle3Model(drafter, target), transform, stop_ids=[])
    runs, length = 300 if batch_size == 1 else 400, LENGTH + 1  # four tokens: the second round's tree is two levels deep
    # residual p fails at p = 3e-10 and 7e-13 (each row draws alike at any B)
    results = decode_tree(engine, [PROMPT] * runs, TreeRule(values="confidence", floor=0.05, budget=4, width=2), length,
                          list(range(runs)), batch_size=batch_size)
    with torch.no_grad():
        exact = {tail: float(torch.tensor([transform.log_probs(target(torch.tensor([PROMPT + list(tail)])).logits[0])
                                           [len(PROMPT) - 1 + i, t] for i, t in enumerate(tail)]).sum().exp())
                 for tail in itertools.product(range(3), repeat=length)}
    assert chi_square_p([tuple(r.tokens) for r in results], exact) > 1e-3
    assert 0 < sum(r.accepted for r in results) < sum(r.drafted for r in results)
    assert max(len(widths) for r in results for widths in r.draft_widths_per_round) > 1  # trees deeper than one level


@pytest.mark.parametrize("pair, prompts", [("tiny_eagle", [[0, 1], [2, 0, 1, 1], [1]]),
                                           ("wide_eagle", [[5, 9, 30, 41], [8, 3], [12, 60, 7, 99, 14, 2]])])
def test_greedy_eagle3_trees_give_the_targets_greedy_tokens(pair, prompts, request):
    from specheads.decoding import RoundEngine
    from specheads.decoding.eagle3 import Eagle3Model
    from specheads.decoding.tree import TreeRule, decode_tree

    target, drafter = request.getfixturevalue(pair)
    engine = RoundEngine(target, Eagle3Model(drafter, target), SamplingTransform(0.0), stop_ids=[])
    results = decode_tree(engine, prompts, TreeRule(values="confidence", floor=0.0, budget=6, width=2), 16, [0, 1, 2],
                          batch_size=2)
    for prompt, result in zip(prompts, results):
        assert result.tokens == target_greedy(target, prompt, 16)


def test_profile_measures_an_eagle3_drafter_as_the_draft(wide_eagle, tiny_model, tmp_path):
    check_profile("--eagle3", "EAGLE-3", wide_eagle[1], tiny_model, tmp_path)


def test_a_greedy_tree_of_width_one_drafts_with_the_logits_of_the_b1_chain(tiny_eagle, monkeypatch):
    """Each tree node is read with its parent's own state, as a chain's drafted token is: the same path gives the same
    draft logits, round by round."""
    from specheads.decoding import RoundEngine
    from specheads.decoding.eagle3 import Eagle3BatchCache, Eagle3Model
    from specheads.decoding.tree import TreeRule, decode_tree

    target, drafter = tiny_eagle
    rows = drafter.d2t + torch.arange(len(drafter.d2t))
    chain, tree = [], []
    feed, feed_trees, chain_feed = Eagle3BatchCache.feed, Eagle3BatchCache.feed_trees, Eagle3Draft.feed

    def record_feed(self, tokens, logits_rows=None):
        result = feed(self, tokens, logits_rows)
        tree.append(result[0][0][-1][rows])
        return result

    def record_feed_trees(self, trees, logits_from=None):
        result = feed_trees(self, trees, logits_from)
        tree.extend(logits[rows] for logits in result[0][0])
        return result

    def record_chain(self, tokens, features, fused):
        logits, own = chain_feed(self, tokens, features, fused)
        chain.append(logits[-1])
        return logits, own

    monkeypatch.setattr(Eagle3BatchCache, "feed", record_feed)
    monkeypatch.setattr(Eagle3BatchCache, "feed_trees", record_feed_trees)
    monkeypatch.setattr(Eagle3Draft, "feed", record_chain)
    transform = SamplingTransform(0.0)
    engine = RoundEngine(target, Eagle3Model(drafter, target), transform, stop_ids=[])
    result = decode_tree(engine, [[2, 0, 1, 1]], TreeRule(values="confidence", floor=0.0, budget=3, width=1), 14, [0])[0]
    alone = eagle3_decode(target, drafter, [2, 0, 1, 1], transform, 3, 14, seed=0)
    assert result.tokens == alone.tokens and len(chain) == len(tree) > 6
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(chain, tree))


def test_eagle3_drafts_through_transformers_generate(tiny_eagle, wide_eagle):
    """`target.generate(custom_generate=speculative_generate, draft=Eagle3Model(...), tree={...})`: a confidence-valued
    tree needs no head; sampled it follows the target's distribution, greedy it is the target's own greedy output."""
    from specheads.decoding.eagle3 import Eagle3Model
    from specheads.integrations.transformers import speculative_generate

    tree = {"values": "confidence", "floor": 0.05, "budget": 4, "width": 2}
    target, drafter = tiny_eagle
    torch.manual_seed(0)
    runs = 600
    ids = torch.tensor([PROMPT] * runs)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=speculative_generate,
                          draft=Eagle3Model(drafter, target), tree=tree, do_sample=True, temperature=1.0, top_k=0,
                          top_p=1.0, max_new_tokens=LENGTH, eos_token_id=None, pad_token_id=0)
    samples = [tuple(row) for row in out[:, len(PROMPT):].tolist()]
    assert chi_square_p(samples, sequence_probabilities(target, SamplingTransform(1.0))) > 1e-3
    target, drafter = wide_eagle
    prompt = [5, 9, 30, 41]
    ids = torch.tensor([prompt])
    common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 16, "do_sample": False, "eos_token_id": None,
              "pad_token_id": 0}
    speculative = target.generate(ids, custom_generate=speculative_generate, draft=Eagle3Model(drafter, target),
                                  tree=tree, **common)
    assert torch.equal(speculative, target.generate(ids, **common))


def test_the_wall_clock_benchmark_runs_both_models_on_packed_weights_and_greedy_gives_the_targets_tokens(
        wide_eagle, tiny_model, prompts_file, tmp_path):
    """benchmarks/eagle3_decode.py at T = 0: the target alone and every rule run on prepacked linear layers
    (`specheads.pair.packed`: a verify of K + 1 tokens then costs about one target forward), and each rule's tokens
    are the target alone's on every prompt."""
    from conftest import load_benchmark

    from specheads.pair.drafters import save_drafter
    from specheads.pair.packed import packing_available

    save_drafter(wide_eagle[1], tmp_path / "drafter", dtype=torch.float32)
    bench = load_benchmark("eagle3_decode")
    args = bench.DrafterBenchmark(drafter=str(tmp_path / "drafter"), target=str(tiny_model), prompt_file=str(prompts_file),
                                  prompts=3, max_new_tokens=10, rules=["constant_k:3", "tree:0.1"], temperature=0.0,
                                  resamples=20)
    report = bench.benchmark_drafter(args, "eagle3")
    layers = wide_eagle[0].config.num_hidden_layers * 7 + 1  # q, k, v, o, gate, up, down; the LM head
    assert report["packed_layers"] == ({"target": layers, "draft": 10} if packing_available() else {"target": 0, "draft": 0})
    for rule, row in report["rules"].items():
        assert row["same_as_greedy_target"] == 1.0, rule
