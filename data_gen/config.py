"""The `specheads gen` configuration: one dataclass tree, read from YAML and overridden by flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from specheads.data_gen.models import ModelSpec
from specheads.errors import UsageError
from specheads.sampling import SamplingTransform


@dataclass
class SamplingConfig:
    """The decoding's sampling transform and response length (T = 0 means greedy)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128

    def transform(self) -> SamplingTransform:
        """The transform p and q are labelled under (validates the values)."""
        return SamplingTransform(self.temperature, self.top_k, self.top_p)


@dataclass
class MixingConfig:
    """Token mixing: each position keeps the target token with probability `target_ratio`.

    `schedule`, when given, replaces the single ratio by a per-row ratio taken in turn from the list
    (for SPRINTER's prefix kinds, e.g. [0.0, 1.0, 0.15]: draft-only, target-only and mixed rows).
    """

    target_ratio: float = 0.15
    schedule: list[float] | None = None

    def ratios(self) -> list[float]:
        """The per-row ratios, cycled over rows."""
        ratios = list(self.schedule) if self.schedule else [self.target_ratio]
        if not all(0.0 <= r <= 1.0 for r in ratios):
            raise UsageError(f"mixing ratios must lie in [0, 1], got {ratios}")
        return ratios


@dataclass
class GenConfig:
    """Everything `specheads gen` needs. Flags override the YAML (`--num-prompts 8`, `--sampling.temperature 0`)."""

    target: ModelSpec = field(default_factory=lambda: ModelSpec(path="embedded:smollm2"))
    draft: ModelSpec = field(default_factory=lambda: ModelSpec(skip_layers=[20, 21]))
    prompts: str = "builtin"
    prompts_split: str = "train"
    prompts_column: str | None = None
    num_prompts: int | None = None
    samples_per_prompt: int = 1
    responses: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    store_features: bool = True
    state_layer: int | None = None
    long_prompts: Literal["skip", "fail"] = "skip"
    max_prompt_tokens: int | None = None
    batch_size: int = 8
    rows_per_shard: int = 32
    label_chunk_tokens: int = 256
    out: str = "runs/gen"
    overwrite: bool = False
    seed: int = 0
    devices: int = 1
    accelerator: str = "auto"
    num_nodes: int = 1
    progress: bool = True

    def validate(self) -> None:
        """Refuse values that cannot work, before anything is loaded or written."""
        positive = {"samples_per_prompt": self.samples_per_prompt, "batch_size": self.batch_size,
                    "rows_per_shard": self.rows_per_shard, "label_chunk_tokens": self.label_chunk_tokens,
                    "sampling.max_new_tokens": self.sampling.max_new_tokens, "devices": self.devices,
                    "num_nodes": self.num_nodes}
        for name, value in positive.items():
            if value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if self.state_layer is not None and (isinstance(self.state_layer, bool) or self.state_layer < 1):
            raise UsageError(f"state_layer must be a decoder layer count >= 1 or null (the last layer), got {self.state_layer}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UsageError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if self.rows_per_shard % self.batch_size:
            raise UsageError(f"rows_per_shard ({self.rows_per_shard}) must be a multiple of batch_size ({self.batch_size})")
        if self.sampling.temperature == 0 and self.samples_per_prompt > 1 and self.responses is None:
            raise UsageError(f"at temperature 0 every sample of a prompt is the same greedy response; set "
                             f"samples_per_prompt to 1 (got {self.samples_per_prompt}) or sample with temperature > 0")
        self.sampling.transform()
        self.mixing.ratios()

    def as_dict(self) -> dict:
        """Plain dict (for the manifest)."""
        return asdict(self)
