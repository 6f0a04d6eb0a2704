"""`target.generate(custom_generate=speculative_generate)` refuses in one line, before any forward, what it cannot
honour and would otherwise drop silently: generate's own streamer, contrastive search and DoLa, inputs other than the
prompt's ids, a head that reads the target's state, and a draft that is provably not the one the head was trained
for; a draft whose identity cannot be determined is let through."""

import json

import pytest
import torch
from test_eval import PROMPT, tiny_lm
from test_integration_transformers import Collect, head_for, quiet_pair
from transformers import LlamaForCausalLM

from specheads.decoding import RoundEngine, make_policy
from specheads.heads import OnTimeAcceptanceHead
from specheads.integrations.transformers import speculative_generate
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, draft_identity, weights_identity, without_layers
from specheads.plumbing.errors import UsageError


@pytest.fixture(scope="module")
def pair():
    return quiet_pair()


def generate(target, draft, head, **options):
    options = {"max_new_tokens": 2, "do_sample": False, **options}
    return target.generate(torch.tensor([PROMPT]), custom_generate=speculative_generate, draft=draft, head=head, **options)


@pytest.mark.parametrize("options, message", [
    ({"penalty_alpha": 0.6, "top_k": 2}, "penalty_alpha asks for contrastive search"),
    ({"dola_layers": "high"}, "dola_layers asks for dola generation"),
    ({"prompt_lookup_num_tokens": 2}, "prompt_lookup_num_tokens drafts from the context, not with a draft model"),
    ({"mm_encoder_outputs": torch.zeros(1, 4)}, "cannot honour mm_encoder_outputs"),
])
def test_options_generate_would_drop_silently_are_refused_in_one_line(pair, options, message):
    target, draft = pair
    with pytest.raises(UsageError, match=message) as refused:
        generate(target, draft, head_for(SamplingTransform(0.0)), **options)
    assert "\n" not in str(refused.value)


def test_generates_own_streamer_is_refused_pointing_to_token_streamer(pair):
    """transformers 5.x puts the prompt into generate's streamer and calls the callable without it: refused (the
    prompt is all it ever gets), before any token is decoded."""
    target, draft = pair
    streamer = Collect()
    with pytest.raises(UsageError, match="pass your streamer as token_streamer= instead"):
        generate(target, draft, head_for(SamplingTransform(0.0)), streamer=streamer)
    assert streamer.tokens == PROMPT and not streamer.ended


def test_inputs_embeds_instead_of_ids_are_refused(pair):
    target, draft = pair
    with pytest.raises(UsageError, match="cannot honour inputs_embeds"):
        target.generate(inputs_embeds=torch.zeros(1, 2, 16), max_new_tokens=2, do_sample=False,
                        custom_generate=speculative_generate, draft=draft, head=head_for(SamplingTransform(0.0)))


def counted(model) -> list[int]:
    """A list that grows by one at each forward of `model`'s decoder (what the round engine runs)."""
    calls: list[int] = []
    model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_a_head_that_reads_the_targets_state_is_refused_before_any_forward():
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    forwards = counted(draft), counted(target)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq"], target_state_size=16).eval()
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="reads the target's state"):
        engine.decode([PROMPT], make_policy("head", 0.5), 4, [0], head)
    with pytest.raises(UsageError, match="reads the target's state"):
        generate(target, draft, (head, head_for(None)[1]))
    assert forwards == ([], [])


def saved(model, folder) -> LlamaForCausalLM:
    model.save_pretrained(folder)
    return LlamaForCausalLM.from_pretrained(folder).eval()


def trained_for(draft_id: dict, target_weights: dict | None = None) -> OnTimeAcceptanceHead:
    """A head whose `trained_for` is what load_head reads from an export's config.json for this draft identity."""
    head, _ = head_for(SamplingTransform(0.0))
    head.trained_for = {**head.trained_for, "draft": {**draft_id, "target_weights": target_weights}}
    return head


def test_a_draft_that_is_provably_not_the_heads_is_refused_and_an_undetermined_one_is_not(tmp_path, pair):
    target, _ = pair
    draft = saved(tiny_lm(seed=2), tmp_path / "draft")
    head = trained_for(draft_identity(ModelSpec(path=str(tmp_path / "draft")), draft))
    assert generate(target, draft, head).shape == (1, len(PROMPT) + 2)  # the very draft
    assert generate(target, tiny_lm(seed=5), head).shape == (1, len(PROMPT) + 2)  # built in memory: undetermined
    assert generate(target, saved(tiny_lm(seed=2), tmp_path / "copy"), head) is not None  # another folder: undetermined
    changed = saved(tiny_lm(seed=5), tmp_path / "draft")  # a fine-tune saved over the folder the head's data came from
    with pytest.raises(UsageError, match=r"not the one the head was trained for .*files of .*draft have changed"):
        generate(target, changed, head)
    other_class = {**head.trained_for["draft"], "weights": {**head.trained_for["draft"]["weights"],
                                                              "class": "MistralForCausalLM"}}
    with pytest.raises(UsageError, match="it is a LlamaForCausalLM, the head was trained on a MistralForCausalLM"):
        generate(target, draft, trained_for(other_class))


def test_a_draft_derived_from_the_target_is_checked_against_the_layers_it_skipped(tmp_path):
    target = saved(tiny_lm(seed=1), tmp_path / "target")  # two layers
    spec = ModelSpec(path=None, skip_layers=[1])
    head = trained_for(draft_identity(spec, without_layers(target, [1]), target=(ModelSpec(path=str(tmp_path / "target")), target)),
                       weights_identity(ModelSpec(path=str(tmp_path / "target")), target))
    for model in (target,):
        model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    assert generate(target, without_layers(target, [1]), head).shape == (1, len(PROMPT) + 2)
    with pytest.raises(UsageError, match="its weights are not this target's"):
        generate(target, tiny_lm(seed=2), head)


def deep_lm(seed: int, layers: int = 4) -> LlamaForCausalLM:
    """tiny_lm with `layers` decoder layers, and no EOS (every run is as long as asked)."""
    from test_eval import VOCAB
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.35,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def test_a_derived_draft_is_checked_by_the_layers_it_skips_and_the_target_its_tensors_are(tmp_path):
    """Not by its layer count alone: a draft skipping [0, 1] is refused for a head trained for one skipping [2, 3],
    and a draft of another model with the recorded layers skipped for this target; a copy of the target loaded apart,
    with the recorded layers skipped, is the same weights and passes."""
    target = saved(deep_lm(seed=1), tmp_path / "target")
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    spec, target_spec = ModelSpec(path=None, skip_layers=[2, 3]), ModelSpec(path=str(tmp_path / "target"))
    head = trained_for(draft_identity(spec, without_layers(target, [2, 3]), target=(target_spec, target)),
                       weights_identity(target_spec, target))
    assert generate(target, without_layers(target, [2, 3]), head).shape == (1, len(PROMPT) + 2)
    apart = LlamaForCausalLM.from_pretrained(tmp_path / "target").eval()
    assert generate(target, without_layers(apart, [2, 3]), head).shape == (1, len(PROMPT) + 2)
    with pytest.raises(UsageError, match=r"it skips the target's layers \[0, 1\], the head was trained for a draft "
                                         r"skipping \[2, 3\]"):
        generate(target, without_layers(target, [0, 1]), head)
    with pytest.raises(UsageError, match="its weights are not this target's"):
        generate(target, without_layers(deep_lm(seed=5), [2, 3]), head)


def hub_record(path: str, commit: str) -> dict:
    """A Hub draft's identity as `weights_identity` records it."""
    return {"name": path, "weights": {"spec": {"path": path, "revision": None, "gguf_file": None, "dtype": "float32",
                                               "skip_layers": []}, "class": "LlamaForCausalLM", "revision": commit}}


def test_a_hub_draft_is_checked_by_its_repo_id_and_the_recorded_snapshots_architecture(pair, tmp_path, monkeypatch):
    """Beyond class and hidden size: a draft loaded from another Hub repo id, or (where the cache holds the recorded
    commit's config.json) of another architecture, is refused; nothing is downloaded."""
    import huggingface_hub

    target, draft = pair
    commit = "c0ffee" * 6 + "c0ff"
    head = trained_for(hub_record("org/draft-a", commit))
    snapshot = tmp_path / "hub" / "models--org--draft-a" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(draft.config, "name_or_path", "org/draft-b")
    with pytest.raises(UsageError, match="it was loaded from org/draft-b, the head was trained on org/draft-a"):
        generate(target, draft, head)
    monkeypatch.setattr(draft.config, "name_or_path", "org/draft-a")
    assert generate(target, draft, head).shape == (1, len(PROMPT) + 2)  # the recorded snapshot is not cached
    (snapshot / "config.json").write_text(json.dumps({**draft.config.to_dict(), "num_hidden_layers": 3}))
    with pytest.raises(UsageError, match=r"its num_hidden_layers is 2, the head was trained on a model with 3 "
                                         r"\(org/draft-a at c0ffeec0ffee\)"):
        generate(target, draft, head)
    (snapshot / "config.json").write_text(json.dumps(draft.config.to_dict()))
    assert generate(target, draft, head).shape == (1, len(PROMPT) + 2)


def test_a_cost_ratio_that_is_not_a_number_is_refused_in_one_line(pair):
    target, draft = pair
    with pytest.raises(UsageError, match=r"cost_ratio= is t_draft/t_target, a number in \(0, 1\); got '0.2'"):
        generate(target, draft, head_for(SamplingTransform(0.0)), cost_ratio="0.2")


def test_a_loaded_head_without_a_recorded_sampling_is_refused(pair):
    """A head trained at T = 1 whose config.json lost `sampling` must not decode greedily unnoticed."""
    target, draft = pair
    head, rule = head_for(SamplingTransform(1.0))
    head.trained_for = {**head.trained_for, "sampling": None}
    with pytest.raises(UsageError, match="records no sampling"):
        generate(target, draft, (head, rule))
