"""Non-finite values refused, never decoded on (issue 70): a NaN makes min(1, exp(log p − NaN)) 1 in Python, so NaN
drafter logits would have every candidate accepted. The p/q test refuses a NaN; the round engine's draft step and
verify, and the B = 1 feature-drafter loop, refuse NaN or +inf logits at the forward that made them; gen refuses NaN
labels naming the prompt and writes no shard; a head holding NaN, inf or a zero standard deviation is refused at load."""

import math

import pytest
import torch
from conftest import tiny_args
from safetensors.torch import load_file, save_file
from test_eval import PROMPT, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.sampler import accepts, refuse_non_finite, verify_siblings
from specheads.heads import OnTimeAcceptanceHead, load_head
from specheads.heads.loading import HEAD_FORMAT, HEAD_FORMAT_VERSION, STOP_RULE, DecisionRule
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


def poisoned(model, value=math.nan):
    """`model` with its output layer's first row set to `value` (every forward's logits then hold it)."""
    with torch.no_grad():
        model.lm_head.weight[0].fill_(value)
    return model


@pytest.mark.parametrize("logp, logq", [(0.0, math.nan), (math.nan, -0.5), (math.nan, math.nan)])
def test_the_pq_test_refuses_a_nan_rather_than_accepting(logp, logq):
    with pytest.raises(UsageError, match="is NaN") as refused:
        accepts(logp, logq, torch.Generator().manual_seed(0))
    assert "\n" not in str(refused.value)
    log_probs = torch.tensor([math.nan, -1.0, -1.0])  # a rejection's residual of NaN p is never drawn from either
    with pytest.raises(UsageError):
        verify_siblings(log_probs, [(0, torch.tensor([-0.1, -3.0, -3.0]))], torch.Generator().manual_seed(0))


def test_minus_infinity_rules_a_token_out_and_nan_or_plus_infinity_is_refused():
    ruled_out = torch.tensor([[0.5, -math.inf, 1.0]])  # q = 0 off a draft's vocabulary
    assert refuse_non_finite(ruled_out, "the draft") is ruled_out
    for bad in (math.nan, math.inf):
        with pytest.raises(UsageError, match=r"the draft's logits hold NaN or \+inf at this forward.*float32 or bfloat16"):
            refuse_non_finite(torch.tensor([[0.5, bad, 1.0]]), "the draft")


@pytest.mark.parametrize("which, value", [("draft", math.nan), ("draft", math.inf), ("target", math.nan)])
def test_the_round_engine_refuses_non_finite_logits_at_the_first_forward(which, value):
    """Before the fix NaN draft logits decoded to the end, every candidate accepted (eval's 2.73x)."""
    models = {"target": tiny_lm(seed=1), "draft": tiny_lm(seed=2)}
    poisoned(models[which], value)
    engine = RoundEngine(models["target"], models["draft"], SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match=f"the {which}'s logits hold NaN or \\+inf") as refused:
        engine.decode([PROMPT, PROMPT], make_policy("constant_k", 3, max_draft=3), 8, [0, 1], batch_size=2)
    assert "\n" not in str(refused.value)


def test_the_b1_feature_drafter_loop_refuses_a_nan_drafter_and_a_nan_target():
    pytest.importorskip("speculators.models.eagle3")
    from test_eagle3_decoding import random_drafter

    from specheads.decoding.eagle3 import eagle3_decode

    target = tiny_lm(seed=1)
    drafter = random_drafter(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True])
    with torch.no_grad():
        drafter.lm_head.weight[0].fill_(math.nan)
    with pytest.raises(UsageError, match="the drafter's logits hold NaN"):
        eagle3_decode(target, drafter, PROMPT, SamplingTransform(1.0), 3, 6, 0)
    finite = random_drafter(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True])
    with pytest.raises(UsageError, match="the target's logits hold NaN"):
        eagle3_decode(poisoned(target), finite, PROMPT, SamplingTransform(1.0), 3, 6, 0)


@pytest.fixture
def nan_target(tiny_model, tmp_path):
    """The tiny target with NaN in layer 2, which the derived draft (`--draft.skip_layers [2]`) skips: the target's p
    is NaN, the draft's q finite."""
    import shutil

    folder = tmp_path / "nan-target"
    shutil.copytree(tiny_model, folder)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.weight"
    weights[name] = torch.full_like(weights[name], math.nan)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_gen_refuses_nan_labels_naming_the_prompt_and_writes_no_shard(nan_target, prompts_file, tmp_path, capsys):
    """Before the fix the NaN labels were written and gen exited 0. (The one-pass labeller's probe finds NaN p unlike
    the model's own forwards and hands over to `label_batch`, which refuses.)"""
    from specheads.cli import main

    out = tmp_path / "gen"
    assert main(tiny_args(nan_target, prompts_file, out, "--num-prompts", "2")) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("specheads gen: error: prompt '") and "label at response position" in error, error
    assert "logits are not finite" in error
    assert not list(out.rglob("*.parquet")) and not list(out.rglob("*.arrow"))


def test_the_one_pass_labellers_rows_are_refused_before_they_become_columns():
    from specheads.data_gen.onepass import Record
    from specheads.data_gen.plan import WorkItem
    from specheads.dataset.storage import DEFAULT_STORAGE

    items = [WorkItem("p0", 0, (1, 2), 0.5), WorkItem("p1", 1, (1, 2), 0.5)]
    record = Record(items, 0, steps=3, siblings=False)
    record.lengths[:] = 3
    record.values["top1"].fill_(0.5)
    assert len(record.columns(items, DEFAULT_STORAGE)["logq"]) == 2  # zeros are sound labels
    record.values["accept"][2, 1] = math.nan
    with pytest.raises(UsageError, match=r"prompt 'p1' \(sample 1\): its accept label at response position 2 is nan"):
        record.columns(items, DEFAULT_STORAGE)


def saved_head(folder, change):
    """An on-time head saved as export writes it, with `change` applied to its weights first."""
    head = OnTimeAcceptanceHead(8, depth=1, extra_features=["logq"])
    with torch.no_grad():
        change(head)
    head.save_pretrained(folder, config={**head.config, "format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION,
                                         "decision_rule": DecisionRule(STOP_RULE, 0.5, True, max_draft=4).as_dict(),
                                         "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}})
    return folder


@pytest.mark.parametrize("change, problem", [
    (lambda head: head.out.weight[0, 0].fill_(math.nan), r"out\.weight holds NaN or inf"),
    (lambda head: head.hidden_mean.fill_(math.inf), r"hidden_mean holds NaN or inf"),
    (lambda head: head.hidden_std.zero_(), r"hidden_std holds a standard deviation of zero or less"),
])
def test_a_head_with_non_finite_tensors_is_refused_at_load(tmp_path, change, problem):
    folder = saved_head(tmp_path / "head", change)
    with pytest.raises(UsageError, match=problem) as refused:
        load_head(str(folder))
    assert "\n" not in str(refused.value) and str(folder) in str(refused.value)
    load_head(str(saved_head(tmp_path / "sound", lambda head: None)))  # a sound head still loads
