"""`specheads gen` with a feature drafter as the draft (`data_gen.drafter_labels`): EAGLE-3 and DSpark drafters of
speculators' classes with random weights, for the tiny target. Every labelled position's q, p, labels, state, Markov
embedding and confidence are those of the decoding core's B = 1 draft at that position's depth, computed here from
scratch for each position (a fresh target cache over the verified prefix, a fresh drafter); the depths follow the
mix's runs; a head trains on the drafter's state with its Markov embedding; eval's offline table scores the DSpark
drafter's own confidence head beside it."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_args, vocabulary_maps
from test_eagle3_decoding import randomised

from specheads.cli import main
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

pytest.importorskip("speculators.models.dspark")

from specheads.data_gen.drafter_labels import chain_depths, chains  # noqa: E402
from specheads.dataset.store import load_labelled  # noqa: E402
from specheads.decoding.dspark import block_forward, candidate_logits, markov_inputs  # noqa: E402
from specheads.decoding.eagle3 import Eagle3Draft  # noqa: E402
from specheads.decoding.features import FeatureTarget, place_logits  # noqa: E402
from specheads.pair.drafters import draft_rows, fill_from_target, save_drafter  # noqa: E402

LAYERS = [1, 2, 3]


def saved_drafter(kind: str, target, folder, **settings):
    """A `kind` drafter of speculators' classes for `target`, with random weights, saved to `folder` (float32)."""
    d2t, t2d = vocabulary_maps(target.config.vocab_size, 2)
    if kind == "eagle3":
        from specheads.pair.eagle3 import build_drafter

        drafter = build_drafter(target.config, LAYERS, len(d2t), "tiny", ttt_steps=3)
    else:
        from specheads.pair.dspark import build_drafter

        options = {"mask_token_id": 0, "block_size": 4, "markov_rank": 8, **settings}
        drafter = build_drafter(target.config, LAYERS, len(d2t), "tiny", **options)
    fill_from_target(drafter, target, torch.tensor(d2t), torch.tensor(t2d))
    drafter = randomised(drafter, seed=3, std=0.2, also=("lm_head.weight",))
    save_drafter(drafter, folder, dtype=torch.float32)
    return folder


def drafter_args(tiny_model, prompts_file, out, kind, folder, *extra):
    """gen on the tiny target with the drafter in `folder` as the draft (no derived draft)."""
    args = [a for a in tiny_args(tiny_model, prompts_file, out) if a not in ("--draft.skip_layers", "[2]")]
    return [*args, "--drafter.kind", kind, "--drafter.path", str(folder), *extra]


@pytest.fixture(scope="module")
def labelled(tiny_model, prompts_file, tmp_path_factory):
    """A gen folder per drafter kind (two responses per prompt, mixing 0.3, EAGLE-3 chains 3 deep)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    root = tmp_path_factory.mktemp("drafter-gen")
    made = {}
    for kind, extra in (("eagle3", ["--drafter.depth", "3"]), ("dspark", [])):
        folder = saved_drafter(kind, target, root / f"{kind}-drafter")
        out = root / f"{kind}-gen"
        assert main(drafter_args(tiny_model, prompts_file, out, kind, folder, "--mixing.target_ratio", "0.3",
                                 *extra)) == 0
        made[kind] = (out, folder)
    return target, made


def reference(kind: str, target, drafter, sequence: list[int], predicted: int, depth: int, transform):
    """From scratch, what the decoding core's B = 1 draft computes for the token at `predicted` drafted `depth` deep
    (the target has read every token before the anchor, the chain reads the sequence's tokens after it): (log q over
    the target's vocabulary, the state that produced it, its Markov embedding, its confidence), and log p."""
    anchor = predicted - depth
    layer_ids = drafter.config.eagle_aux_hidden_state_layer_ids if kind == "eagle3" else drafter.config.aux_hidden_state_layer_ids
    verifier = FeatureTarget(target, layer_ids)
    verifier.feed(sequence[:anchor])
    log_p = transform.log_probs(target(torch.tensor([sequence[:predicted]])).logits[0, -1].float())
    vocabulary = target.config.vocab_size
    if kind == "eagle3":
        draft = Eagle3Draft(drafter, vocabulary)
        logits, own = draft.feed(sequence[1: anchor + 1], verifier.features[:anchor], fused=True)
        for token in sequence[anchor + 1: predicted]:
            logits, own = draft.feed([token], own[-1:], fused=False)
        log_q = draft.log_q(logits[-1], transform)
        return log_q, drafter.norm(own[-1:])[0] if not drafter.config.norm_output else own[-1], None, None, log_p
    block = block_forward(drafter, verifier.features, sequence[anchor])
    previous = sequence[anchor:predicted]
    logits, score = candidate_logits(drafter, block, previous)
    log_q = transform.log_probs(place_logits(logits, draft_rows(drafter), vocabulary))
    slot = len(markov_inputs(drafter.config, previous)) - 1
    markov = drafter.markov_head.markov_w1.weight[previous[-1]]
    return log_q, block.hidden[slot], markov, score, log_p


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_gen_labels_every_position_as_the_drafter_drafts_it_at_its_depth(labelled, kind):
    from specheads.pair.dspark import load_drafter as load_dspark
    from specheads.pair.eagle3 import load_drafter as load_eagle3

    target, made = labelled
    out, folder = made[kind]
    drafter = (load_eagle3 if kind == "eagle3" else load_dspark)(folder, target)
    rows = load_labelled(out).with_format("numpy")
    manifest = json.loads((out / "manifest.json").read_text())
    identity = manifest["identity"]["draft"]
    depth = 3 if kind == "eagle3" else 4
    assert identity["kind"] == kind and identity["depth"] == depth and len(identity["weights_sha256"]) == 16
    assert manifest["draft_name"] == f"{'EAGLE-3' if kind == 'eagle3' else 'DSpark'} {folder}"
    assert ("drafter_score" in rows.column_names) == ("markov_features" in rows.column_names) == (kind == "dspark")
    transform = SamplingTransform(1.0)
    checked = set()
    for row in rows.select(range(4)):
        prompt, response = row["prompt_ids"].tolist(), row["target_ids"].tolist()
        is_draft = row["is_draft"].tolist()
        assert row["depth"].tolist() == chain_depths(is_draft, depth)[: len(response)]
        assert row["features"].shape == (len(response) + 1, target.config.hidden_size)
        sequence = prompt + response
        for j, d in enumerate(row["depth"].tolist()):
            log_q, state, markov, score, log_p = reference(kind, target, drafter, sequence, len(prompt) + j, d, transform)
            candidate = int(row["draft_ids"][j])
            assert row["logq"][j] == pytest.approx(float(log_q[candidate]), abs=1e-4)
            assert row["logp"][j] == pytest.approx(float(log_p[candidate]), abs=1e-4)
            assert row["accept"][j] == pytest.approx(min(1.0, math.exp(log_p[candidate] - log_q[candidate])), abs=1e-4)
            assert row["beta"][j] == pytest.approx(float(torch.minimum(log_p, log_q).exp().sum()), abs=1e-4)
            assert torch.allclose(torch.from_numpy(row["features"][j].astype("float32")), state.float(), atol=2e-3)
            if kind == "dspark":
                assert row["drafter_score"][j] == pytest.approx(score, abs=1e-5)
                assert torch.allclose(torch.from_numpy(row["markov_features"][j].astype("float32")), markov, atol=1e-3)
            checked.add(d)
    assert checked == set(range(1, depth + 1))  # every depth of a round was checked


def test_gen_labels_a_trees_second_child_with_an_eagle3_drafter_from_the_state_its_first_shares(
        labelled, tiny_model, prompts_file, tmp_path):
    """`--sibling-labels true` with an EAGLE-3 drafter: each position's second child x₂ is drawn from the same q
    without the drafted candidate and labelled min(1, p₂(x₂)/q₂(x₂)), p₂ = norm(max(0, p − q)), from its own stream:
    every other column is the data's without it."""
    target, made = labelled
    plain, folder = made["eagle3"]
    out = tmp_path / "siblings"
    assert main(drafter_args(tiny_model, prompts_file, out, "eagle3", folder, "--mixing.target_ratio", "0.3",
                             "--drafter.depth", "3", "--sibling-labels", "true")) == 0
    from specheads.pair.eagle3 import load_drafter

    drafter = load_drafter(folder, target)
    rows, before = load_labelled(out).with_format("numpy"), load_labelled(plain).with_format("numpy")
    transform, seconds = SamplingTransform(1.0), 0
    for row, old in zip(rows.select(range(3)), before.select(range(3))):
        for name in ("draft_ids", "accept", "logq", "depth", "features"):
            assert (row[name] == old[name]).all(), name
        sequence = row["prompt_ids"].tolist() + row["target_ids"].tolist()
        for j, d in enumerate(row["depth"].tolist()):
            log_q, _, _, _, log_p = reference("eagle3", target, drafter, sequence, len(row["prompt_ids"]) + j, d,
                                              transform)
            second, first = int(row["sibling_ids"][j]), int(row["draft_ids"][j])
            if second < 0:
                continue
            q, p = log_q.exp(), log_p.exp()
            q_rest = q.clone()
            q_rest[first] = 0
            p_rest = (p - q).clamp(min=0)
            expected = min(1.0, float(p_rest[second] / p_rest.sum()) / float(q_rest[second] / q_rest.sum()))
            assert second != first and q[second] > 0
            assert row["sibling_accept"][j] == pytest.approx(expected, abs=1e-4)
            assert row["sibling_logq"][j] == pytest.approx(float(log_q[second]), abs=1e-4)
            seconds += 1
    assert seconds > 10


def test_depths_follow_the_mixs_runs_and_start_a_round_after_k_max():
    is_draft = [True, True, False, True, True, True, True, False]
    assert chain_depths(is_draft, 3) == [1, 2, 3, 1, 2, 3, 1, 2, 1]
    assert chains([1, 2, 3, 1, 2, 3, 1, 2, 1]) == [(0, 3), (3, 3), (6, 2), (8, 1)]


def test_the_data_card_says_how_the_depths_were_chosen_and_a_rerun_has_nothing_to_label(labelled, tiny_model,
                                                                                         prompts_file, capsys):
    _, made = labelled
    out, folder = made["dspark"]
    card = (out / "README.md").read_text()
    assert "## Depth: chains of a feature drafter" in card and "`drafter_score`" in card and "`markov_features`" in card
    capsys.readouterr()
    assert main(drafter_args(tiny_model, prompts_file, out, "dspark", folder, "--mixing.target_ratio", "0.3")) == 0
    assert "nothing new to label" in capsys.readouterr().out


def test_a_drafter_of_another_kind_or_target_is_refused_in_one_line_before_anything_is_written(
        labelled, tiny_model, prompts_file, tmp_path, capsys):
    _, made = labelled
    _, eagle = made["eagle3"]
    assert main(drafter_args(tiny_model, prompts_file, tmp_path / "a", "dspark", eagle)) == 2
    error = capsys.readouterr().err.strip()
    assert "holds a 'eagle3' drafter" in error and "--drafter.kind eagle3" in error and len(error.splitlines()) == 1
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    config.hidden_size = 48
    folder = saved_drafter("dspark", LlamaForCausalLM(config), tmp_path / "wide-drafter")
    capsys.readouterr()
    assert main(drafter_args(tiny_model, prompts_file, tmp_path / "b", "dspark", folder)) == 2
    error = capsys.readouterr().err.strip()
    assert "made for another target: hidden size 48 (the target's: 32)" in error and len(error.splitlines()) == 1
    assert main(drafter_args(tiny_model, prompts_file, tmp_path / "c", "eagle3", eagle, "--draft.skip_layers", "[2]")) == 2
    assert "--draft cannot go with --drafter" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")


# ---- our heads on the drafter's state, and the DSpark drafter's own head as a baseline offline

CONFIGS = Path(__file__).parents[1] / "configs" / "train"


def train_args(config: str, data, root, *extra: str) -> list[str]:
    """`specheads train fit` of a recipe on the tiny data, two epochs (prompts: 30 % held out, 30 % calibrate)."""
    return ["train", "fit", "--config", str(CONFIGS / config), "--data.path", str(data), "--data.val_fraction", "0.3",
            "--data.calibration_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "2", *extra]


@pytest.fixture(scope="module")
def dspark_head(labelled, tmp_path_factory):
    """configs/train/drafter-dspark-confidence.yaml trained on the DSpark drafter's data."""
    root = tmp_path_factory.mktemp("dspark-head")
    assert main(train_args("drafter-dspark-confidence.yaml", labelled[1]["dspark"][0], root)) == 0
    return root / "checkpoints" / "last.ckpt"


def test_the_dspark_confidence_recipe_reads_the_drafters_state_and_markov_embedding(dspark_head, labelled):
    from specheads.artifacts.checkpoint import load_trained
    from specheads.dataset.datamodule import AcceptanceDataModule
    from specheads.dataset.targets import head_inputs, markov_argument

    trained = load_trained(str(dspark_head))
    head = trained.head
    assert head.markov_rank == 8 and head.input_size == 32 + 8  # markov_rank null took the data's rank
    data = AcceptanceDataModule(str(labelled[1]["dspark"][0]), val_fraction=0.3)
    data.setup()
    data.with_markov = True
    batch = next(iter(data.ordered_batches("val", with_features=True)))
    hidden, _, _, _, mask = head_inputs(batch, batch["features"], "context_state", "expect", [])
    markov = markov_argument(batch, mask, "context_state", head)["markov_embedding"]
    weight, bias = head.engine_linear()  # what an engine runs: one affine map of [state ; markov_w1[previous]]
    expected = torch.cat([hidden.double(), markov.double()], -1) @ weight + bias
    assert torch.allclose(head(hidden, markov_embedding=markov).double() + head.logit_correction.double(), expected,
                          atol=1e-4)
    assert markov.abs().sum() > 0 and not torch.allclose(head(hidden, markov_embedding=markov),
                                                         head(hidden, markov_embedding=torch.zeros_like(markov)))


def test_eval_scores_the_dspark_drafters_own_confidence_head_on_the_same_tokens(dspark_head, labelled, tmp_path):
    from specheads.artifacts.checkpoint import load_trained
    from specheads.artifacts.metrics import soft_auc
    from specheads.dataset.prompts import prompt_digest

    out = labelled[1]["dspark"][0]
    assert main(["eval", "--head", str(dspark_head), "--data", str(out), "--out", str(tmp_path / "eval"),
                 "--num-decode-prompts", "0", "--max-draft", "4", "--bootstrap", "10", "--progress", "false"]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    offline = metrics["offline"]
    used = load_trained(str(dspark_head)).used_prompts
    held = [row for row in load_labelled(out).with_format("numpy") if prompt_digest(row["prompt_ids"]) not in used]
    label = np.concatenate([row["accept"][row["is_draft"]] for row in held])
    score = np.concatenate([row["drafter_score"][row["is_draft"]] for row in held])
    assert offline["dspark_confidence"]["auc"] == pytest.approx(soft_auc(label, score), abs=1e-9)  # the same tokens
    for name in ("dspark_confidence", "dspark_confidence_ts"):
        assert all(offline[name][metric] is not None for metric in ("auc", "binary_kl", "ece"))
    temperatures = metrics["data"]["dspark_temperatures"]
    assert len(temperatures["temperatures"]) == 4 and "calibration prompts" in temperatures["how"]
    stages = {(row["stage"], row["k"]) for row in metrics["cumulative"]}
    assert {("dspark_confidence", 1), ("dspark_confidence_ts", 1), ("dspark_confidence", 2)} <= stages
    assert metrics["offline_comparison"]["dspark_confidence"]["baseline"] == "dspark_confidence"
    assert "Beside the DSpark drafter's own confidence head" in (tmp_path / "eval" / "report.md").read_text()


@pytest.fixture(scope="module")
def eagle3_head(labelled, tmp_path_factory):
    """configs/train/drafter-ontime.yaml trained on the EAGLE-3 drafter's data, calibrated at depths 1..3."""
    root = tmp_path_factory.mktemp("eagle3-head")
    assert main(train_args("drafter-ontime.yaml", labelled[1]["eagle3"][0], root, "--model.calibrate_positions", "3")) == 0
    return root / "checkpoints" / "last.ckpt"


def test_eval_decodes_our_head_beside_the_drafters_own_with_the_drafter_that_labelled_the_data(dspark_head, labelled,
                                                                                                 tmp_path, capsys):
    """With --dspark naming the drafter that labelled the data, the head read that drafter's state: its stop rule
    decodes beside the drafter's own (`dspark_confidence`, raw and through its fitted temperatures, paired intervals)
    and the serving table plans with it (`goodput`) beside `dspark_adaptive` (and `_ts`); without --dspark, decoding
    the drafter's data is refused in one line."""
    from test_eval import eval_args

    out, folder = labelled[1]["dspark"]
    report = tmp_path / "with"
    assert main(eval_args(dspark_head, out, report, "--dspark", str(folder), "--serving-batch-sizes", "[2]", "--test-samples", "2",
                          "--serving-batch-policies", "[goodput]", "--serving-costs", "h100-llama3.1-8b-llama3.2-1b")) == 0
    decoding = json.loads((report / "metrics.json").read_text())["decoding"]
    assert decoding["head_left_out"] is None
    assert {"head", "dspark_confidence", "constant_k"} <= {row["policy"] for row in decoding["policies"]}
    assert "dspark_confidence" in decoding["gain_intervals"]  # None here: one test prompt group to resample
    assert {"goodput", "dspark_adaptive", "dspark_adaptive_ts"} <= {row["policy"] for row in decoding["serving"]["rows"]}
    # the drafter's confidence through the temperatures fitted on the head's calibration prompts decodes beside it
    assert "dspark_confidence_ts" in {row["policy"] for row in decoding["policies"]}
    assert "dspark_confidence_ts" in decoding["gain_intervals"]
    assert "the DSpark drafter's own confidence head at its best p_min" in (report / "report.md").read_text()
    capsys.readouterr()
    assert main(eval_args(dspark_head, out, tmp_path / "without")) == 2  # its decoding runs draft with the drafter
    error = capsys.readouterr().err.strip()
    assert f"give --dspark {folder}, or --num-decode-prompts 0" in error and "\n" not in error
    assert not (tmp_path / "without").exists()


def test_the_ontime_recipe_trains_on_eagle3_data_and_calibrates_rounds_by_depth(labelled, eagle3_head, tmp_path, capsys):
    from specheads.artifacts.checkpoint import load_trained

    data = labelled[1]["eagle3"][0]
    assert load_trained(str(eagle3_head)).head.calibration.positions == 3
    capsys.readouterr()
    assert main(train_args("specdecpp.yaml", data, tmp_path / "resnet")) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "labelled with a feature drafter (eagle3)" in error and "candidate_state" in error


def test_a_round_of_a_feature_drafter_starts_at_depth_one():
    from specheads.heads.calibration import round_windows

    row, position = np.zeros(6, dtype=int), np.arange(6)
    depth = np.array([2, 3, 1, 2, 3, 1])  # the first two tokens end a round that began before them
    assert round_windows(row, position, 2)[1].tolist() == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]
    assert round_windows(row, position, 3, depth)[1].tolist() == [[2, 3]]
    assert round_windows(row, position, 3, depth)[2].tolist() == [[2, 3, 4]]


def test_the_wall_clock_benchmark_decodes_a_heads_stop_rule_with_the_drafter_that_labelled_its_data(
        labelled, eagle3_head, dspark_head, tiny_model, prompts_file, tmp_path, capsys):
    """benchmarks/eagle3_decode.py `head:h` (`specheads.eval.wall_clock`): the on-time head trained on the EAGLE-3
    drafter's data decides each round's length (h = 0 stops after the first candidate, h = 1 never), its forwards
    timed as they run; a rule reading a head without --head, or a head another draft's data trained, is refused in
    one line before any model loads."""
    from conftest import load_benchmark

    folder = labelled[1]["eagle3"][1]
    bench = load_benchmark("eagle3_decode")
    args = bench.DrafterBenchmark(drafter=str(folder), target=str(tiny_model), prompt_file=str(prompts_file), prompts=3,
                                  max_new_tokens=8, rules=["head:0.0", "head:1.0", "constant_k:3"], max_draft=3,
                                  resamples=20, head=str(eagle3_head))
    rules = bench.benchmark_drafter(args, "eagle3")["rules"]
    never = {key: rules["head:1.0"][key] for key in ("tokens_per_target_call", "draft_forwards_per_target_call",
                                                     "acceptance_per_position")}
    assert never == {key: rules["constant_k:3"][key] for key in never}  # the same seeds, rounds 3 deep
    first = rules["head:0.0"]
    assert len(first["acceptance_per_position"]) == 1 and len(never["acceptance_per_position"]) > 1
    # one candidate a round: one drafter forward and one head forward
    assert first["head_forwards_per_target_call"] == first["draft_forwards_per_target_call"] > 0
    for rule in ("head:0.0", "head:1.0"):
        assert rules[rule]["head_seconds"] > 0 and rules[rule]["timed_head_cost_ratio"] > 0
    assert "head_seconds" not in rules["constant_k:3"]
    assert rules["constant_k:3"]["per_prompt"].keys() == {0, 1, 2}
    alone = bench.benchmark_drafter(bench.DrafterBenchmark(**{**vars(args), "rules": ["head_cost:0.5"]}), "eagle3")
    assert alone["rules"]["head_cost:0.5"]["head_seconds"] > 0  # the rule read from the costs loads the head too
    capsys.readouterr()
    missing = str(tmp_path / "no-target")  # refused before the target is looked for
    scaled = bench.DrafterBenchmark(drafter=str(folder), target=missing, rules=["dspark_confidence_ts:0.5"])
    with pytest.raises(UsageError, match="does not fit"):  # its temperatures are fitted by eval, not here
        bench.benchmark_drafter(scaled, "eagle3")
    for head, fix in ((None, "give --head CHECKPOINT"), (str(dspark_head), "whose state its rule would read")):
        refused = bench.DrafterBenchmark(drafter=str(folder), target=missing, rules=["head:0.5"], head=head)
        with pytest.raises(UsageError, match=fix) as raised:
            bench.benchmark_drafter(refused, "eagle3")
        assert "\n" not in str(raised.value)


def test_the_demo_refuses_an_eagle3_line_it_could_not_decode_before_any_stage(labelled, eagle3_head, dspark_head,
                                                                               tmp_path, tiny_model, monkeypatch):
    """`specheads demo --eagle3 DIR [--eagle3-head CKPT]` checks before gen starts: the folder holds an EAGLE-3 drafter
    (made for the demo's target: the tiny one here, whose drafters these are), the head trained on data that drafter
    labelled, and --eagle3-head comes with --eagle3; each refusal is one line and the demo folder is not made."""
    from specheads.demo import eagle3 as demo_eagle3
    from specheads.demo.config import DemoConfig
    from specheads.demo.eagle3 import check_eagle3

    monkeypatch.setattr(demo_eagle3, "DEMO_TARGET", str(tiny_model))

    eagle3_folder, dspark_folder = labelled[1]["eagle3"][1], labelled[1]["dspark"][1]
    check_eagle3(DemoConfig(eagle3=str(eagle3_folder), eagle3_head=str(eagle3_head)))  # a line it can decode
    out = tmp_path / "demo"
    for flags, fix in ((["--eagle3", str(dspark_folder)], "not 'eagle3'"),
                       (["--eagle3", str(tmp_path)], "is not a drafter folder"),
                       (["--eagle3", str(eagle3_folder), "--eagle3-head", str(dspark_head)], "whose state its rule would read"),
                       (["--eagle3-head", str(eagle3_head)], "give --eagle3 DIR too")):
        with pytest.raises(UsageError, match=fix) as refused:
            check_eagle3(DemoConfig(**{flag.lstrip("-").replace("-", "_"): value
                                       for flag, value in zip(flags[::2], flags[1::2])}))
        assert "\n" not in str(refused.value)
        assert main(["demo", "--out", str(out), *flags]) == 2 and not out.exists()


def test_eval_decodes_the_heads_rules_with_the_eagle3_drafter_that_labelled_its_data(labelled, eagle3_head, tmp_path,
                                                                                     capsys):
    """With --eagle3 naming the drafter that labelled the data, the head read that drafter's state: its stop rule
    decodes beside the free rules with paired intervals, its forward counted against the drafter's weights (not the
    data's config's unused draft), and an expected-acceptance head trained on the same data plans the serving table's
    goodput planner (`--budget-head`); decoding the drafter's data without --eagle3 is refused in one line."""
    from test_eval import eval_args

    from specheads.artifacts.checkpoint import load_trained
    from specheads.decoding.companion import head_forward_cost
    from specheads.decoding.drafters import load_feature_draft

    target, made = labelled
    data, folder = made["eagle3"]
    assert main(train_args("expected-acceptance.yaml", data, tmp_path / "expected")) == 0
    report = tmp_path / "with"
    assert main(eval_args(eagle3_head, data, report, "--eagle3", str(folder), "--serving-batch-sizes", "[2]",
                          "--test-samples", "2", "--serving-batch-policies", "[goodput]", "--serving-costs",
                          "h100-llama3.1-8b-llama3.2-1b", "--budget-head",
                          str(tmp_path / "expected" / "checkpoints" / "last.ckpt"))) == 0
    decoding = json.loads((report / "metrics.json").read_text())["decoding"]
    assert decoding["head_left_out"] is None
    assert {"head", "head_cost", "confidence", "svip", "constant_k"} <= {row["policy"] for row in decoding["policies"]}
    assert "goodput" in {row["policy"] for row in decoding["serving"]["rows"]}
    assert "budget" not in decoding["serving"].get("left_out", {})
    # an expected-acceptance head of another drafter's data cannot plan these rounds: refused before any model loads
    assert main(train_args("expected-acceptance.yaml", made["dspark"][0], tmp_path / "other")) == 0
    capsys.readouterr()
    assert main(eval_args(eagle3_head, data, tmp_path / "other-report", "--eagle3", str(folder), "--serving-batch-sizes",
                          "[2]", "--test-samples", "2", "--budget-head",
                          str(tmp_path / "other" / "checkpoints" / "last.ckpt"))) == 2
    error = capsys.readouterr().err.strip()
    assert "it read the state of DSpark" in error and "not of the EAGLE-3 drafter" in error and "\n" not in error
    assert not (tmp_path / "other-report").exists()
    assert {"confidence", "svip", "constant_k"} <= set(decoding["gain_intervals"])
    drafter = load_feature_draft("eagle3", folder, target)
    assert decoding["head_forward_cost"] == pytest.approx(head_forward_cost(load_trained(str(eagle3_head)).head, drafter))
    capsys.readouterr()
    assert main(eval_args(eagle3_head, data, tmp_path / "without")) == 2
    error = capsys.readouterr().err.strip()
    assert f"give --eagle3 {folder}, or --num-decode-prompts 0" in error and "\n" not in error
    assert not (tmp_path / "without").exists()
