"""The typed config of one training run, written to `<run_dir>/config.json` and read by torchrun.

The field defaults are the base run config (the recipe's settings); `run_config` derives a
phase's or a fine-tune's from it, overriding only what the catalog entry sets.
`batch_size` is per rank: the effective batch is batch_size x world_size x grad_accum.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from catalog import Finetune, Phase
from sdtrain.atomic import atomic_path

DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a portrait of a woman smiling, studio lighting",
    "a red car parked on a city street at night",
    "a bowl of fruit on a wooden table",
)

Precision = Literal["auto", "bf16", "fp16", "fp32"]
PredictionType = Literal["epsilon", "v_prediction"]
LRSchedule = Literal["cosine", "constant"]


@dataclass(kw_only=True, slots=True)
class FinetuneSettings:
    """What makes a run a fine-tune (sdtrain/finetune.py); a phase's run has none.

    `phase_dir` of such a run is the fine-tune's data folder (tasks/finetune/data.py writes it).
    """

    mode: Literal["dreambooth", "inpaint"]
    base_unet: str = ""  # UNet weights to start from (a run's EMA file); "": the model's own
    prior_loss_weight: float = 0.0  # dreambooth: the class half's weight; 0: no class images
    train_text_encoder: bool = False
    inpaint_channels: int = 4  # 4: seed 000's unconditional UNet; 9: an inpainting UNet
    lora_rank: int = 0  # 0: every weight trains; else peft LoRA adapters, the base frozen
    lora_alpha: float = 0.0
    num_demo_images: int = 4  # inpaint: images of the demo grid


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # What to train, from what, where.
    phase: str
    phase_dir: str  # folder of the phase set: manifest.parquet, latents/, tokens/
    run_dir: str
    model: str  # catalog model name
    init_from: str = ""  # a previous run's final/ folder (unet.safetensors, unet_ema.safetensors)
    resume: bool = True  # continue from <run_dir>/checkpoints/latest when it exists
    # Resume on a phase set re-mixed since the checkpoint (a removal took rows out): the set's
    # digest, rows and steps may differ; the checkpoint's lineage gets a segment per set.
    resume_remixed: bool = False
    seed: int = 0

    # Schedule: total steps = per-rank batches per epoch x epochs / grad_accum (or max_steps).
    lr: float
    warmup_steps: int
    epochs: int
    max_steps: int | None = None  # caps the optimizer steps that the epochs would give
    batch_size: int  # per rank
    grad_accum: int = 1
    lr_schedule: LRSchedule = "cosine"  # cosine: warmup, then down to lr x 1e-2; constant: warmup

    # Optimizer: fused AdamW, clipped.
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float = 1.0

    # Objective.
    prediction_type: PredictionType = "epsilon"
    cfg_dropout: float
    min_snr_gamma: float
    offset_noise: float = 0.0  # std of a per-channel constant added to the noise; 0: off

    # EMA of the weights: fp32, updated every `ema_every` optimizer steps.
    ema_decay: float = 0.9999
    ema_every: int = 1
    ema_on_cpu: bool = False  # keep the shadow in host RAM (saves GPU memory, costs a copy)
    # A run started from another's final/ continues its EMA: the decay warmup goes on from the
    # steps that EMA already averaged (the recipe's intent). False: the warmup starts over,
    # and within ~100 steps the EMA holds little of the previous phase.
    ema_carry: bool = True

    # Numerics.
    precision: Precision = "auto"  # auto: bf16 where supported, else fp16 + scaler; CPU fp32
    channels_last: bool = True
    gradient_checkpointing: bool = True  # ~40% less activation memory, ~25% slower steps
    # torch.compile the UNet's training steps, a static graph per batch shape (each bucket's,
    # each short batch's), compiled in the warm-up. Off until a GPU figure shows it pays
    # (docs/benchmarks.md): SD1.5's graph took over 90 s to compile on an H200.
    compile: bool = False
    # One forward and backward of every batch shape before step 1, so compiling and cuDNN's
    # autotuning are paid up front, not in each bucket's first steps; None: on a GPU or when
    # compiling (elsewhere it changes nothing but time).
    warm_up: bool | None = None
    deterministic: bool = False  # deterministic kernels: bitwise-reproducible runs on CPU
    # A step whose loss or gradient norm is NaN/inf updates neither the weights nor the EMA
    # (counted); this many in a row stop the run (the last checkpoint holds finite weights).
    max_nonfinite_steps: int = 10

    # Data.
    latents_in_ram: bool = False  # else memory-mapped
    load_threads: int = 16  # threads that read the latents into RAM
    num_workers: int = 0  # DataLoader workers per rank; a row is two array lookups
    num_val_samples: int = 1000  # rows held out of training for the validation loss
    # Each row is read mirrored (its latents' view 1) with this probability, drawn per
    # (seed, epoch, row); > 0 needs latents encoded with flips (docs/training-data.md).
    flip_p: float = 0.0
    # Latents that hold the posterior's log-variance are drawn (mean + std * eps, per (seed,
    # epoch, row)); False: always the mean. Latents without it are always the mean.
    sample_latents: bool = True

    # Checkpoints: a rolling `latest`, periodic ones kept, `best` by validation loss.
    checkpoint_every: int = 1500  # 0: only at the end and when interrupted
    keep_every: int = 10_000  # a checkpoint every N steps is kept for good; 0: none
    validate_every: int = 2000  # EMA validation loss every N steps (and at the end); 0: end only
    # Seconds torchrun waits for the ranks after a SIGTERM (cancel) before it kills them: the
    # stop checkpoint must be written within it (SD1.5, 13.8 GB: docs/benchmarks.md).
    stop_grace_s: int = 120

    # Monitoring.
    log_every: int = 10
    sample_every: int = 2000  # 0: a sample grid only at the end
    sample_prompts: tuple[str, ...] = DEFAULT_PROMPTS
    negative_prompt: str = ""
    sample_steps: int = 20  # DDIM steps of the sample grids
    guidance_scale: float = 7.5
    wandb_project: str = ""  # log to Weights & Biases too (needs `pip install wandb`)

    # Captions at train time (sdtrain.captions; the catalog phase's fields of the same names):
    # captions.arrow tokenized per batch instead of the stored ids, one caption drawn of several
    # and its tags after the first `keep_tokens` shuffled (probability `shuffle_tags_p`) and
    # each dropped (probability `tag_dropout`), per (seed, epoch, row).
    train_time_captions: bool = False
    shuffle_tags_p: float = 0.0
    keep_tokens: int = 0
    tag_separator: str = ", "
    tag_dropout: float = 0.0

    finetune: FinetuneSettings | None = None  # a fine-tune's mode; None: a curriculum phase

    def to_json(self, path: str | Path) -> None:
        with atomic_path(Path(path)) as tmp:
            tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        fields = json.loads(Path(path).read_text())
        if fields.get("finetune") is not None:
            fields["finetune"] = FinetuneSettings(**fields["finetune"])
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


# A catalog entry's settings that the run config holds under the same names. A value the
# entry leaves unset (None, or no prompts) keeps the base run config's.
PHASE_FIELDS = (
    "seed",
    "lr",
    "warmup_steps",
    "epochs",
    "max_steps",
    "batch_size",
    "grad_accum",
    "cfg_dropout",
    "min_snr_gamma",
    "sample_prompts",
    "prediction_type",
    "offset_noise",
    "ema_every",
    "ema_on_cpu",
    "ema_carry",
    "max_nonfinite_steps",
    "channels_last",
    "gradient_checkpointing",
    "compile",
    "latents_in_ram",
    "num_val_samples",
    "flip_p",
    "sample_latents",
    "checkpoint_every",
    "keep_every",
    "validate_every",
    "log_every",
    "sample_every",
    "train_time_captions",
    "shuffle_tags_p",
    "keep_tokens",
    "tag_separator",
    "tag_dropout",
)
FINETUNE_FIELDS = (
    "seed",
    "lr",
    "lr_schedule",
    "warmup_steps",
    "batch_size",
    "max_grad_norm",
    "checkpoint_every",
    "log_every",
    "sample_every",
    "sample_steps",
    "channels_last",
    "gradient_checkpointing",
)
# What every fine-tune run is, whatever its entry says: its `steps` end it, the epochs only
# bound the loader (a few images, many steps); the plain MSE (no min-SNR weights, no caption
# dropout); no EMA of its own (sdtrain/finetune.py); no held-out rows, no checkpoint kept.
FINETUNE_RUN = dict(
    epochs=1_000_000,
    cfg_dropout=0.0,
    min_snr_gamma=0.0,
    ema_decay=0.0,
    ema_carry=False,
    num_val_samples=0,
    keep_every=0,
    validate_every=0,
)


def run_config(
    entry: Phase | Finetune,
    *,
    name: str,
    phase_dir: str | Path,
    run_dir: str | Path,
    model: str,
    init_from: str | Path = "",
    **derived,
) -> TrainConfig:
    """The one builder of a run config: the base run config with a catalog phase's or
    fine-tune's settings, and what the caller derives from elsewhere (`derived`: a fine-tune's
    base weights and prompts); a setting given twice fails instead of one hiding the other."""
    if isinstance(entry, Phase):
        names = PHASE_FIELDS
    else:
        names, derived = FINETUNE_FIELDS, {**FINETUNE_RUN, "max_steps": entry.steps, **derived}
    settings = {f: v for f in names if (v := getattr(entry, f)) is not None and v != ()}
    return TrainConfig(
        phase=name,
        phase_dir=str(phase_dir),
        run_dir=str(run_dir),
        model=model,
        init_from=str(init_from),
        **settings,
        **derived,
    )


def run_config_for_phase(
    phase: Phase,
    *,
    phase_dir: str | Path,
    run_dir: str | Path,
    init_from: str | Path = "",
    **derived,
) -> TrainConfig:
    """The base run config with a catalog phase's settings; `init_from`: the previous final/;
    `derived`: what the caller derives (`resume_remixed` after a removal re-linked the set)."""
    return run_config(
        phase,
        name=phase.name,
        phase_dir=phase_dir,
        run_dir=run_dir,
        model=phase.model,
        init_from=init_from,
        **derived,
    )
