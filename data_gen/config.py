"""The `specheads gen` configuration: one dataclass tree, read from YAML and overridden by flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from jsonargparse.typing import ClosedUnitInterval, PositiveInt

from specheads.data_gen.models import ModelSpec
from specheads.errors import UsageError
from specheads.sampling import SamplingTransform


@dataclass
class SamplingConfig:
    """The decoding's sampling transform and response length (T = 0 means greedy)."""

    temperature: float = 1.0  # the three transform values are checked by SamplingTransform itself
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: PositiveInt = 128

    def transform(self) -> SamplingTransform:
        """The transform p and q are labelled under (validates the values)."""
        return SamplingTransform(self.temperature, self.top_k, self.top_p)


@dataclass
class MixingConfig:
    """Token mixing: each position keeps the target token with probability `target_ratio`.

    `schedule`, when given, replaces the single ratio by a per-row ratio taken in turn from the list
    (for SPRINTER's prefix kinds, e.g. [0.0, 1.0, 0.15]: draft-only, target-only and mixed rows).
    """

    target_ratio: ClosedUnitInterval = 0.15
    schedule: list[ClosedUnitInterval] | None = None

    def ratios(self) -> list[float]:
        """The per-row ratios, cycled over rows."""
        return [float(r) for r in self.schedule] if self.schedule else [float(self.target_ratio)]


@dataclass
class GenConfig:
    """Everything `specheads gen` needs. Flags override the YAML (`--num-prompts 8`, `--sampling.temperature 0`)."""

    target: ModelSpec = field(default_factory=lambda: ModelSpec(path="embedded:smollm2"))
    draft: ModelSpec = field(default_factory=lambda: ModelSpec(skip_layers=[20, 21]))
    prompts: str = "builtin"
    prompts_split: str = "train"
    prompts_column: str | None = None
    num_prompts: PositiveInt | None = None
    samples_per_prompt: PositiveInt = 1
    responses: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    store_features: bool = True
    state_layer: PositiveInt | None = None
    long_prompts: Literal["skip", "fail"] = "skip"
    max_prompt_tokens: PositiveInt | None = None
    batch_size: PositiveInt = 8
    rows_per_shard: PositiveInt = 32
    label_chunk_tokens: PositiveInt = 256
    out: str = "runs/gen"
    overwrite: bool = False
    seed: int = 0
    devices: PositiveInt = 1
    accelerator: str = "auto"
    num_nodes: PositiveInt = 1
    progress: bool = True

    def validate(self) -> None:
        """Refuse combinations that cannot work, before anything is loaded or written (each field's own range is in
        its type, checked when the config is parsed)."""
        if self.rows_per_shard % self.batch_size:
            raise UsageError(f"rows_per_shard ({self.rows_per_shard}) must be a multiple of batch_size ({self.batch_size})")
        if self.sampling.temperature == 0 and self.samples_per_prompt > 1 and self.responses is None:
            raise UsageError(f"at temperature 0 every sample of a prompt is the same greedy response; set "
                             f"samples_per_prompt to 1 (got {self.samples_per_prompt}) or sample with temperature > 0")
        self.sampling.transform()

    def as_dict(self) -> dict:
        """Plain dict (for the manifest)."""
        return asdict(self)
