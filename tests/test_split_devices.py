"""Decoding models split over devices: every index and probability tensor is built on the device of the tensor it meets.

A CPU machine has one device, so the test pretends: `FakeDevices` (a torch function mode) lets tensors carry a
pretend CUDA device. The split models' first parameters, last hidden states, LM heads and KV cache layers carry the
devices a `device_map` would give them; creating or moving a tensor to a CUDA device makes a CPU tensor that carries
that device, `.device` reports it, and any op whose operands carry different devices fails, as it would on the GPUs.
The decoders' own forwards run unchecked (accelerate's hooks move their activations); everything specheads does around
them runs checked, and gives the very tokens and numbers of the undisturbed run.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from test_eval import tiny_lm
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from specheads.decoding import BatchCache, PromptCache, RoundEngine, make_policy
from specheads.decoding.companion import BinTable, Companion
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.heads import OnTimeAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.states import returned_cache

VOCAB = 12
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or result (nested in lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)


class FakeDevices(TorchFunctionMode):
    """Tensors carrying pretend devices, checked at every op (module docstring)."""

    def __init__(self):
        super().__init__()
        self.devices = WeakTensorKeyDictionary()
        self.checking = True

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return self.devices.get(tensor, tensor.device)

    def place(self, device: torch.device, *placed: torch.Tensor) -> None:
        for tensor in placed:
            self.devices[tensor] = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not self.checking:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `.device` getter
            return self.device_of(args[0])
        name = getattr(func, "__name__", str(func))
        destination = None
        if name in ("to", "cpu"):  # a move: to the named device (else it stays), the rest of the op on the CPU
            args = list(args)
            destination = torch.device("cpu") if name == "cpu" else self.device_of(args[0])
            for position, value in enumerate(args[1:], start=1):
                if isinstance(value, torch.Tensor):
                    raise NotImplementedError("FakeDevices does not follow tensor.to(other_tensor)")
                if isinstance(value, (torch.device, str)):
                    destination, args[position] = torch.device(value), "cpu"
        else:
            operands = [t for t in tensors((args, kwargs)) if not (t.ndim == 0 and self.device_of(t).type == "cpu")]
            met = {self.device_of(t) for t in operands}
            assert len(met) <= 1, f"{name} meets tensors on {sorted(map(str, met))}"
            destination = next(iter(met), None)
        if kwargs.get("device") is not None:  # a factory (torch.tensor, zeros, …) or a move by keyword
            destination, kwargs["device"] = torch.device(kwargs["device"]), "cpu"
        result = func(*args, **kwargs)
        if name in ("to", "cpu") and result is args[0] and destination != self.device_of(args[0]):
            result = result.clone()  # a real move makes a new tensor; the pretend one must not relabel its source
        if destination is not None and destination.type == "cuda":
            self.place(destination, *tensors(result))
        return result


@contextmanager
def split_forwards(mode: FakeDevices, models: dict[torch.nn.Module, tuple[int, int]]) -> Iterator[None]:
    """Give each model a two-device split (cuda:first, cuda:last): its first parameter (the embeddings) on the first,
    its LM head on the last; its decoder runs unchecked and its outputs are placed as the split places them: the last
    hidden state on the last device, each KV cache layer on its layer's device (the first half on the first)."""

    def unchecked(module, args):
        mode.checking = False

    def place_outputs(first: int, last: int):
        def hook(module, args, output):
            mode.checking = True
            mode.place(cuda(last), output.last_hidden_state)
            cache = returned_cache(output)
            layers = cache.layers if cache is not None else []
            for index, layer in enumerate(layers):
                mode.place(cuda(first if index < len(layers) // 2 else last), layer.keys, layer.values)
        return hook

    hooks = []
    for model, (first, last) in models.items():
        mode.place(cuda(first), next(model.parameters()))
        mode.place(cuda(last), model.get_output_embeddings().weight)
        decoder = model.get_decoder()
        hooks += [decoder.register_forward_pre_hook(unchecked), decoder.register_forward_hook(place_outputs(first, last))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture(scope="module")
def models():
    target, draft = tiny_lm(seed=11, vocab=VOCAB, init=0.5), tiny_lm(seed=12, vocab=VOCAB, init=0.5)
    companion = tiny_lm(seed=13, vocab=VOCAB, init=0.5)
    return target, draft, companion


def head() -> OnTimeAcceptanceHead:
    """An on-time head with the candidate's embedding: it meets the draft's state, its embedding and its signals."""
    torch.manual_seed(3)
    module = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(module.out.weight, std=2.0)
    return module


def decodes(target, draft, companion) -> dict[str, list[list[int]]]:
    """Tokens of every kind of decode: a chain rule in one batch, with continuous batching (rows refilled, caches
    compacted) and a prompt cache (snapshots loaded), a head rule, SV's companion, and tree drafts."""
    transform = SamplingTransform(1.0)
    seeds = list(range(len(PROMPTS)))
    engine = RoundEngine(target, draft, transform, stop_ids=[5], companion=Companion(companion, BinTable(
        np.array([0.5]), np.array([]), np.array([[0.2], [0.9]]))))
    stored = RoundEngine(target, draft, transform, stop_ids=[5], prompt_cache=PromptCache(1 << 20))
    constant = make_policy("constant_k", 3)
    runs = {
        "batch": engine.decode(PROMPTS, constant, 10, seeds),
        "refilled": engine.decode(PROMPTS, constant, 10, seeds, batch_size=1),
        "stored": stored.decode(PROMPTS, constant, 10, seeds, batch_size=2),
        "stored again": stored.decode(PROMPTS, constant, 10, seeds, batch_size=2),
        "head": engine.decode(PROMPTS, make_policy("head", 0.5, 4), 10, seeds, head()),
        "companion": engine.decode(PROMPTS, make_policy("sv_companion", 0.5, 4), 10, seeds),
        "tree": decode_tree(engine, PROMPTS[:2], TreeRule("confidence", floor=0.05, budget=6, width=2), 8, seeds[:2]),
    }
    return {name: [r.tokens for r in results] for name, results in runs.items()}


@torch.no_grad()
def test_split_models_decode_with_every_tensor_on_the_device_it_meets(models):
    target, draft, companion = models
    expected = decodes(target, draft, companion)
    mode = FakeDevices()
    with mode, split_forwards(mode, {target: (0, 1), draft: (2, 3), companion: (4, 5)}):
        assert target.device == cuda(0) and BatchCache(target, 1).device == cuda(0)  # the pretence holds
        placed = decodes(target, draft, companion)
    assert placed == expected


def test_the_pretence_catches_an_index_on_another_device():
    mode = FakeDevices()
    with mode:
        states = torch.zeros(2, 3, device=cuda(1))
        index = torch.tensor([0, 1], device=cuda(0))
        with pytest.raises(AssertionError, match="cuda:0"):
            states[index, index]
        assert states[index.to(states.device), index.to(states.device)].device == cuda(1)


@torch.no_grad()
def test_evals_likelihood_and_companion_signals_of_split_models_are_those_of_whole_ones(models):
    import datasets

    from specheads.eval.companion import companion_signals
    from specheads.eval.likelihood import target_log_likelihoods

    target, draft, companion = models
    generated = [[3, 4, 5], [], [7, 1], [0]]
    rows = datasets.Dataset.from_dict({"prompt_ids": PROMPTS[:2], "target_ids": [[7, 8, 9], [1]], "draft_ids": [[7, 0, 9], [11]]})
    transform = SamplingTransform(0.8)
    whole = target_log_likelihoods(target, PROMPTS, generated), companion_signals(draft, companion, transform, rows, batch=2)
    mode = FakeDevices()
    with mode, split_forwards(mode, {target: (0, 1), draft: (2, 3), companion: (4, 5)}):
        placed = target_log_likelihoods(target, PROMPTS, generated), companion_signals(draft, companion, transform, rows, batch=2)
    np.testing.assert_equal(placed[0], whole[0])
    for (s, a), (s_whole, a_whole) in zip(placed[1], whole[1]):
        np.testing.assert_array_equal(s, s_whole)
        np.testing.assert_array_equal(a, a_whole)
