"""The typed config of one training run, written to `<run_dir>/config.json` and read by torchrun.

`batch_size` is per rank: the effective batch is batch_size x world_size x grad_accum, so the
same config means a different effective batch on a different number of GPUs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tasks.shards import atomic_path

DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a portrait of a woman smiling, studio lighting",
    "a red car parked on a city street at night",
    "a bowl of fruit on a wooden table",
)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    phase: str
    phase_dir: str  # folder of the phase set: manifest.parquet, latents/, tokens/
    run_dir: str
    model: str  # catalog model name
    lr: float
    warmup_steps: int
    epochs: int
    max_steps: int | None = None  # caps the optimizer steps that the epochs would give
    batch_size: int  # per rank
    grad_accum: int = 1
    cfg_dropout: float
    min_snr_gamma: float
    seed: int = 0
    init_from: str = ""  # a previous run's final/ folder (unet.safetensors, unet_ema.safetensors)
    log_every: int = 5
    sample_every: int = 0  # 0: a sample grid only at the end
    sample_prompts: tuple[str, ...] = DEFAULT_PROMPTS
    sample_steps: int = 20  # DDIM steps of the sample grids
    guidance_scale: float = 7.5
    num_workers: int = 0  # DataLoader workers per rank; rows are memory-mapped, so 0 is cheap

    def to_json(self, path: str | Path) -> None:
        with atomic_path(Path(path)) as tmp:
            tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        fields = json.loads(Path(path).read_text())
        fields["sample_prompts"] = tuple(fields.get("sample_prompts", DEFAULT_PROMPTS))
        return cls(**fields)
