"""`specheads eval --draft-kind lookup`: a token head of prompt lookup judged on held-out lookup labels beside the
free predictors, with the counted replay of the rules at T = 0; its numbers equal a direct computation, and what it
cannot judge is refused in one line before anything loads."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_args

from specheads.artifacts.metrics import binary_kl, expected_calibration_error, soft_auc
from specheads.cli import main
from specheads.dataset.datamodule import prompt_split
from specheads.dataset.lookup import flat_tokens, load_lookup
from specheads.dataset.store import read_manifest
from specheads.decoding.free_replay import make_rule, replay
from specheads.decoding.free_rules import length_bucket
from specheads.eval.lookup import vllm_table
from specheads.heads.lookup import TokenHeadModel
from specheads.lookup.features import FEATURE_NAMES
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST, linear_cost
from specheads.lookup.token_head import TokenHead

TEXTS = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the",
         "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add(a, b):",
         "one two three four one two three four one two three four one two",
         "Hello! How can I help you today? Hello! How can I help you today? Hello!"]


def lookup_gen(model, prompts, out, temperature: str) -> list[str]:
    """`specheads gen --drafter.kind lookup` on the tiny target (no draft model), 8 prompts, one response each."""
    args = tiny_args(model, prompts, out, "--drafter.kind", "lookup", "--samples-per-prompt", "1",
                     "--temperature", temperature, "--max-new-tokens", "24", "--batch-size", "4")
    args.remove("--draft.skip_layers")
    args.remove("[2]")
    return args


@pytest.fixture(scope="module")
def labels(tiny_model, tmp_path_factory):
    """Lookup labels at T = 0 of repetitive prompts in two families (`category`)."""
    root = tmp_path_factory.mktemp("eval-lookup")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": TEXTS[i % 4], "category": "ab"[i % 2]}) + "\n"
                               for i in range(8)))
    assert main(lookup_gen(tiny_model, prompts, root / "t0", "0")) == 0
    return root / "t0"


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A random token-only stop head of prompt lookup (its feature scaling set so that its scores vary)."""
    torch.manual_seed(0)
    model = TokenHeadModel("lookup_token_stop", width=8, depth=1, draft_kind="lookup")
    with torch.no_grad():
        model.feature_std.fill_(3.0)
    return model.export(tmp_path_factory.mktemp("head") / "head")


def eval_args(head, data, out, *extra) -> list[str]:
    return ["eval", "--draft-kind", "lookup", "--head", str(head), "--data", str(data), "--out", str(out),
            "--bootstrap", "50", *extra]


@pytest.fixture(scope="module")
def evaluated(labels, head, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "eval"
    assert main(eval_args(head, labels, out, "--fit-data", str(labels), "--max-draft", "6",
                          "--constant-ks", "[2, 6]")) == 0
    return json.loads((out / "metrics.json").read_text()), out


def direct_predictors(labels, head) -> tuple[dict, dict]:
    """The flat held-out tokens, and the head's and vLLM's table's estimates computed here: the stop head's raw
    output, and (accepted + 1) / (observed + 2) over the reached tokens of the same labels per (source, bucket,
    position)."""
    tokens = flat_tokens(load_lookup(labels), False)
    estimates = {"head": TokenHead.load(head).probabilities(tokens["features"])}
    source = tokens["features"][:, FEATURE_NAMES.index("from_output")]
    bucket = [length_bucket(int(n)) for n in tokens["features"][:, FEATURE_NAMES.index("match_length")]]
    keys = list(zip(source, bucket, tokens["position"]))
    table = {}
    for key, label, reach in zip(keys, tokens["label"], tokens["reach"]):
        table[key] = table.get(key, 0.0) + np.array([label * reach, reach])
    estimates["vllm_table"] = np.array([(table[key][0] + 1) / (table[key][1] + 2) for key in keys])
    estimates["score"] = tokens["features"][:, FEATURE_NAMES.index("score")]
    return tokens, estimates


def test_offline_metrics_equal_a_direct_computation(labels, head, evaluated):
    found, out = evaluated
    tokens, estimates = direct_predictors(labels, head)
    reached = tokens["reach"] > 0
    for name, values in estimates.items():
        got = found["offline"]["all"][name]
        label, weight, value = tokens["label"][reached], tokens["reach"][reached], values[reached]
        assert got["conditional"]["tokens"] == int(reached.sum())
        assert got["conditional"]["auc"] == pytest.approx(soft_auc(label, value, weight), nan_ok=True)
        assert got["conditional"]["ece"] == pytest.approx(expected_calibration_error(label, value, weights=weight))
        assert got["conditional"]["binary_kl"] == pytest.approx(binary_kl(label, np.clip(value, 1e-6, 1 - 1e-6), weight))
        survival = np.concatenate([np.cumprod(part) for part in np.split(values, np.flatnonzero(tokens["position"] == 1)[1:])])
        assert got["survival"]["auc"] == pytest.approx(soft_auc(tokens["survival"], survival), nan_ok=True)
    assert set(found["offline"]["all"]) == {"head", "vllm_table", "score", "product_score", "match_length"}
    assert "ece" not in found["offline"]["all"]["match_length"]["conditional"]  # a rank, not a probability
    # per family: the two categories' tokens are the whole
    families = {family: found["offline"][family]["head"]["survival"]["tokens"] for family in ("a", "b")}
    assert set(found["offline"]) == {"all", "a", "b"} and sum(families.values()) == len(tokens["label"])
    assert min(families.values()) > 0
    assert found["data"]["held_out"] == "every row" and (out / "roc.png").stat().st_size > 1000
    assert (out / "reliability.png").is_file() and "counted speedup" in (out / "report.md").read_text()


def test_the_replay_section_is_replay_called_directly(labels, head, evaluated):
    found, _ = evaluated
    decoding = found["decoding"]
    table, plan = f"lookup_table:{PACKED_CPU_TOKEN_COST}", f"lookup_plan:{PACKED_CPU_TOKEN_COST}"
    assert decoding["rules"] == ["constant_k:2", "constant_k:6", table, plan, "oracle"]
    rows = load_lookup(labels)
    assert decoding["prompt_ids"] == list(rows["prompt_id"])
    for rule in decoding["rules"]:
        policy, planner = make_rule(rule, 6, str(head))
        direct = [len(row["target_ids"]) / replay(row["prompt_ids"], row["target_ids"], policy, planner, 6,
                                                  linear_cost(PACKED_CPU_TOKEN_COST))[0] for row in rows]
        assert decoding["speedups"][rule] == pytest.approx(direct), rule
        assert decoding["summary"][rule]["all"]["speedup"] == pytest.approx(np.exp(np.mean(np.log(direct))))
    best = decoding["summary"]["oracle"]["all"]["speedup"]  # it verifies exactly what is accepted: nothing beats it
    assert best > 1 and all(best >= summary["all"]["speedup"] for summary in decoding["summary"].values())


def test_the_head_is_judged_on_its_own_validation_split(labels, tmp_path):
    """A head trained on these labels is judged on the prompts it held out (the table counted on the others)."""
    manifest = read_manifest(labels)
    training = {"path": str(labels), "fingerprint": manifest["fingerprint"], "val_fraction": 0.5, "split_seed": 0}
    folder = TokenHeadModel("lookup_token_stop", width=8, depth=1, draft_kind="lookup").export(tmp_path / "h",
                                                                                                 training_data=training)
    assert main(eval_args(folder, labels, tmp_path / "out", "--num-decode-prompts", "0")) == 0
    found = json.loads((tmp_path / "out" / "metrics.json").read_text())
    held = [prompt for prompt in load_lookup(labels)["prompt_id"] if prompt_split(prompt, 0, 0.5) == "val"]
    assert 0 < len(held) < 8 and found["data"]["prompt_ids"] == held and found["data"]["fit"] == str(labels)
    assert found["decoding"] is None and "--num-decode-prompts 0" in found["decoding_skipped"]
    rows = load_lookup(labels)  # vLLM's table counted on the training split only
    split = [prompt_split(prompt, 0, 0.5) for prompt in rows["prompt_id"]]
    val, train = ([flat_tokens(rows.select([i for i, s in enumerate(split) if s == side]), False)
                   for side in ("val", "train")])
    estimate, reached = vllm_table(train, val), val["reach"] > 0
    direct = binary_kl(val["label"][reached], np.clip(estimate[reached], 1e-6, 1 - 1e-6), val["reach"][reached])
    assert found["offline"]["all"]["vllm_table"]["conditional"]["binary_kl"] == pytest.approx(direct)


def test_a_replay_needs_greedy_labels_and_the_offline_part_is_still_written(tiny_model, labels, head, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": TEXTS[i % 4]}) + "\n" for i in range(4)))
    assert main(lookup_gen(tiny_model, prompts, tmp_path / "t1", "1")) == 0
    capsys.readouterr()
    assert main(eval_args(head, tmp_path / "t1", tmp_path / "out", "--fit-data", str(labels))) == 0
    found = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert found["decoding"] is None and "labelled at T = 1.0" in found["decoding_skipped"]
    assert "decoding replay skipped" in capsys.readouterr().out
    assert set(found["offline"]) == {"all"} and found["offline"]["all"]["head"]["conditional"]["tokens"] > 0


def copy_with(labels, tmp_path, change) -> str:
    """A copy of the labels whose manifest `change` edits."""
    folder = tmp_path / "copy"
    shutil.copytree(labels, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder)


def refusals(labels, head, tmp_path) -> list[tuple[list[str], str]]:
    not_a_head = tmp_path / "not-a-head"
    shutil.copytree(head, not_a_head)
    (not_a_head / "config.json").write_text(json.dumps({"format": "something-else", "head_type": "specdecpp"}))
    suffix_head = TokenHeadModel("lookup_token_stop", width=8, depth=1, draft_kind="suffix").export(tmp_path / "sh")
    features = copy_with(labels, tmp_path, lambda m: m["identity"].__setitem__("token_features", ["position"]))
    fit = ["--fit-data", str(labels)]
    return [(eval_args(not_a_head, labels, tmp_path / "o", *fit), "not a token-only head"),
            (eval_args(tmp_path, labels, tmp_path / "o", *fit), "is not a token head folder"),
            (eval_args(suffix_head, labels, tmp_path / "o", *fit), "head was trained on 'suffix' drafts"),
            (eval_args(head, features, tmp_path / "o", *fit), "not the head's inputs"),
            (eval_args(head, labels, tmp_path / "o"), "give --fit-data"),
            (eval_args(head, labels, tmp_path / "o", *fit, "--eagle3", "x"), "does not use --eagle3"),
            (eval_args(head, tmp_path, tmp_path / "o", *fit), "holds no finished lookup labels"),
            (["eval", "--head", str(head), "--data", str(labels), "--fit-data", str(labels)], "give --draft-kind"),
            (["eval", "--head", str(head), "--data", str(labels), "--out", str(tmp_path / "o")],
             "is a free draft's token head; give --draft-kind lookup")]


def test_refusals_are_one_line_before_anything_loads(labels, head, tmp_path, capsys, monkeypatch):
    import specheads.eval.lookup as lookup

    monkeypatch.setattr(lookup, "load_lookup", lambda *a: pytest.fail("labels loaded before the refusal"))
    for args, expected in refusals(labels, head, tmp_path):
        assert main(args) == 2, expected
        error = capsys.readouterr().err.strip()
        assert expected in error and len(error.splitlines()) == 1, error
        assert not (tmp_path / "o").exists()
