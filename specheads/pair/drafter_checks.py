"""A drafter folder (EAGLE-3 or DSpark, speculators' format) checked against the target it will draft for, when it is
loaded and before any decoding (`specheads.pair.eagle3.load_drafter`, `specheads.pair.dspark.load_drafter`; the demo
checks its `--eagle3` folder against the target's config before its stages).

Refused in one line each, naming the file and the fix: a folder that is not a drafter (no config.json or
model.safetensors, a config.json that is not JSON, a safetensors file that cannot be read); a drafter made for another
target (its hidden size or vocabulary differ from the target's, or it reads layers the target does not have: layer id
i is the stream entering layer i, 0..L, and nothing past L is remapped); a draft vocabulary whose d2t map is missing
(a reduced vocabulary would otherwise read as the identity), of the wrong length, maps outside the target's
vocabulary or twice onto one token, or disagrees with t2d; a DSpark block as long as the target's context or longer
(its mask tokens sit past the context: a block of 100 000 would allocate tens of GB mid-decode); a tensor whose shape
its config.json does not make; and a weight that is NaN or infinite (every candidate would then be accepted:
min(1, p/q) reads 1 where q is NaN).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specheads.plumbing.errors import UsageError

LAYER_IDS = {"eagle3": "eagle_aux_hidden_state_layer_ids", "dspark": "aux_hidden_state_layer_ids"}
"""The config.json key naming the target layers each algorithm reads."""
REMAKE = "give a drafter trained for this target (`specheads train drafter --target.path ...`)"


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must fit in its target: hidden size, vocabulary (embedding rows), decoder layers, context."""

    hidden: int
    vocabulary: int
    layers: int
    context: int


def target_shape(target: Any) -> TargetShape:
    """The shape of a loaded target model, or of a target's transformers config (without its weights)."""
    config = getattr(target, "config", target)
    context = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
    if isinstance(target, torch.nn.Module):
        rows = target.get_input_embeddings().weight.shape[0]
        return TargetShape(int(config.hidden_size), int(rows), len(target.get_decoder().layers), context)
    return TargetShape(int(config.hidden_size), int(config.vocab_size), int(config.num_hidden_layers), context)


def read_config(folder: str | Path, algorithm: str) -> dict[str, Any]:
    """A drafter folder's config.json, refused in one line unless the folder holds config.json (a JSON object naming
    `algorithm` as its speculators_model_type, with a transformer_layer_config) and model.safetensors."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise UsageError(f"{folder} is not a drafter folder (config.json and model.safetensors); give the folder "
                         "`specheads train drafter` or speculators wrote")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"{folder}/config.json cannot be read as JSON ({' '.join(str(error).split())[:120]}); give "
                         "the folder a drafter was saved to, unedited") from None
    if not isinstance(config, dict):
        raise UsageError(f"{folder}/config.json is not a JSON object; give the folder a drafter was saved to")
    kind = config.get("speculators_model_type")
    if kind != algorithm:
        raise UsageError(f"{folder}/config.json names speculators_model_type {kind!r}, not {algorithm!r}; give the folder "
                         f"of a {algorithm} drafter")
    if not isinstance(config.get("transformer_layer_config"), dict):
        raise UsageError(f"{folder}/config.json has no transformer_layer_config; give a folder speculators or "
                         "`specheads train drafter` wrote")
    return config


def whole(value: Any) -> bool:
    """Whether `value` is an integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_fits_target(config: dict[str, Any], algorithm: str, target: TargetShape, folder: str | Path) -> None:
    """Refuse a drafter whose config.json was made for another target: hidden size, vocabulary, the layers it reads,
    its draft vocabulary's size and (DSpark) a block the target's context cannot hold."""
    where, layer = f"{folder}/config.json", config["transformer_layer_config"]
    hidden, vocabulary = layer.get("hidden_size"), layer.get("vocab_size")
    if hidden != target.hidden or config.get("target_hidden_size") not in (None, target.hidden):
        raise UsageError(f"{where}: the drafter was made for a target of hidden size "
                         f"{config.get('target_hidden_size') or hidden}, this target's is {target.hidden}; {REMAKE}")
    if vocabulary != target.vocabulary:
        raise UsageError(f"{where}: the drafter was made for a target of {vocabulary} tokens, this target has "
                         f"{target.vocabulary}; {REMAKE}")
    ids = config.get(LAYER_IDS[algorithm])
    if (not isinstance(ids, list) or not ids or not all(whole(i) and 0 <= i <= target.layers for i in ids)
            or len(set(ids)) != len(ids)):
        raise UsageError(f"{where}: {LAYER_IDS[algorithm]} {ids} must be distinct layers of this target, 0..{target.layers} "
                         f"(id i reads the stream entering layer i; {target.layers} the last layer's output); {REMAKE}")
    size = config.get("draft_vocab_size")
    if not whole(size) or not 0 < size <= target.vocabulary:
        raise UsageError(f"{where}: draft_vocab_size {size} must be between 1 and the target's vocabulary "
                         f"({target.vocabulary}); {REMAKE}")
    if algorithm == "dspark":
        block = config.get("block_size")
        if not whole(block) or not 0 < block < target.context:
            raise UsageError(f"{where}: block_size {block} must be between 1 and {target.context - 1} (the target's "
                             f"context is {target.context} positions, and a block's mask tokens sit past the prompt); "
                             "give a drafter trained with a block that fits")


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors, refused in one line where the file cannot be read."""
    from safetensors.torch import load_file

    path = Path(folder) / "model.safetensors"
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own SafetensorError, OSError or ValueError
        raise UsageError(f"{path} cannot be read ({' '.join(str(error).split())[:120]}); give the folder a drafter "
                         "was saved to, complete") from None


def check_finite(tensors: dict[str, torch.Tensor], folder: str | Path) -> None:
    """Refuse a weight holding NaN or infinity."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UsageError(f"{folder}/model.safetensors: {name} holds {bad} NaN or infinite values (a drafter of NaN "
                             "accepts every candidate); retrain it, or give a drafter whose weights are finite")


def check_vocab_maps(tensors: dict[str, torch.Tensor], config: dict[str, Any], target: TargetShape,
                     folder: str | Path) -> None:
    """Refuse a draft vocabulary map that is missing where the vocabulary is reduced, or maps a draft row outside the
    target's vocabulary, twice onto one token, or onto tokens t2d does not mark."""
    where, size = f"{folder}/model.safetensors", config["draft_vocab_size"]
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if size == target.vocabulary:
        return
    if d2t is None or t2d is None:
        raise UsageError(f"{where}: the drafter predicts over {size} of the target's {target.vocabulary} tokens but holds "
                         f"no {'d2t' if d2t is None else 't2d'} map (read as the identity, every draft row would be the "
                         "wrong token); give the folder as it was saved, with its d2t and t2d")
    if d2t.dim() != 1 or d2t.numel() != size or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise UsageError(f"{where}: d2t must hold one integer offset per draft token ({size}), it is {d2t.dtype} of "
                         f"shape {list(d2t.shape)}; give the folder as it was saved")
    tokens = torch.arange(size) + d2t.long()
    if bool((tokens < 0).any()) or bool((tokens >= target.vocabulary).any()):
        bad = int(((tokens < 0) | (tokens >= target.vocabulary)).nonzero()[0])
        raise UsageError(f"{where}: d2t maps draft token {bad} to {int(tokens[bad])}, outside the target's vocabulary "
                         f"(0..{target.vocabulary - 1}); give the folder as it was saved")
    if tokens.unique().numel() != size:
        raise UsageError(f"{where}: d2t maps two draft tokens onto one target token (q would count it twice); give the "
                         "folder as it was saved")
    if t2d.numel() != target.vocabulary or not bool(t2d.flatten().bool()[tokens].all()) or int(t2d.bool().sum()) != size:
        raise UsageError(f"{where}: t2d does not mark exactly the {size} target tokens d2t maps to; give the folder as "
                         "it was saved")


def check_drafter_files(folder: str | Path, algorithm: str, target: TargetShape) -> dict[str, list[int]]:
    """Every check of this module on a drafter folder against `target`, before the drafter is built; the shapes of
    its tensors by name (`check_state_fits` compares them with the built drafter's)."""
    config = read_config(folder, algorithm)
    check_fits_target(config, algorithm, target, folder)
    tensors = read_tensors(folder)
    check_finite(tensors, folder)
    check_vocab_maps(tensors, config, target, folder)
    return {name: list(tensor.shape) for name, tensor in tensors.items()}


def check_state_fits(drafter: torch.nn.Module, shapes: dict[str, list[int]], folder: str | Path) -> None:
    """Refuse a safetensors file whose tensors have shapes other than the drafter its config.json builds."""
    for name, expected in ((n, list(t.shape)) for n, t in drafter.state_dict().items()):
        if name in shapes and shapes[name] != expected:
            raise UsageError(f"{folder}/model.safetensors: {name} is {shapes[name]}, its config.json makes {expected}; "
                             "the files do not belong together, give the folder as it was saved")


def check_drafter_for(folder: str | Path, algorithm: str, target_spec: Any) -> None:
    """`check_drafter_files` against the target a model spec names, read from its config alone (no weights loaded)."""
    from transformers import AutoConfig

    from specheads.pair.models import resolve_source

    read_config(folder, algorithm)  # a folder that is no drafter is refused without looking for the target
    source = resolve_source(target_spec)
    try:
        config = AutoConfig.from_pretrained(source.location, revision=source.revision, gguf_file=source.gguf_file)
    except (OSError, ValueError) as error:
        raise UsageError(f"the target {target_spec.path}'s config cannot be read ({' '.join(str(error).split())[:120]})"
                         "; give a local folder, a .gguf file, a Hub id or embedded:smollm2") from None
    check_drafter_files(folder, algorithm, target_shape(getattr(config, "text_config", config)))


def loaded_from(load: Any, folder: str | Path, target: torch.nn.Module, algorithm: str, config_class: str,
                build: Any) -> torch.nn.Module:
    """`load(folder, target, algorithm, config_class, build)` (`specheads.pair.drafters.load_drafter`), a config.json
    speculators' classes refuse said in one line; the drafter remembers its folder (`loaded_from`), which is what
    a head trained on its labels records (`specheads.decoding.drafters.feature_drafter_of`)."""
    from pydantic import ValidationError

    try:
        drafter = load(folder, target, algorithm, config_class, build)
    except ValidationError as error:
        problem = error.errors()[0] if error.errors() else {}
        field = ".".join(str(part) for part in problem.get("loc", ())) or "a field"
        raise UsageError(f"{folder}/config.json: {field}: {problem.get('msg', 'invalid')}; give a folder speculators or "
                         "`specheads train drafter` wrote") from None
    drafter.loaded_from = Path(folder).resolve()
    return drafter
