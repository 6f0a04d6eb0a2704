"""The fast generation path gives the rows of the plain one; the vLLM adapter against a fake engine."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from conftest import tiny_args

from specheads.cli import main
from specheads.data_gen import run as run_module
from specheads.data_gen import vllm_engine
from specheads.data_gen.cli import parse_config
from specheads.data_gen.config import GenerationOptions
from specheads.data_gen.engines import BuiltinEngine, kv_bytes_per_token, rows_that_fit
from specheads.data_gen.plan import WorkItem, row_seed
from specheads.dataset.store import load_labelled, read_manifest
from specheads.model_outputs.sampling import SamplingTransform, draw_from_log_probs, row_generator, uniforms
from specheads.pair.models import ModelSpec, load_model, load_tokenizer, stop_token_ids
from specheads.plumbing.errors import UsageError

TRANSFORMS = {"plain": SamplingTransform(1.0, 0, 1.0), "warped": SamplingTransform(0.8, 20, 0.9),
              "greedy": SamplingTransform(0.0, 0, 1.0)}
MAX_NEW = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target64(tiny_model):
    """The tiny target in float64 (rounding far below any CDF gap) and its tokenizer; an eighth of the vocabulary
    stops a response, so that most responses end early on a stop token. Its generation config asks for logit
    processors (as some Hub models' do) that the responses must not get."""
    model = load_model(ModelSpec(path=str(tiny_model))).to(torch.float64)
    tokenizer = load_tokenizer(ModelSpec(path=str(tiny_model)))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(40, 80)]
    model.generation_config.update(repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=6)
    return model, tokenizer


def work_items(tokenizer) -> list[WorkItem]:
    """Eight rows of different prompt lengths, longest first as the plan orders them; two samples of one prompt."""
    texts = ["Speculative decoding drafts tokens with a small model and verifies them.", "What is 2 + 2?",
             "Hello!", "def add(a, b): return a + b", "The quick brown fox.", "Summarise it.", "Hi"]
    items = [WorkItem(f"p{i}", 0, tuple(tokenizer(text)["input_ids"]), 0.15) for i, text in enumerate(texts)]
    items.append(WorkItem("p1", 1, items[1].prompt_ids, 0.15))
    return sorted(items, key=lambda item: -len(item.prompt_ids))


def reference_response(model, item: WorkItem, transform: SamplingTransform, seed: int, stop_ids: list[int]) -> list[int]:
    """One row decoded alone without a KV cache: every step a full forward, then the row's next uniform."""
    draws = uniforms(row_generator(row_seed(seed, item.prompt_id, item.sample_index, "response")), MAX_NEW)
    tokens: list[int] = []
    with torch.no_grad():
        for step in range(MAX_NEW):
            logits = model(torch.tensor([list(item.prompt_ids) + tokens]), use_cache=False).logits[0, -1:]
            tokens.append(int(draw_from_log_probs(transform.log_probs(logits), draws[step : step + 1])))
            if tokens[-1] in stop_ids:
                break
    return tokens


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_static_cache_and_any_batch_size_give_the_cache_free_reference(target64, name):
    model, tokenizer = target64
    transform, items = TRANSFORMS[name], work_items(tokenizer)
    expected = [reference_response(model, item, transform, 5, stop_token_ids(model, tokenizer)) for item in items]
    settings = [GenerationOptions(), GenerationOptions(cache="static"), GenerationOptions(cache="static", batch_size=3),
                GenerationOptions(batch_size=1)]
    with torch.no_grad():
        for options in settings:
            engine = BuiltinEngine(tokenizer, transform, MAX_NEW, 5, options)
            assert engine.responses(model, items, CPU, batch_size=len(items)) == expected, options
    assert sum(r[-1] in stop_token_ids(model, tokenizer) for r in expected) >= 2 or name == "greedy"
    first, second = (r for item, r in zip(items, expected) if item.prompt_id == "p1")
    assert first != second or name == "greedy"  # two samples of one prompt, each from its own seed


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("SPECHEADS_TEST_COMPILE")),
                    reason="torch.compile takes about a minute on a small CPU; runs on a GPU or with SPECHEADS_TEST_COMPILE=1")
def test_compiled_static_decoding_gives_the_same_responses(target64):
    model, tokenizer = target64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    items, transform = work_items(tokenizer), TRANSFORMS["warped"]
    plain = BuiltinEngine(tokenizer, transform, MAX_NEW, 5, GenerationOptions())
    compiled = BuiltinEngine(tokenizer, transform, MAX_NEW, 5, GenerationOptions(cache="static", compile=True))
    with torch.no_grad():
        assert compiled.responses(model, items, device, 4) == plain.responses(model, items, device, 4)
    model.to(CPU)


def test_gen_rows_are_identical_with_and_without_the_fast_path(tiny_model, prompts_file, tmp_path):
    """float32, the CLI end to end: static cache, generate calls of 3 rows across labelling batches of 4, against the
    plain settings (on a CPU the one-pass labeller, data_gen.onepass: the same tokens, its floats within rounding)."""
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    assert main(tiny_args(tiny_model, prompts_file, plain, "--num-prompts", "6")) == 0
    assert main(tiny_args(tiny_model, prompts_file, fast, "--num-prompts", "6", "--generation.cache", "static",
                          "--generation.batch_size", "3")) == 0
    assert read_manifest(fast)["fingerprint"] == read_manifest(plain)["fingerprint"]
    assert read_manifest(fast)["config"]["generation"]["cache"] == "static"
    a, b = load_labelled(plain), load_labelled(fast)
    assert len(a) == len(b) == 12 and a.column_names == b.column_names
    for name in a.column_names:
        for x, y in zip(a[name], b[name]):
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype.kind == "f":
                assert np.allclose(x, y, rtol=1e-5, atol=1e-5 if name != "features" else 1e-2), name
            else:
                assert np.array_equal(x, y), name


def test_kv_bytes_per_token_is_what_a_forward_stores(tiny_model):
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(ModelSpec(path=str(tiny_model))).to(dtype)
        with torch.no_grad():
            cache = model(torch.arange(3, 13).view(2, 5), use_cache=True).past_key_values
        stored = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert kv_bytes_per_token(model) == stored / 10


def test_memory_sizing_counts_whole_rows_and_falls_back_on_a_cpu(target64):
    assert rows_that_fit(1000 * 20 + 999, 1000) == 16  # multiples of 8 from 8 up
    assert rows_that_fit(1000 * 5, 1000) == 5
    assert rows_that_fit(999, 1000) == 1
    model, tokenizer = target64
    engine = BuiltinEngine(tokenizer, TRANSFORMS["plain"], MAX_NEW, 0, GenerationOptions(batch_size="auto"))
    items = work_items(tokenizer)
    assert engine.rows_per_call(model, items, CPU, 4) == 4  # no device memory to plan for: the labelling batch
    engine.options.batch_size = 64
    assert engine.rows_per_call(model, items, CPU, 4) == len(items)


class RunsOutAboveTwoRows(BuiltinEngine):
    """The built-in engine on a device that holds at most two rows at once."""

    def generate(self, model, rows, device):
        if len(rows) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return super().generate(model, rows, device)


def test_running_out_of_memory_halves_the_rows_per_call_and_keeps_the_responses(target64, capsys):
    model, tokenizer = target64
    items = work_items(tokenizer)
    expected = BuiltinEngine(tokenizer, TRANSFORMS["plain"], MAX_NEW, 1).responses(model, items, CPU, 7)
    engine = RunsOutAboveTwoRows(tokenizer, TRANSFORMS["plain"], MAX_NEW, 1, GenerationOptions(batch_size=7))
    assert engine.responses(model, items, CPU, 7) == expected
    assert engine.cap == 1 and "going on with 3" in capsys.readouterr().err


def test_generation_settings_that_cannot_work_are_refused_in_one_line(tiny_model, prompts_file, tmp_path):
    for flags, words in ((["--generation.compile", "true"], "generation.cache: static"),
                         (["--responses-engine", "vllm", "--devices", "2"], "--devices 1"),
                         (["--responses-engine", "vllm", "--responses", str(prompts_file)], "one of the two")):
        with pytest.raises(UsageError, match=words) as error:
            parse_config(tiny_args(tiny_model, prompts_file, tmp_path)[1:] + flags).validate()
        assert "\n" not in str(error.value)


@pytest.mark.skipif(vllm_engine.importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_is_refused_naming_the_extra(tiny_model, prompts_file, tmp_path, capsys):
    assert main(tiny_args(tiny_model, prompts_file, tmp_path / "out", "--responses-engine", "vllm")) == 2
    error = capsys.readouterr().err.strip()
    assert "pip install 'specheads[vllm]'" in error and "\n" not in error
    assert not (tmp_path / "out").exists()


# --- the vLLM adapter against a fake engine shaped like vLLM's offline API ---

@dataclass
class FakeCompletion:
    """vLLM's CompletionOutput: the fields the adapter reads."""

    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    index: int = 0
    text: str = ""


@dataclass
class FakeRequestOutput:
    """vLLM's RequestOutput: the prompt's ids and one completion."""

    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    request_id: str = "0"


@dataclass
class FakeLLM:
    """Records what `generate` is asked and answers each request from its seed: up to max_tokens tokens from a
    generator seeded with the request's seed, stopping on a stop id, and including it, as vLLM does."""

    vocab: int
    calls: list = field(default_factory=list)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            generator = torch.Generator().manual_seed(params["seed"] % (1 << 63))
            tokens = torch.randint(0, self.vocab, (params["max_tokens"],), generator=generator).tolist()
            stops = [i for i, t in enumerate(tokens) if t in params["stop_token_ids"]]
            if params["seed"] % 3 == 0:  # some rows end early on the stop token
                stops.insert(0, 2)
                tokens[2] = params["stop_token_ids"][0]
            end = stops[0] + 1 if stops else len(tokens)
            outputs.append(FakeRequestOutput(list(prompt["prompt_token_ids"]), [
                FakeCompletion(tokens[:end], "stop" if stops else "length")]))
        return outputs


def test_vllm_requests_carry_the_prompt_ids_the_transform_and_each_rows_seed(target64):
    model, tokenizer = target64
    items, stop_ids = work_items(tokenizer), stop_token_ids(model, tokenizer)
    for name, transform in TRANSFORMS.items():
        llm = FakeLLM(len(tokenizer))
        vllm_engine.generate_with(llm, dict, items, 9, transform, MAX_NEW, stop_ids)
        (prompts, params), = llm.calls
        assert [p["prompt_token_ids"] for p in prompts] == [list(i.prompt_ids) for i in items]
        assert [p["seed"] for p in params] == [row_seed(9, i.prompt_id, i.sample_index, "response") for i in items]
        assert len({p["seed"] for p in params}) == len(items)
        for p in params:
            assert (p["temperature"], p["top_p"], p["max_tokens"], p["n"]) == (transform.temperature, transform.top_p, MAX_NEW, 1)
            assert p["top_k"] == (transform.top_k or -1)  # -1: off in every vLLM version
            assert p["stop_token_ids"] == stop_ids and not p["ignore_eos"]
            assert (p["repetition_penalty"], p["presence_penalty"], p["frequency_penalty"], p["min_p"]) == (1.0, 0.0, 0.0, 0.0)
        if name == "greedy":
            assert {p["temperature"] for p in params} == {0.0}


def test_vllm_outputs_end_as_builtin_responses_do():
    item, eos = WorkItem("p", 0, (5, 6, 7), 0.15), 2
    parse = lambda completion, limit=6: vllm_engine.parse_output(FakeRequestOutput([5, 6, 7], [completion]), item, [eos], limit)
    assert parse(FakeCompletion([9, 10, eos], "stop")) == [9, 10, eos]  # the stop token kept
    assert parse(FakeCompletion([9, 10], "stop", stop_reason=eos)) == [9, 10, eos]  # put back where an engine drops it
    assert parse(FakeCompletion([9, 10, 11, 12, 13, 14], "length")) == [9, 10, 11, 12, 13, 14]
    assert parse(FakeCompletion([9, 10, 11, 12, 13, 14, 15], "length")) == [9, 10, 11, 12, 13, 14]  # max_new_tokens
    with pytest.raises(RuntimeError, match="another prompt"):
        vllm_engine.parse_output(FakeRequestOutput([5, 6], [FakeCompletion([9], "length")]), item, [eos], 6)
    with pytest.raises(RuntimeError, match="abort"):
        parse(FakeCompletion([9], "abort"))


def test_vllm_engine_arguments_name_the_target_and_let_vllm_args_override(tiny_model):
    arguments = vllm_engine.engine_arguments(ModelSpec(path=str(tiny_model), dtype="bfloat16"), {"tensor_parallel_size": 2})
    assert arguments == {"model": str(tiny_model), "tokenizer": str(tiny_model), "revision": None, "dtype": "bfloat16",
                         "seed": 0, "tensor_parallel_size": 2}
    assert vllm_engine.engine_arguments(ModelSpec(path=str(tiny_model)), {"dtype": "float16"})["dtype"] == "float16"
    with pytest.raises(UsageError, match="skip_layers"):
        vllm_engine.engine_arguments(ModelSpec(path=str(tiny_model), skip_layers=[1]), {})


def test_vllm_rows_look_exactly_like_imported_rows_of_the_same_responses(tiny_model, prompts_file, tmp_path, monkeypatch):
    """`--responses-engine vllm` with the fake engine in vLLM's place, against `--responses` of what it answered."""
    answered: dict[tuple[str, int], list[int]] = {}

    def fake_vllm(arguments, items, global_seed, transform, max_new_tokens, stop_ids):
        assert arguments["model"] == str(tiny_model)
        responses = vllm_engine.generate_with(FakeLLM(300), dict, items, global_seed, transform, max_new_tokens, stop_ids)
        answered.update({(i.prompt_id, i.sample_index): r for i, r in zip(items, responses)})
        return responses

    monkeypatch.setattr(run_module, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine, "vllm_responses", fake_vllm)
    engine_out, imported_out = tmp_path / "vllm", tmp_path / "imported"
    assert main(tiny_args(tiny_model, prompts_file, engine_out, "--num-prompts", "4", "--responses-engine", "vllm")) == 0
    eos = load_tokenizer(ModelSpec(path=str(tiny_model))).eos_token_id
    assert len(answered) == 8 and any(r[-1] == eos for r in answered.values()) and any(len(r) == 12 for r in answered.values())
    jsonl = tmp_path / "responses.jsonl"
    jsonl.write_text("".join(json.dumps({"id": pid, "response_ids": answered[(pid, s)]}) + "\n" for pid, s in sorted(answered)))
    assert main(tiny_args(tiny_model, prompts_file, imported_out, "--num-prompts", "4", "--responses", str(jsonl))) == 0
    assert read_manifest(engine_out)["identity"]["responses"] == {"source": "target-generate", "engine": "vllm"}
    a, b = load_labelled(engine_out), load_labelled(imported_out)
    assert [answered[(p, s)] for p, s in zip(a["prompt_id"], a["sample_index"])] == a["target_ids"]
    for name in a.column_names:
        for x, y in zip(a[name], b[name]):
            assert np.array_equal(np.asarray(x), np.asarray(y)), name
