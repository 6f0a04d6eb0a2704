"""Linear layers on weights prepacked once for oneDNN (`specheads.pair.packed`): the same logits as the stock layers
at every forward width, from the packed copy (not MKL's sgemm, which repacks the weight on every call of more than one
row: the verify's extra target forward a round, issue 61), repacked when a weight changes, copied as a model is."""

import copy

import pytest
import torch
from test_eval import tiny_lm
from transformers import DynamicCache

from specheads.model_outputs.states import cache_argument
from specheads.pair.packed import PackedLinear, pack_linear_weights, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


def packed_copy(model):
    """A copy of `model` with its linear layers packed, and how many were."""
    copied = copy.deepcopy(model)
    return copied, pack_linear_weights(copied)


@torch.no_grad()
def cached_logits(model, prompt: list[int], widths: list[int]) -> list[torch.Tensor]:
    """The logits of forwards of each width after `prompt`, over one KV cache."""
    cached = {cache_argument(model): DynamicCache(config=model.config), "use_cache": True}
    model(input_ids=torch.tensor([prompt]), **cached)
    tokens = iter(range(1, 100))
    return [model(input_ids=torch.tensor([[next(tokens) % model.config.vocab_size for _ in range(width)]]),
                  **cached).logits[0] for width in widths]


def test_a_packed_model_gives_the_stock_logits_at_every_width():
    stock = tiny_lm(seed=1)
    packed, count = packed_copy(stock)
    assert count == sum(isinstance(m, torch.nn.Linear) for m in stock.modules()) == 15  # 2 layers × 7, the LM head
    for ours, theirs in zip(cached_logits(packed, [0, 1, 2], [1, 3, 5, 2]), cached_logits(stock, [0, 1, 2], [1, 3, 5, 2])):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_verify_width_forward_multiplies_by_the_packed_weights_not_by_sgemm():
    packed, _ = packed_copy(tiny_lm(seed=1))
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        packed(input_ids=torch.tensor([[0, 1, 2]]))
    names = [event.name for event in profile.events()]
    assert names.count("mkldnn::_linear_pointwise") == 15
    assert not {"aten::mm", "aten::addmm", "aten::linear"} & set(names)


def test_a_weight_changed_in_place_is_repacked_and_a_copy_repacks_its_own():
    stock = tiny_lm(seed=1)
    packed, _ = packed_copy(stock)
    with torch.no_grad():
        for model in (stock, packed):
            model.lm_head.weight.mul_(2.0)
    torch.testing.assert_close(cached_logits(packed, [0, 1], [3])[0], cached_logits(stock, [0, 1], [3])[0])
    again = copy.deepcopy(packed)  # oneDNN's tensors cannot be copied: the copy packs its own weights
    assert isinstance(again.lm_head, PackedLinear) and again.lm_head.packed is None
    torch.testing.assert_close(cached_logits(again, [0, 1], [3])[0], cached_logits(stock, [0, 1], [3])[0])


def test_a_gradient_or_another_dtype_takes_the_layers_own_path():
    layer = torch.nn.Linear(4, 3)
    pack_linear_weights(layer)
    inputs = torch.randn(2, 4)
    loss = layer(inputs).sum()  # the weight requires a gradient: the stock path, which has one
    loss.backward()
    assert layer.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(layer(inputs), inputs @ layer.weight.T + layer.bias)
        doubled = layer.double()
        assert doubled(inputs.double()).dtype == torch.float64
