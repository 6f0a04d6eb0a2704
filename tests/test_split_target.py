"""A target spread over devices by accelerate labels exactly the rows of the whole target; the 70B config validates.

On a CPU-only machine accelerate can split a model between host memory and disk (layers on `disk` stay on the
meta device and are read back for each forward by its hooks, the same hooks that move activations between GPUs).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, tiny_args

from specheads.cli import main
from specheads.data_gen.cli import parse_config
from specheads.data_gen.placement import check_visible_gpus, trainer_devices
from specheads.dataset.store import load_labelled, read_manifest
from specheads.pair.models import ModelSpec, load_model, load_pair
from specheads.pair.placement import RankDevices, check_no_spill, load_kwargs, rank_devices
from specheads.plumbing.errors import UsageError

CPU = RankDevices(torch.device("cpu"), ())
SPLIT_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
             "model.layers.3": "disk", "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "cpu"}
MAP_FLAG = "{" + ", ".join(f'"{name}": "{device}"' for name, device in SPLIT_MAP.items()) + "}"
BY_MEMORY = ("--target.device_map", "auto", "--target.max_memory", '{"cpu": "150KB"}')
CONFIG_70B = Path(__file__).parents[1] / "configs/gen/llama2-70b-7b.yaml"


def rows(out: Path) -> dict:
    return {(r["prompt_id"], int(r["sample_index"])): r for r in load_labelled(out).with_format("numpy")}


def assert_same_rows(a: Path, b: Path) -> None:
    first, second = rows(a), rows(b)
    assert sorted(first) == sorted(second) and len(first) == 12
    for key, row in first.items():
        for column, value in row.items():
            assert np.array_equal(np.asarray(value), np.asarray(second[key][column])), (key, column)
    assert read_manifest(a)["fingerprint"] == read_manifest(b)["fingerprint"]  # placement is no part of the data


@pytest.fixture(scope="module")
def whole(tiny_model, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, out, "--num-prompts", "6", "--state-layer", "2")) == 0
    return out


def test_max_memory_splits_the_tiny_target_between_host_and_disk(tiny_model):
    model = load_model(ModelSpec(path=str(tiny_model), device_map="auto", max_memory={"cpu": "150KB"}), CPU)
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map  # else the split tests below would compare nothing


def test_split_target_labels_the_rows_of_the_whole_target(whole, tiny_model, prompts_file, tmp_path):
    split = tmp_path / "split"
    assert main(tiny_args(tiny_model, prompts_file, split, "--num-prompts", "6", "--state-layer", "2", *BY_MEMORY)) == 0
    assert_same_rows(whole, split)


def test_split_target_on_two_ranks_labels_the_rows_of_the_whole_target(whole, tiny_model, prompts_file, tmp_path):
    """Two gloo ranks, each with the target split by an explicit map: the models stay out of Lightning's module tree,
    which would otherwise move (and broadcast) the offloaded layers."""
    split = tmp_path / "split-ranks"
    args = tiny_args(tiny_model, prompts_file, split, "--num-prompts", "6", "--state-layer", "2", "--devices", "2",
                     "--target.device_map", MAP_FLAG)
    result = run_cli(args, env={"SPECHEADS_DEBUG": "1"})  # Lightning's rank lines, quiet otherwise
    assert result.returncode == 0, result.stderr[-2000:]
    assert "world_size=2" in result.stderr or "distributed_backend=gloo" in result.stderr
    assert_same_rows(whole, split)


def test_derived_draft_shares_the_split_targets_weights_and_offload(tiny_model):
    pair = load_pair(ModelSpec(path=str(tiny_model), device_map=SPLIT_MAP), ModelSpec(skip_layers=[2]), devices=CPU)
    target_layers, draft_layers = pair.target.model.layers, pair.draft.model.layers
    assert len(draft_layers) == 3 and draft_layers[2] is not target_layers[3]
    offloaded = target_layers[3].self_attn.q_proj
    assert offloaded.weight.device.type == "meta"  # on disk: read back by the hook for each forward
    assert draft_layers[2].self_attn.q_proj.weight is offloaded.weight
    assert draft_layers[2].self_attn.q_proj._hf_hook.weights_map is offloaded._hf_hook.weights_map


def test_refusals_name_the_problem(tiny_model, prompts_file, tmp_path, capsys):
    def refused(*flags: str) -> str:
        with pytest.raises(UsageError) as error:
            parse_config(["--target.path", "x", *flags]).validate()
        return str(error.value)

    assert "no model would use" in refused("--gpus-per-rank", "2")
    assert "accelerator is cpu" in refused("--gpus-per-rank", "2", "--target.device_map", "auto", "--accelerator", "cpu")
    assert "derived from the target" in refused("--draft.device_map", "auto")
    assert "0..3" in refused("--gpus-per-rank", "4", "--target.device_map", "auto", "--target.max_memory", '{"4": "70GiB"}')
    assert "device_map is not" in refused("--target.max_memory", '{"cpu": "1GiB"}')
    assert "GGUF" in refused("--target.path", "m.gguf", "--target.device_map", "auto", "--target.max_memory",
                             '{"0": "1GiB", "disk": "9GiB"}')
    with pytest.raises(UsageError, match="rank has 0 GPU"):
        load_kwargs(ModelSpec(path="x", device_map={"model": 0}), CPU)
    spilled = load_model(ModelSpec(path=str(tiny_model), device_map="auto", max_memory={"cpu": "150KB"}), CPU)
    with pytest.raises(UsageError, match="does not fit on the rank's GPUs"):  # as if the rank had one GPU
        check_no_spill(ModelSpec(path=str(tiny_model), device_map="auto"), spilled, RankDevices(torch.device("cuda", 0), (0,)))
    args = tiny_args(tiny_model, prompts_file, tmp_path / "gpus", "--gpus-per-rank", "2", "--target.device_map", "auto",
                     "--devices", "64")  # more than any node holds
    args[args.index("--accelerator") + 1] = "gpu"
    capsys.readouterr()
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "gpus_per_rank 2 needs 128 GPUs on each node" in error[0] and not (tmp_path / "gpus").exists()


def test_70b_config_spreads_the_target_over_four_gpus_per_rank():
    config = parse_config(["--config", str(CONFIG_70B)])
    config.validate()
    assert (config.target.path, config.draft.path) == ("meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-7b-chat-hf")
    assert config.draft.skip_layers == []  # a whole 7B draft, not the default draft's skipped layers
    assert config.target.dtype == config.draft.dtype == "bfloat16" and config.target.device_map == "auto"
    assert config.devices * config.gpus_per_rank == 8 and config.num_nodes == 1 and config.accelerator == "gpu"
    assert trainer_devices(config.devices, config.gpus_per_rank) == [0, 4]
    assert rank_devices(torch.device("cuda", 4), config.gpus_per_rank).gpus == (4, 5, 6, 7)
    weights_gb, kv_gb = 138, config.batch_size * 1536 * 0.3125 / 1024  # Llama-2-70B: 0.3125 MiB of KV a token
    assert weights_gb / config.gpus_per_rank + kv_gb / config.gpus_per_rank + 13.5 < 0.8 * 80  # first GPU of a rank
    if not torch.cuda.device_count():
        with pytest.raises(UsageError, match="needs 8 GPUs on each node"):
            check_visible_gpus(config)
