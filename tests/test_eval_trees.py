"""Tree drafts as decoding policies of `specheads eval`: decoded on the tiny pair beside the chains, tuned on dev prompts
only, compared with the chain on test prompts, carried into the report, the card and through a resumed eval."""

import json
from pathlib import Path

import pytest

import specheads.eval.sweep as sweep
from specheads.artifacts.checkpoint import load_trained
from specheads.artifacts.report_file import read_report
from specheads.cli import main
from specheads.decoding import RoundEngine
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.eval.config import EvalConfig
from specheads.eval.journal import JOURNAL_FILE, read_journal
from specheads.eval.sweep import RunRecord, TreePolicy, tree_policy, tree_section

CONFIGS = Path(__file__).parents[1] / "configs" / "train"
DECODE_RUNS = sweep.decode_runs
TREES = {"tree_head_n3", "tree_confidence_n3", "tree_head_cost_n3", "tree_confidence_cost_n3"}


PROMPTS = ["Plan a picnic for four friends.", "List two prime numbers above ten.", "Describe a quiet morning.",
           "Write a haiku about rain.", "Explain what a compiler does.", "Name a planet with rings."]


def tree_args(head: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Six prompts the head never saw (three dev, three test; `decode_prompts` writes them beside `data`), the chains
    on small grids and the trees at N = 3 on two floors."""
    return ["eval", "--head", str(head), "--data", str(data), "--out", str(out), "--decode-prompts",
            str(decode_prompts(data)), "--num-decode-prompts", "6",
            "--max-new-tokens", "6", "--max-draft", "3", "--constant-ks", "[1,3]", "--head-thresholds", "[0.5]",
            "--decode-batch-size", "2", "--bootstrap", "20", "--progress", "false", "--tree-budgets", "[3]",
            "--tree-floors", "[0.05,0.5]", *extra]


def decode_prompts(data: Path) -> Path:
    """The JSONL of PROMPTS, beside the data folder."""
    path = data.parent / "tree-prompts.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"id": f"new{i}", "prompt": text}) + "\n" for i, text in enumerate(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def on_time(trained, tmp_path_factory):
    """An on-time head (it scores a child from its parent's state: it can value a tree), calibrated per position."""
    data, _ = trained
    root = tmp_path_factory.mktemp("ontime-trees")
    assert main(["train", "fit", "--config", str(CONFIGS / "specdecpp-ontime.yaml"), "--data.path", str(data),
                 "--data.val_fraction", "0.3", "--data.calibration_fraction", "0.3", "--data.batch_size", "4",
                 "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
                 "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1",
                 "--model.calibrate_positions", "3"]) == 0
    return data, root / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def tree_eval(on_time, tmp_path_factory):
    """One eval of the on-time head with trees: (data, head, report folder)."""
    data, head = on_time
    out = tmp_path_factory.mktemp("tree-eval") / "report"
    assert main(tree_args(head, data, out)) == 0
    return data, head, out


def runs_of(out: Path) -> list[dict]:
    return json.loads((out / "runs.json").read_text())["runs"]


def test_tree_policy_names_carry_values_budget_and_growth():
    for tree in (TreePolicy("head", 8, False), TreePolicy("confidence", 16, True)):
        assert tree_policy(tree.name) == tree
    assert TreePolicy("head", 8, True).rule(0.2) == TreeRule("head", 0.0, 8, 4, 4, cost_ratio=0.2)
    assert TreePolicy("confidence", 4, False).rule(0.1) == TreeRule("confidence", 0.1, 4, 4, 4)
    assert [tree_policy(name) for name in ("head", "head_cost", "tree_head", "tree_head_n0", "tree_eagle_n8")] == [None] * 5


def record(policy: str, threshold: float, prompt: str, split: str, emitted: int, forwards: int, calls: int) -> RunRecord:
    return RunRecord(policy, threshold, prompt, split, emitted=emitted, drafted=forwards, accepted=emitted - calls,
                     target_calls=calls, draft_forwards=forwards, seconds=1.0, forward_seconds=1.0,
                     accepted_per_round=[1] * calls, target_logprob=float("nan"))


def test_tree_floors_are_tuned_on_dev_prompts_only_and_compared_with_the_chain_on_test_prompts():
    """On dev prompts floor 0.1 is faster, on test prompts 0.3: the tuned floor is 0.1 and the test rows report it."""
    runs = []
    for number in range(6):
        split = "dev" if number % 2 == 0 else "test"
        fast, slow = (0.1, 0.3) if split == "dev" else (0.3, 0.1)
        prompt = f"p{number}"
        runs += [record("tree_head_n8", fast, prompt, split, 20, 10, 5), record("tree_head_n8", slow, prompt, split, 20, 30, 10),
                 record("tree_confidence_n8", 0.2, prompt, split, 20, 20, 8),
                 record("tree_head_cost_n8", 0.2, prompt, split, 20, 12, 6),
                 record("head", 0.5, prompt, split, 20, 25, 10), record("constant_k", 3.0, prompt, split, 20, 30, 10)]
    trees = tree_section(runs, [8], {"head": 0.5, "constant_k": 3.0}, 0.2, None, resamples=50)
    assert trees["tuned_floors"] == {"tree_head_n8": 0.1, "tree_confidence_n8": 0.2, "tree_head_cost_n8": 0.2}
    tuned = {(row["policy"], row["threshold"]) for row in trees["policies"] if row["tuned"]}
    assert tuned == {("tree_head_n8", 0.1), ("tree_confidence_n8", 0.2), ("tree_head_cost_n8", 0.2)}
    assert all(row["prompts"] == 3 for row in (*trees["policies"], *trees["dev_policies"]))
    assert trees["tuned_at_grid_edge"] == {"tree_head_n8": "lowest"}
    gains = {(g["policy"], g["against"]): g for g in trees["gains"]}
    # on the test prompts the tuned floor 0.1 emits 60 tokens for 90 draft forwards and 30 calls; the chain's head rule
    # 60 for 75 and 30
    assert gains[("tree_head_n8", "head")]["speedup_gain"] == pytest.approx((60 / (0.2 * 90 + 30)) / (60 / (0.2 * 75 + 30)) - 1)
    assert gains[("tree_head_n8", "head")]["speedup_gain_ci"] == pytest.approx([gains[("tree_head_n8", "head")]["speedup_gain"]] * 2)
    assert set(gains) == {(tree, chain) for tree in ("tree_head_n8", "tree_confidence_n8", "tree_head_cost_n8")
                          for chain in ("head", "constant_k")} | {("tree_head_n8", "tree_confidence_n8")}
    # given floors (--tuned-from, --fixed-thresholds) are decoded as given: nothing is tuned on dev
    given = tree_section(runs, [8], {"head": 0.5}, 0.2, None, given={"tree_head": 0.3, "tree_confidence_n8": 0.2},
                         resamples=10)
    assert given["tuned_floors"]["tree_head_n8"] == 0.3 and given["tuned_at_grid_edge"] == {} and given["floors"] is None


def test_eval_decodes_the_trees_tunes_their_floors_on_dev_and_compares_them_with_the_chain(tree_eval):
    data, head, out = tree_eval
    metrics = json.loads((out / "metrics.json").read_text())
    decoding, trees = metrics["decoding"], metrics["decoding"]["trees"]
    assert not {row["policy"] for row in decoding["policies"]} & TREES  # the chain's table is the chain's
    runs = runs_of(out)
    prompts = {run["prompt_id"] for run in runs}
    decoded = {(run["policy"], run["threshold"]) for run in runs if run["policy"] in TREES}
    assert decoded == {(f"tree_{values}_n3", floor) for values in ("head", "confidence") for floor in (0.05, 0.5)} | {
        ("tree_head_cost_n3", 0.2), ("tree_confidence_cost_n3", 0.2)}
    for setting in decoded:  # every tree on every prompt, dev and test, each a real decode
        tree_runs = [run for run in runs if (run["policy"], run["threshold"]) == setting]
        assert {run["prompt_id"] for run in tree_runs} == prompts and {run["split"] for run in tree_runs} == {"dev", "test"}
        assert all(run["target_calls"] > 0 and run["draft_forwards"] > 0 and run["emitted"] > 0 for run in tree_runs)
    # the floors were tuned on the dev runs alone: the dev row of highest modelled speedup, per tree
    for policy in ("tree_head_n3", "tree_confidence_n3"):
        dev_rows = [row for row in trees["dev_policies"] if row["policy"] == policy]
        assert {row["prompts"] for row in dev_rows} == {decoding["prompts"]["dev"]}
        assert trees["tuned_floors"][policy] == max(dev_rows, key=lambda row: row["modelled_speedup"])["threshold"]
        for row in dev_rows:
            dev_runs = [r for r in runs if (r["policy"], r["threshold"], r["split"]) == (policy, row["threshold"], "dev")]
            emitted, forwards, calls = (sum(r[key] for r in dev_runs) for key in ("emitted", "draft_forwards", "target_calls"))
            forwards += sum(r["head_forwards"] for r in dev_runs)  # a head-valued tree pays a head forward per node
            assert (sum(r["head_scored"] for r in dev_runs) > 0) == (policy == "tree_head_n3")
            assert row["modelled_speedup"] == pytest.approx(emitted / (0.2 * forwards + calls))
    assert trees["tuned_floors"]["tree_head_cost_n3"] == trees["tuned_floors"]["tree_confidence_cost_n3"] == 0.2
    tuned_rows = {row["policy"]: row for row in trees["policies"] if row["tuned"]}
    assert set(tuned_rows) == TREES and all(row["prompts"] == decoding["prompts"]["test"] for row in tuned_rows.values())
    chain = decoding["tuned_thresholds"]
    gains = {(g["policy"], g["against"]): g for g in trees["gains"]}
    assert set(gains) == {(tree, against) for tree in TREES for against in ("head", "constant_k")} | {
        ("tree_head_n3", "tree_confidence_n3"), ("tree_head_cost_n3", "tree_confidence_cost_n3")}
    chain_rows = {row["policy"]: row for row in decoding["policies"] if row.get("tuned")}
    for (policy, against), gain in gains.items():
        theirs = chain_rows[against] if against in chain_rows else tuned_rows[against]
        assert gain["against_threshold"] == (chain[against] if against in chain else trees["tuned_floors"][against])
        assert gain["speedup_gain"] == pytest.approx(tuned_rows[policy]["modelled_speedup"] / theirs["modelled_speedup"] - 1)
        low, high = gain["speedup_gain_ci"]
        assert low <= gain["speedup_gain"] <= high
    text = (out / "report.md").read_text()
    assert "## Tree drafts (test prompts)" in text and "| 3 | head values | floor" in text
    assert "tree_head_n3 | head @" in text and "a draft forward over a tree's nodes counts as one" in text
    report = read_report(out)  # the typed report reads the section back, and its headline names the best tree
    assert report.as_dict() == metrics
    best = max(tuned_rows.values(), key=lambda row: row["modelled_speedup"])
    headline = report.headline()["tree_drafts"]
    assert headline["policy"] == best["policy"] and headline["modelled_speedup"] == best["modelled_speedup"]
    assert headline["gain"] == gains[(best["policy"], "head")]["speedup_gain"]


def test_the_tree_runs_are_what_decode_tree_decodes_with_one_forward_per_tree(tree_eval):
    """Each prompt's run of the tuned head-valued tree equals decode_tree at that floor, N and seed on the same pair:
    the counts (one draft forward per tree forward) and the tokens are decode_tree's own."""
    from specheads.dataset.store import read_manifest
    from specheads.eval.run import held_out_data, held_out_prompts
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, context_length, load_pair, stop_token_ids

    data, head, out = tree_eval
    manifest = read_manifest(data)
    trained = load_trained(str(head))
    config = EvalConfig(head=str(head), data=str(data), decode_prompts=str(decode_prompts(data)), num_decode_prompts=6,
                        max_new_tokens=6)
    pair = load_pair(ModelSpec(**manifest["config"]["target"]), ModelSpec(**manifest["config"]["draft"]))
    _, trained_on = held_out_data(config, trained, manifest)
    prompts, _ = held_out_prompts(config, manifest, trained_on, pair.tokenizer,
                                  min(context_length(pair.target), context_length(pair.draft)))
    engine = RoundEngine(pair.target, pair.draft, SamplingTransform(**{k: manifest["identity"]["sampling"][k]
                                                                       for k in ("temperature", "top_k", "top_p")}),
                         stop_token_ids(pair.target, pair.tokenizer))
    floor = json.loads((out / "metrics.json").read_text())["decoding"]["trees"]["tuned_floors"]["tree_head_n3"]
    results = decode_tree(engine, [list(p.ids) for p in prompts], TreeRule("head", floor, 3, 4, 4), 6,
                          list(range(len(prompts))), trained.head.eval())
    runs = {run["prompt_id"]: run for run in runs_of(out) if (run["policy"], run["threshold"]) == ("tree_head_n3", floor)}
    for prompt, result in zip(prompts, results):
        run = runs[prompt.prompt_id]
        assert (run["emitted"], run["drafted"], run["accepted"], run["target_calls"], run["draft_forwards"]) == (
            result.emitted, result.drafted, result.accepted, result.target_calls, result.draft_forwards)
        assert run["accepted_per_round"] == result.accepted_per_round
        assert result.draft_forwards <= result.target_calls * 3  # a round reads the context and at most N - 1 levels


def test_an_interrupted_eval_with_trees_resumes_to_the_same_runs(tree_eval, tmp_path, monkeypatch, capsys):
    data, head, whole = tree_eval
    out = tmp_path / "resumed"
    calls = []

    def killed(engine, setting, prompts, *args):
        if setting.policy in TREES and len([c for c in calls if c in TREES]) == 3:
            raise KeyboardInterrupt  # in the middle of the trees: two tree batches finished
        calls.append(setting.policy)
        return DECODE_RUNS(engine, setting, prompts, *args)

    monkeypatch.setattr(sweep, "decode_runs", killed)
    assert main(tree_args(head, data, out)) == 130
    journalled = {row["policy"] for batch in read_journal(out / JOURNAL_FILE)[1] for row in batch}
    assert journalled & TREES
    again = []

    def counting(engine, setting, prompts, *args):
        again.append(setting.policy)
        return DECODE_RUNS(engine, setting, prompts, *args)

    monkeypatch.setattr(sweep, "decode_runs", counting)
    assert main(tree_args(head, data, out)) == 0
    assert "resuming:" in capsys.readouterr().out
    assert len([p for p in again if p in TREES]) < len([r for r in runs_of(whole) if r["policy"] in TREES]) // 2

    def without_times(runs: list[dict]) -> list[dict]:
        return sorted(({k: v for k, v in run.items() if not k.endswith("seconds")} for run in runs),
                      key=lambda run: (run["policy"], run["threshold"], run["prompt_id"]))

    resumed, uninterrupted = runs_of(out), runs_of(whole)
    assert without_times(resumed) == without_times(uninterrupted)
    trees = json.loads((out / "metrics.json").read_text())["decoding"]["trees"]
    assert trees["tuned_floors"] == json.loads((whole / "metrics.json").read_text())["decoding"]["trees"]["tuned_floors"]


def test_tuned_floors_are_confirmed_on_fresh_prompts_and_given_ones_decoded_as_given(tree_eval, trained, tmp_path, capsys):
    data, head, tuning = tree_eval
    earlier = json.loads((tuning / "metrics.json").read_text())["decoding"]["trees"]["tuned_floors"]
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_text("".join(json.dumps({"id": f"fresh{i}", "prompt": text}) + "\n"
                             for i, text in enumerate(["Draft a note to the team.", "Name three colours.", "Add 7 and 5."])))
    confirm = ["eval", "--head", str(head), "--data", str(data), "--out", str(tmp_path / "confirm"), "--decode-prompts",
               str(fresh), "--num-decode-prompts", "3", "--max-new-tokens", "6", "--max-draft", "3", "--bootstrap", "20",
               "--progress", "false", "--tuned-from", str(tuning), "--tree-budgets", "[3]"]
    assert main(confirm) == 0
    trees = json.loads((tmp_path / "confirm" / "metrics.json").read_text())["decoding"]["trees"]
    assert trees["tuned_floors"] == earlier and trees["dev_policies"] == []
    tree_runs = {(r["policy"], r["threshold"]) for r in runs_of(tmp_path / "confirm") if r["policy"] in TREES}
    assert tree_runs == set(earlier.items())
    assert "dev prompts of" in (tmp_path / "confirm" / "report.md").read_text()
    capsys.readouterr()
    untuned = [a if a != "[3]" else "[3,5]" for a in confirm]
    untuned[untuned.index("--out") + 1] = str(tmp_path / "untuned")
    assert main(untuned) == 2
    assert "has no floor for the head-valued tree at N = 5" in capsys.readouterr().err
    assert not (tmp_path / "untuned").exists()

    # a head that reads the state after a child cannot value a tree: its eval decodes the confidence-valued trees only
    resnet = trained[1] / "specdecpp" / "checkpoints" / "last.ckpt"
    fixed = ["eval", "--head", str(resnet), "--data", str(data), "--out", str(tmp_path / "fixed"), "--num-decode-prompts",
             "2", "--max-new-tokens", "6", "--max-draft", "3", "--bootstrap", "20", "--progress", "false",
             "--fixed-thresholds", json.dumps({"head": 0.5, "constant_k": 2, "tree_confidence": 0.15}),
             "--tree-budgets", "[2]"]
    assert main([*fixed, "--serving-batch-sizes", "[2]", "--serving-costs", "h100-llama3.1-8b-llama3.2-1b",
                 "--serving-batch-policies", "[]"]) == 0
    # the trees are served beside the chains, each round's draft forwards priced as the tree read its nodes
    metrics = json.loads((tmp_path / "fixed" / "metrics.json").read_text())
    served = {row["policy"] for row in metrics["decoding"]["serving"]["rows"]}
    assert {"tree_confidence_n2", "tree_confidence_cost_n2", "constant_k"} <= served
    tree_runs = [r for r in runs_of(tmp_path / "fixed") if r["policy"] == "tree_confidence_n2"]
    assert all(sum(map(len, r["draft_widths_per_round"])) == r["draft_forwards"] for r in tree_runs)
    trees = json.loads((tmp_path / "fixed" / "metrics.json").read_text())["decoding"]["trees"]
    assert {(r["policy"], r["threshold"]) for r in runs_of(tmp_path / "fixed") if r["policy"].startswith("tree")} == {
        ("tree_confidence_n2", 0.15), ("tree_confidence_cost_n2", 0.2)}
    assert "decides one_step_late" in trees["left_out"]["tree_head"]
    assert "tree_head is not decoded" in (tmp_path / "fixed" / "report.md").read_text()
    capsys.readouterr()
    for extra, reason in ((["--tree-floors", "[0.1]"], "drop --tree-floors"),):
        out = tmp_path / "refused"
        assert main([*fixed[: fixed.index("--out") + 1], str(out), *fixed[fixed.index("--out") + 2:], *extra]) == 2
        assert reason in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("flags, fragment", [
    (["--tree-floors", "[0.1]"], "no tree is decoded; give --tree-budgets"),
    (["--tree-budgets", "[]"], "--tree-budgets is empty"),
    (["--tree-budgets", "[0]"], "--tree-budgets: 0 is not a PositiveInt"),
    (["--tree-budgets", "[4]", "--tree-floors", "[1.5]"], "--tree-floors: 1.5 is not a ClosedUnitInterval"),
    (["--fixed-thresholds", '{"head": 0.5, "tree_head": 0.2}'], "gives the floor of tree_head, but no tree is decoded"),
])
def test_tree_flags_are_refused_in_one_line_before_anything_loads(flags, fragment, tmp_path, capsys):
    args = ["eval", "--head", str(tmp_path / "missing.ckpt"), "--data", str(tmp_path), "--out", str(tmp_path / "r"),
            "--progress", "false", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_the_card_says_what_the_trees_reached(tree_eval, tmp_path):
    _, head, out = tree_eval
    exported = tmp_path / "head"
    assert main(["export", "--ckpt", str(head), "--out", str(exported), "--report", str(out)]) == 0
    config = json.loads((exported / "config.json").read_text())
    tree = config["metrics"]["tree_drafts"]
    card = (exported / "README.md").read_text()
    assert "the best on the test prompts, N = 3 with" in card and f"{tree['modelled_speedup']:.3f}×" in card
    assert f"{tree['gain'] * 100:+.1f} % against the head's stop rule" in card
