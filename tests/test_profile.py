"""`specheads profile`: cost tables measured on the device the models run on, or modelled by a roofline preset, and
read by `specheads eval --serving-costs`; a bad table is refused in one line naming the file."""

from __future__ import annotations

import json
import math

import pytest

from specheads.artifacts.checkpoint import load_trained
from specheads.cli import main
from specheads.decoding.cost_table import read_cost_table


def test_profile_measures_the_tiny_pair_and_its_table_prices_eval_serving(trained, tiny_model, tmp_path):
    data, root = trained
    costs = tmp_path / "costs.json"
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    assert main(["profile", "--target.path", str(tiny_model), "--draft.skip-layers", "[2]", "--device", "cpu",
                 "--contexts", "[8, 24]", "--tokens", "[4, 1, 2, 16]", "--repeats", "1", "--out", str(costs),
                 "--head", str(head)]) == 0
    table = json.loads(costs.read_text())
    # the head timed beside the draft against the tokens it scores, with the digest that ties the curve to it
    trained_head = load_trained(str(head)).head
    assert table["head"]["tokens"] == [1, 2, 4, 16] and 0 < table["head"]["seconds"][0] <= table["head"]["seconds"][-1]
    assert table["models"]["head"]["weights_digest"] == trained_head.weights_digest()
    assert 0 < table["models"]["head"]["forward_cost"] < 1
    assert read_cost_table(str(costs)).head_digest == trained_head.weights_digest()
    assert (table["source"], table["modelled"], table["context"], table["repeats"]) == ("measured", False, 8, 1)
    assert [(entry["context"], entry["draft"]["tokens"]) for entry in table["curves"]] == [(8, [1, 2, 4, 16]), (24, [1, 2, 4, 16])]
    assert (table["draft"], table["target"]) == (table["curves"][0]["draft"], table["curves"][0]["target"])
    assert table["device"].startswith("CPU") and table["dtype"] == "float32"
    assert (table["models"]["target"]["layers"], table["models"]["draft"]["layers"]) == (4, 3)  # the draft skips one
    assert all(s > 0 for entry in table["curves"] for role in ("draft", "target") for s in entry[role]["seconds"])

    common = ["eval", "--head", str(head), "--data", str(data),
              "--num-decode-prompts", "6", "--max-new-tokens", "6", "--max-draft", "3", "--constant-ks", "[1,3]",
              "--head-thresholds", "[0.5]", "--stop-shares", "[0.5]", "--bootstrap", "5", "--progress", "false",
              "--serving-batch-sizes", "[1, 3]", "--test-samples", "3"]  # 3 requests fill B = 3: 12 tokens, within 16
    out = tmp_path / "report"
    assert main([*common, "--out", str(out), "--serving-costs", str(costs)]) == 0
    serving = json.loads((out / "metrics.json").read_text())["decoding"]["serving"]
    priced = serving["cost_curves"]["measured"]
    points = {role: {key: table[role][key] for key in ("tokens", "seconds")} for role in ("draft", "target")}
    assert (priced["draft"], priced["target"], priced["modelled"]) == (points["draft"], points["target"], False)
    assert priced["source"].startswith("measured by specheads profile (CPU") and str(costs) in priced["source"]
    assert set(serving["best"]) == {"measured", "draft at 0.2 × target"}
    smartspec = {(r["batch_size"], r["costs"]): r for r in serving["rows"] if r["policy"] == "smartspec"}
    assert set(smartspec) == {(b, v) for b in (1, 3) for v in serving["best"]}
    assert all(r["tokens_per_s"] > 0 for r in serving["rows"])
    assert "Forward costs: measured: measured by specheads profile" in (out / "report.md").read_text()
    # the head's forwards: priced on the table's head curve (it is this head) and counted at its weights' share
    assert priced["heads"] == {trained_head.weights_digest(): table["head"]}
    decoding = json.loads((out / "metrics.json").read_text())["decoding"]
    assert decoding["head_forward_cost"] == pytest.approx(table["models"]["head"]["forward_cost"])
    assert serving["head_forward_costs"]["evaluated"] == pytest.approx(decoding["head_forward_cost"])
    assert f"a head forward {decoding['head_forward_cost']:.3g} of a draft forward" in (out / "report.md").read_text()

    # views side by side: the curves measured here (and with the draft at c × target) and a preset, modelled per B
    modelled = tmp_path / "modelled"
    view = "roofline h100-llama3.1-8b-llama3.2-1b (modelled)"
    assert main([*common, "--out", str(modelled), "--serving-costs", "[measured, h100-llama3.1-8b-llama3.2-1b]"]) == 0
    serving = json.loads((modelled / "metrics.json").read_text())["decoding"]["serving"]
    assert serving["cost_curves"][view]["modelled"] is True and serving["cost_curves"][view]["per_batch_size"] is True
    assert serving["cost_curves"]["measured"]["source"] == "measured on the CPU"
    assert set(serving["best"]) == {"measured", "draft at 0.2 × target", view}
    live = {(r["policy"], r["batch_size"], r["costs"]): r for r in serving["rows"] if r["decoded"] == "live"}
    assert {key[1:] for key in live if key[0] == "dcut"} == {(b, v) for b in (1, 3) for v in serving["best"]}
    # each live planner is compared with the others decoded live at its B and view, with a paired interval
    assert set(live[("dcut", 3, view)]["vs_live"]) == {"smartspec", "vllm_adaptive"}
    dcut, smartspec = live[("dcut", 3, view)], live[("smartspec", 3, view)]
    assert dcut["vs_live"]["smartspec"]["change"] == pytest.approx(dcut["tokens_per_s"] / smartspec["tokens_per_s"] - 1)
    report = (modelled / "report.md").read_text()
    assert f"{view}: modelled by the roofline preset h100-llama3.1-8b-llama3.2-1b" in report
    assert f"Costs: {view}" in report


# Llama-3.1-8B on one H100 SXM in bf16, context 1024, worked by hand from the numbers docs/decoding-core.md gives:
# weights 8.03e9 × 2 B = 16.06e9 B; KV per row 1024 × 2 × 32 layers × 8 heads × 128 × 2 B = 134 217 728 B;
# FLOPs per token 2 × 8.03e9 + 4 × 32 × 4096 × 1024 = 16 596 870 912; launch 32 layers × 10 µs = 0.32 ms.
TARGET_AT_1 = 16_194_217_728 / 3.35e12 + 0.32e-3  # memory-bound: 4.834 ms + 0.32 ms
TARGET_AT_128 = (16.06e9 + 128 * 134_217_728) / 3.35e12 + 0.32e-3  # 128 rows' caches: 9.922 ms + 0.32 ms
TARGET_AT_32_ROWS = (16.06e9 + 32 * 134_217_728) / 3.35e12 + 0.32e-3  # 32 rows however many tokens: 6.076 + 0.32 ms
TARGET_AT_512_ONE_ROW = 512 * 16_596_870_912 / 989e12 + 0.32e-3  # compute-bound: 8.592 ms + 0.32 ms


def preset_table(folder, *flags: str):
    """`specheads profile --preset h100-llama3.1-8b-llama3.2-1b FLAGS` written and read back."""
    path = folder / f"preset{'-'.join(flags)}.json"
    assert main(["profile", "--preset", "h100-llama3.1-8b-llama3.2-1b", *flags, "--out", str(path)]) == 0
    return path


def test_a_roofline_preset_matches_the_hand_computation_and_reads_as_modelled(tmp_path):
    per_token = preset_table(tmp_path)
    table = json.loads(per_token.read_text())
    assert (table["source"], table["modelled"], table["context"], table["device"]) == \
        ("roofline", True, 1024, "NVIDIA H100 SXM 80GB (HBM3)")
    read = read_cost_table(str(per_token))
    assert read.modelled and read.view == "roofline h100-llama3.1-8b-llama3.2-1b (modelled)"
    assert read.describe().startswith("modelled by the roofline")
    assert read.costs.target(1) == pytest.approx(TARGET_AT_1, rel=1e-9) and TARGET_AT_1 == pytest.approx(5.154e-3, abs=1e-6)
    assert read.costs.target(128) == pytest.approx(TARGET_AT_128, rel=1e-9)
    # a batch of 32 requests: 32 .. 128 tokens read the same 32 caches and the forward is still memory-bound
    shared = read_cost_table(str(preset_table(tmp_path, "--batch-size", "32"))).costs
    assert shared.target(32) == pytest.approx(TARGET_AT_32_ROWS, rel=1e-9) == shared.target(128)
    one_row = read_cost_table(str(preset_table(tmp_path, "--batch-size", "1"))).costs
    assert one_row.target(512) == pytest.approx(TARGET_AT_512_ONE_ROW, rel=1e-9)  # one request's 512 tokens
    # the preset named in eval is modelled at each serving batch size: B = 32 prices as the --batch-size 32 table
    by_name = read_cost_table("h100-llama3.1-8b-llama3.2-1b")
    assert by_name.at_batch_size(32).target(128) == pytest.approx(TARGET_AT_32_ROWS, rel=1e-9)
    assert by_name.at_batch_size(1).target(512) == pytest.approx(TARGET_AT_512_ONE_ROW, rel=1e-9)
    # a table the preset wrote, unchanged, is priced by the preset on each forward's live rows, as the preset named
    assert read.at_batch_size(32).target.price(128, 32) == pytest.approx(TARGET_AT_32_ROWS, rel=1e-9)
    assert read.costs.target.price(128, 32) == by_name.at_batch_size(8).target.price(128, 32)
    table["target"]["seconds"][-1] *= 1.5  # changed by hand: no longer the preset's, priced as written, by its tokens
    per_token.write_text(json.dumps(table))
    changed = read_cost_table(str(per_token))
    assert changed.roofline is None and changed.at_batch_size(32) == changed.costs
    assert changed.costs.target.price(128, 32) == changed.costs.target(128)


def test_the_70b_preset_over_four_gpus_matches_the_hand_computation():
    # Llama-3.1-70B tensor parallel over 4 H100s, 4 tokens of 4 rows at context 1024 (per GPU):
    # bytes (70.6e9 × 2 + 4 × 1024 × 2 × 80 × 8 × 128 × 2) / 4 = 35 635 544 320 → / 3.35e12 = 10.6375 ms (memory-bound:
    # FLOPs (2 × 70.6e9 + 4 × 80 × 8192 × 1024) × 4 / 4 = 1.4388e11 → 0.1455 ms); launch 80 × 10 µs = 0.8 ms;
    # all-reduce 2 × 80 × (10 µs + 2 × 3/4 × 4 × 8192 × 2 B / 450e9 B/s) = 1.6350 ms
    by_hand = 35_635_544_320 / 3.35e12 + 0.8e-3 + 160 * (10e-6 + 1.5 * 65_536 / 450e9)
    assert by_hand == pytest.approx(13.0724e-3, abs=1e-7)
    costs = read_cost_table("4xh100-llama3.1-70b-llama3.1-8b").costs  # a preset's name reads as its table
    assert costs.target(4) == pytest.approx(by_hand, rel=1e-9)
    assert costs.draft(1) == pytest.approx(TARGET_AT_1, rel=1e-9)  # the 8B draft on one of the GPUs


BAD_TABLES = {
    "non-increasing tokens": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]},
                               "target": {"tokens": [1, 8, 4], "seconds": [1.0, 1.2, 1.1]}}, "`target.tokens` [1, 8, 4]"),
    "missing target": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]}}, "has no `target` curve"),
    "missing seconds": ({"draft": {"tokens": [1, 8]}, "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}},
                        "`draft` has no `seconds` list"),
    "negative time": ({"draft": {"tokens": [1, 8], "seconds": [0.2, -0.3]},
                       "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "gives -0.3 at 8 tokens"),
    "zero time": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]}, "target": {"tokens": [1, 8], "seconds": [0, 1.2]}},
                  "gives 0 at 1 tokens"),
    "NaN time": ({"draft": {"tokens": [1, 8], "seconds": [math.nan, 0.3]},
                  "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "gives nan at 1 tokens"),
    "one time short": ({"draft": {"tokens": [1, 8, 32], "seconds": [0.2, 0.3]},
                        "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "3 token counts and 2 times"),
    "bad extra context": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]}, "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]},
                           "curves": [{"context": 64, "draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]},
                                       "target": {"tokens": [2, 2], "seconds": [1.0, 1.2]}}]}, "`curves[0].target.tokens`"),
    "not JSON": ("{draft: 1", "not readable JSON"),
    # a curve that falls (a busy machine while measuring) once gave negative seconds and tokens/s, exit 0
    "falling time": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]},
                      "target": {"tokens": [1, 8, 32], "seconds": [1.0, 1.2, 0.4]}},
                     "`target.seconds` falls from 1.2 s at 8 tokens to 0.4 s at 32"),
    "overflowing tokens": ({"draft": {"tokens": [1, 10**400], "seconds": [0.2, 0.3]},
                            "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "a number of 1329 bits"),
    "overflowing time": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 1e308]},
                          "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "gives 1e+308 at 8 tokens"),
    "subnormal time": ({"draft": {"tokens": [1, 8], "seconds": [5e-324, 0.3]},
                        "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "gives 5e-324 at 1 tokens"),
    "overflowing context": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]},
                             "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}, "context": 10**400},
                            "`context` is 'a number of 1329 bits'"),
    "raised beyond the curve": ({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3], "raised": [4]},
                                 "target": {"tokens": [1, 8], "seconds": [1.0, 1.2]}}, "`draft.raised` is [4]"),
}


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_a_bad_table_is_refused_in_one_line_naming_the_file(case, tmp_path, capsys):
    payload, problem = BAD_TABLES[case]
    path = tmp_path / "costs.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    code = main(["eval", "--head", str(tmp_path / "head"), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
                 "--serving-batch-sizes", "[1]", "--serving-costs", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"specheads eval: error: --serving-costs {path}: ") and problem in lines[0], lines[0]
    assert "specheads profile" in lines[0]  # the fix
    assert not (tmp_path / "out").exists()


def test_a_table_of_curves_alone_still_reads(tmp_path):
    path = tmp_path / "costs.json"  # the format --serving-costs read before profile existed
    path.write_text(json.dumps({"draft": {"tokens": [1, 8], "seconds": [0.2, 0.3]},
                                "target": {"tokens": [1, 8, 32], "seconds": [1.0, 1.2, 2.5]}}))
    table = read_cost_table(str(path))
    assert (table.source, table.modelled, table.view, table.describe()) == ("given", False, "given", f"given in {path}")
    assert table.costs.target(20) == pytest.approx(1.2 + 12 * 1.3 / 24)


@pytest.mark.parametrize("flags, problem", [
    (["--preset", "h100-llama3.1-8b-llama3.2-1b", "--target.path", "x"], "drop --target/--draft"),
    (["--batch-size", "8"], "--batch-size shapes a roofline preset's curve"),
    (["--tokens", "[4]"], "fewer than two token counts"),
    (["--preset", "h100-llama3.1-8b-llama3.2-1b", "--head", "smollm2-ontime"], "drop --head, or drop --preset"),
])
def test_profile_refuses_flags_that_cannot_work_before_loading(flags, problem, tmp_path, capsys):
    assert main(["profile", "--out", str(tmp_path / "costs.json"), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0], lines
    assert not (tmp_path / "costs.json").exists()


@pytest.mark.integration
def test_profile_measures_the_embedded_pair_on_the_cpu(tmp_path):
    out = tmp_path / "costs.json"
    assert main(["profile", "--device", "cpu", "--tokens", "[1, 4]", "--repeats", "1", "--out", str(out)]) == 0
    table = read_cost_table(str(out))
    assert table.source == "measured" and not table.modelled and table.context == 32
    assert (table.fields["models"]["target"]["layers"], table.fields["models"]["draft"]["layers"]) == (30, 28)
