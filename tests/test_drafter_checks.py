"""A drafter folder checked against its target when it loads (`specheads.pair.drafter_checks`, issue 70): a drafter
made for another target, layer ids the target lacks, bad d2t maps, a block the target's context cannot hold, NaN
weights and malformed folders are refused in one line before any decoding, in the loaders every command and
benchmark goes through, in `specheads profile` and in the demo's option check."""

import json

import pytest
import torch
from conftest import vocabulary_maps
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specheads.cli import main
from specheads.plumbing.errors import UsageError

pytest.importorskip("speculators.models.eagle3")

from specheads.pair.drafters import fill_from_target, save_drafter  # noqa: E402
from specheads.pair.dspark import build_drafter as build_dspark  # noqa: E402
from specheads.pair.dspark import load_drafter as load_dspark  # noqa: E402
from specheads.pair.eagle3 import build_drafter as build_eagle3  # noqa: E402
from specheads.pair.eagle3 import load_drafter as load_eagle3  # noqa: E402


def llama(vocab: int = 320, hidden: int = 32, layers: int = 4) -> LlamaForCausalLM:
    """A tiny random target of the given shape (the tiny model's, by default)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    """An EAGLE-3 and a DSpark drafter over the tiny target's even tokens, saved as speculators does."""
    d2t, t2d = (torch.tensor(v) for v in vocabulary_maps(target.config.vocab_size, 2))
    folders = {}
    for kind, drafter in (("eagle3", build_eagle3(target.config, [1, 2, 3], len(d2t), "tiny")),
                          ("dspark", build_dspark(target.config, [1, 3], len(d2t), "tiny", mask_token_id=0, block_size=4,
                                                  markov_rank=4))):
        fill_from_target(drafter, target, d2t, t2d)
        folders[kind] = tmp_path_factory.mktemp(kind) / "drafter"
        save_drafter(drafter, folders[kind], dtype=torch.float32)
    return folders


def copy_of(folder, tmp_path, config=None, tensors=None):
    """`folder` copied to tmp_path with `config(dict)` and `tensors(dict)` applied to its two files."""
    out = tmp_path / "copy"
    out.mkdir()
    settings = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config(settings) or settings if config else settings))
    state = load_file(str(folder / "model.safetensors"))
    save_file((tensors(state) or state) if tensors else state, str(out / "model.safetensors"))
    return out


def refused(load, folder, target, problem):
    with pytest.raises(UsageError, match=problem) as raised:
        load(folder, target)
    assert "\n" not in str(raised.value)


def the_layers(ids):
    return lambda config: {**config, "eagle_aux_hidden_state_layer_ids": ids}


def replaced(name, change):
    def apply(state):
        state[name] = change(state[name].clone())
    return apply


def without(*names):
    def apply(state):
        for name in names:
            state.pop(name)
    return apply


def at(index, value):
    def change(tensor):
        tensor.view(-1)[index] = value
        return tensor
    return change


@pytest.mark.parametrize("config, tensors, problem", [
    (the_layers([1, 2, 7]), None, r"layer_ids \[1, 2, 7\] must be distinct layers of this target, 0..4"),
    (the_layers([-1, 2, 3]), None, "must be distinct layers"),
    (the_layers(None), None, "must be distinct layers"),
    (None, replaced("d2t", at(0, -5)), "d2t maps draft token 0 to -5, outside the target's vocabulary"),
    (None, replaced("d2t", at(5, 400)), "outside the target's vocabulary"),
    (None, replaced("d2t", at(1, -1)), "maps two draft tokens onto one target token"),
    (None, without("d2t", "t2d"), "holds no d2t map"),
    (None, replaced("t2d", at(1, True)), "t2d does not mark exactly"),
    (None, replaced("fc.weight", at(3, float("nan"))), "fc.weight holds 1 NaN or infinite values"),
    (None, replaced("layers.0.mlp.down_proj.weight", at(0, float("inf"))), "NaN or infinite"),
    (None, replaced("fc.weight", lambda t: t[:, :64].contiguous()), r"fc.weight is \[32, 64\], its config.json makes"),
    (None, without("layers.0.mlp.down_proj.weight"), "does not fit its config.json"),
    (lambda c: {**c, "norm_before_residual": "maybe"}, None, "norm_before_residual"),
])
def test_a_bad_eagle3_folder_is_refused_in_one_line_when_it_loads(saved, target, tmp_path, config, tensors, problem):
    refused(load_eagle3, copy_of(saved["eagle3"], tmp_path, config, tensors), target, problem)


@pytest.mark.parametrize("other, problem", [
    (dict(hidden=48), "made for a target of hidden size 32, this target's is 48"),
    (dict(vocab=400), "made for a target of 320 tokens, this target has 400"),
    (dict(layers=2), r"must be distinct layers of this target, 0..2"),
])
@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_a_drafter_made_for_another_target_is_refused_before_it_is_built(saved, kind, other, problem):
    refused(load_eagle3 if kind == "eagle3" else load_dspark, saved[kind], llama(**other), problem)


def test_a_dspark_block_the_targets_context_cannot_hold_is_refused(saved, target, tmp_path):
    folder = copy_of(saved["dspark"], tmp_path, lambda c: {**c, "block_size": 100_000})
    refused(load_dspark, folder, target, "block_size 100000 must be between 1 and 255")


@pytest.mark.parametrize("damage, problem", [
    (lambda f: (f / "config.json").write_text("{\"speculators_model_type\": "), "cannot be read as JSON"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "is not a JSON object"),
    (lambda f: (f / "config.json").unlink(), "is not a drafter folder"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:1000]), "cannot be read"),
    (lambda f: (f / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"})),
     "has no transformer_layer_config"),
])
def test_a_malformed_drafter_folder_ends_in_one_line(saved, target, tmp_path, damage, problem):
    folder = copy_of(saved["eagle3"], tmp_path)
    damage(folder)
    refused(load_eagle3, folder, target, problem)


def test_a_sound_folder_loads_and_remembers_where_it_came_from(saved, target):
    drafter = load_eagle3(saved["eagle3"], target)
    assert drafter.loaded_from == saved["eagle3"].resolve() and int(drafter.t2d.sum()) == 160


def test_profile_refuses_a_drafter_made_for_another_target_in_one_line(saved, tmp_path, capsys):
    other = tmp_path / "other"
    llama(hidden=48).save_pretrained(other)
    out = tmp_path / "costs.json"
    capsys.readouterr()
    assert main(["profile", "--target.path", str(other), "--eagle3", str(saved["eagle3"]), "--out", str(out),
                 "--tokens", "[1, 2]", "--repeats", "1", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert "hidden size 32, this target's is 48" in error and error.count("\n") == 0 and not out.exists()


def test_the_demo_checks_its_drafter_against_the_target_before_any_stage(saved, tiny_model, tmp_path, monkeypatch):
    """`demo --eagle3` with a drafter made for another target than the demo's: refused by the option check, which
    reads the target's config alone, before the first stage."""
    from specheads.demo import eagle3 as demo_eagle3
    from specheads.demo.config import DemoConfig

    other = tmp_path / "other"
    llama(hidden=48).save_pretrained(other)
    monkeypatch.setattr(demo_eagle3, "DEMO_TARGET", str(other))
    config = DemoConfig(out=str(tmp_path / "demo"), eagle3=str(saved["eagle3"]), quick=True)
    with pytest.raises(UsageError, match="hidden size 32, this target's is 48"):
        demo_eagle3.check_eagle3(config)
    monkeypatch.setattr(demo_eagle3, "DEMO_TARGET", str(tiny_model))
    demo_eagle3.check_eagle3(config)  # the drafter's own target passes


@pytest.fixture(scope="module")
def generate_pair(tmp_path_factory):
    """The chi-square tests' 3-token target, two EAGLE-3 drafters for it (other weights, other folders) loaded as the
    round engine's drafts, and a plain draft model."""
    from test_eval import tiny_lm
    from test_integration_transformers import quiet_pair

    from specheads.decoding.drafters import load_feature_draft

    target, draft_model = quiet_pair()
    folders = []
    for seed in (0, 1):
        drafter = build_eagle3(target.config, [0, 1, 2], 2, "tiny")
        fill_from_target(drafter, target, torch.tensor([0, 1]), torch.tensor([True, False, True]))
        with torch.no_grad():
            for parameter in drafter.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
        folders.append(tmp_path_factory.mktemp(f"eagle{seed}") / "drafter")
        save_drafter(drafter, folders[-1], dtype=torch.float32)
    assert tiny_lm  # the 3-token models of the exactness tests
    return target, draft_model, folders, [load_feature_draft("eagle3", str(folder), target) for folder in folders]


def labelled_head(draft_weights):
    """A random on-time head of hidden size 16 as `load_head` returns it, trained on data whose draft was
    `draft_weights` (its config.json's `draft.weights`)."""
    from test_integration_transformers import head_for

    from specheads.model_outputs.sampling import SamplingTransform

    head, rule = head_for(SamplingTransform(0.0))
    head.trained_for["draft"] = {"name": "the data's draft", "weights": draft_weights}
    return head, rule


def test_generate_refuses_a_head_trained_on_another_drafter_in_one_line(generate_pair):
    from test_eval import PROMPT

    from specheads.integrations.transformers import speculative_generate
    from specheads.pair.drafters import drafter_weights_sha256

    target, draft_model, folders, drafts = generate_pair
    first = {"kind": "eagle3", "weights_sha256": drafter_weights_sha256(folders[0])}
    ids = torch.tensor([PROMPT])

    def generate(head, draft):
        return target.generate(ids, custom_generate=speculative_generate, draft=draft, head=head, max_new_tokens=3,
                               do_sample=False)

    assert generate(labelled_head(first), drafts[0]).shape[1] == len(PROMPT) + 3  # the drafter that labelled its data
    for head, draft, problem in [(labelled_head(first), drafts[1], "not of the EAGLE-3 drafter in .*other files"),
                                 (labelled_head({"weights_sha256": "0" * 16}), drafts[0], "not of the EAGLE-3 drafter"),
                                 (labelled_head(first), draft_model, r"labelled by the EAGLE-3 drafter\), not of a draft model")]:
        with pytest.raises(UsageError, match=problem) as raised:
            generate(head, draft)
        assert "\n" not in str(raised.value)
