"""p and q are each model's own distribution whatever the family: `output_logits` on the decoder's last hidden state
gives the logits of the model's forward for the families that rescale, soft-cap or trim them around the LM head, a
rescaled target decodes exactly through `speculative_generate` (chi-square), and a family whose logits need more than
its output embeddings is refused in one line."""

import pytest
import torch
from test_eval import chi_square_p, sequence_probabilities
from test_integration_transformers import head_for, sampled_through_generate
from transformers import AutoConfig, AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM

from specheads.decoding import BatchCache
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.signals import output_logits
from specheads.plumbing.errors import UsageError

SMALL = dict(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
FAMILIES = {  # model_type: the config values beyond SMALL, each family's scale far from 1
    "cohere": dict(logit_scale=0.37),
    "cohere2": dict(logit_scale=0.37, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "cohere2_moe": dict(logit_scale=0.37),
    "granite": dict(logits_scaling=3.0),
    "granitemoe": dict(logits_scaling=3.0, num_local_experts=2, num_experts_per_tok=1),
    "falcon_h1": dict(lm_head_multiplier=0.5, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4,
                      mamba_n_groups=1, mamba_d_conv=2, mamba_chunk_size=4, head_dim=8),
    "hyperclovax": dict(logits_scaling=2.5),
    "minicpm3": dict(dim_model_base=4, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8),
    "inkling_text": dict(logits_mup_width_multiplier=4.0, unpadded_vocab_size=9),
    "gemma2": dict(final_logit_softcapping=0.05, head_dim=8),
    "recurrent_gemma": dict(logits_soft_cap=0.05, lru_width=16, block_types=["recurrent", "attention"],
                            attention_window_size=8),
}


def tiny(model_type: str, seed: int = 0, **values) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES.get(model_type, {}), **values})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_output_logits_are_the_models_own_logits(family):
    model = tiny(family)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]])
    expected = model(ids, use_cache=False).logits.float()
    states = model.get_decoder()(ids, use_cache=False).last_hidden_state
    assert torch.allclose(output_logits(model, states), expected, atol=1e-5)
    assert torch.allclose(output_logits(model, states[:, [1, 4]]), expected[:, [1, 4]], atol=1e-5)  # any positions
    head = model.get_output_embeddings()(states).float()  # the LM head alone: what p and q were before
    assert head.shape != expected.shape or not torch.allclose(head, expected, atol=1e-2)


@torch.no_grad()
def test_the_decoding_cache_returns_a_rescaled_models_logits():
    model = tiny("cohere")
    cache = BatchCache(model, 2)
    fed = cache.feed({0: [1, 2, 3], 1: [4, 5]}, {0: 3, 1: 2})
    assert torch.allclose(fed[0][0], model(torch.tensor([[1, 2, 3]])).logits[0].float(), atol=1e-5)
    assert torch.allclose(fed[1][0], model(torch.tensor([[4, 5]])).logits[0].float(), atol=1e-5)


def test_a_family_whose_logits_need_more_than_the_output_embeddings_is_refused_in_one_line():
    model = tiny("roberta", is_decoder=True)
    with pytest.raises(UsageError) as error:
        output_logits(model, torch.zeros(1, 16))
    assert "RobertaForCausalLM" in str(error.value) and "\n" not in str(error.value)


def granite_lm(seed: int) -> GraniteForCausalLM:
    """A 3-token Granite whose logits the forward divides by 3: p is far from softmax(lm_head(h))."""
    config = GraniteConfig(vocab_size=3, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.6,
                           tie_word_embeddings=False, logits_scaling=3.0)
    torch.manual_seed(seed)
    model = GraniteForCausalLM(config).eval().requires_grad_(False)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def test_sampling_a_rescaled_target_through_generate_leaves_its_distribution_unchanged():
    """500 samples from a Granite target and draft (logits_scaling 3) against the enumerated target."""
    target, draft = granite_lm(seed=1), granite_lm(seed=2)
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    assert chi_square_p(sampled_through_generate(target, draft, head_for(transform)), exact) > 1e-3


def test_every_family_the_rules_name_is_a_model_type_transformers_knows():
    """A misspelt key would leave its family on the default rule (its p and q silently wrong)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from specheads.model_outputs.signals import HEADED_FAMILIES, LOGIT_RULES

    assert set(LOGIT_RULES) | HEADED_FAMILIES <= set(CONFIG_MAPPING_NAMES)


@torch.no_grad()
def test_a_family_that_trims_padded_vocabulary_rows_decodes_through_the_engine():
    """inkling drops its padded rows: q and p are 9 tokens wide although the LM head has 11 rows, so the engine takes
    the width output_logits gives, and a run with rejections (draft and target disagree) completes exactly."""
    from specheads.decoding import RoundEngine, make_policy
    from specheads.model_outputs.signals import output_width

    target, draft = tiny("inkling_text", seed=1), tiny("inkling_text", seed=2)
    assert output_width(target) == 9 and target.get_output_embeddings().weight.shape[0] == 11
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    results = engine.decode([[1, 2, 3]] * 20, make_policy("constant_k", 3), 12, list(range(20)))
    assert all(len(r.tokens) == 12 and max(r.tokens) < 9 for r in results)
    assert sum(r.accepted for r in results) < sum(r.drafted for r in results)  # rejections happened
