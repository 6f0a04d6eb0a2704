"""Every YAML in configs/gen parses into a valid GenConfig; prompt sources load."""

from pathlib import Path

import pytest

from specheads.data_gen.cli import parse_config
from specheads.dataset.prompts import load_prompts

CONFIGS = sorted((Path(__file__).parents[1] / "configs" / "gen").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_gen_config_is_valid(path):
    config = parse_config(["--config", str(path)])
    config.validate()
    assert config.target.path and config.sampling.max_new_tokens > 0


def test_cluster_config_names_a_real_pair():
    config = parse_config(["--config", str(Path(__file__).parents[1] / "configs/gen/smollm2-135m-for-1.7b.yaml")])
    assert config.target.path == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    assert config.draft.path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config.devices * config.num_nodes == 8 and config.accelerator == "gpu"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_config_naming_its_own_draft_model_skips_none_of_its_layers(path):
    # the draft's default skip_layers (20, 21) derives the embedded pair's self-speculative draft; a separate draft
    # model that inherited it would silently be that model minus two layers
    config = parse_config(["--config", str(path)])
    if config.draft.path is not None:
        assert config.draft.skip_layers == []


def test_flags_override_the_yaml():
    config = parse_config(["--config", str(CONFIGS[0]), "--num-prompts", "3", "--temperature", "0"])
    assert config.num_prompts == 3 and config.sampling.temperature == 0


def test_builtin_prompts_cover_every_kind():
    prompts = load_prompts("builtin")
    assert len(prompts) == 200 and len({p.id for p in prompts}) == 200
    kinds = {p.id.rsplit("-", 1)[0] for p in prompts[:5]}
    assert kinds == {"chat", "explanation", "code", "math", "summarisation"}


def test_hf_dataset_prompts_from_a_local_folder(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"instruction": ["Say hi.", "Count to 3."], "id": ["a", "b"]}).save_to_disk(tmp_path / "ds")
    prompts = load_prompts(str(tmp_path / "ds"), column="instruction")
    assert [p.id for p in prompts] == ["a", "b"] and prompts[1].messages == (("user", "Count to 3."),)
    (tmp_path / "p.csv").write_text("prompt\nHello there\n")
    assert load_prompts(str(tmp_path / "p.csv"))[0].messages == (("user", "Hello there"),)


def test_configs_are_found_by_name_among_the_packaged_ones(tmp_path, monkeypatch, capsys):
    from importlib.resources import files

    from specheads.cli import main
    from specheads.plumbing.config_files import resolve_config, with_configs_resolved
    from specheads.plumbing.errors import UsageError

    monkeypatch.chdir(tmp_path)  # no configs/ folder here: only the installed package data can answer
    packaged = Path(str(files("specheads.configs")))
    for value in ("smollm2-demo", "smollm2-demo.yaml", "gen/smollm2-demo.yaml", "configs/gen/smollm2-demo.yaml"):
        assert Path(resolve_config(value, "gen")) == packaged / "gen" / "smollm2-demo.yaml"
    source = Path(__file__).parents[1] / "configs/train/specdecpp.yaml"
    assert Path(resolve_config("specdecpp", "train")).read_text() == source.read_text()
    mine = tmp_path / "smollm2-demo"
    mine.write_text("num_prompts: 3\n")  # a file of the user's wins over a packaged name
    assert with_configs_resolved(["--config", "smollm2-demo", "--config=sprinter"], "train") == [
        "--config", "smollm2-demo", "--config=" + str(packaged / "train" / "sprinter.yaml")]
    with pytest.raises(UsageError, match="nor one of the gen configs that ship with specheads .*smollm2-demo-16x"):
        resolve_config("no-such-config", "gen")
    assert parse_config(with_configs_resolved(["--config", "smollm2-demo-16x"], "gen")).samples_per_prompt == 16
    assert main(["gen", "--config", "no-such-config"]) == 2 and "no config 'no-such-config'" in capsys.readouterr().err
