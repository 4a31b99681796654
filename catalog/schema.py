"""Typed catalog entries: sources, filter profiles, datasets, phases, models, fine-tunes.

Entries are frozen dataclasses built from YAML by `catalog.loader`; the loader, not these
classes, owns error messages (file, field, value), so the classes stay plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SourceKind = Literal["url", "archive", "folder", "demo"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Source:
    """Where a source's data lives and how it is laid out.

    kind: `url` sources ship metadata with image URLs (filtered before any image is fetched);
    `archive` sources ship images in archives; `folder` is a local tree; `demo` is generated.
    """

    name: str
    kind: SourceKind
    location: str
    license: str
    homepage: str = ""
    revision: str = ""
    samples_per_shard: int = 10_000
    resolution: int = 512  # shards: short side at most this, aspect kept
    model: str = "sd15"  # whose VAE encodes this source's latents
    profile: str  # the loosest profile the source is built at; stricter views query over it
    # Layout of an archive/folder source (tasks.sources.adapters): diffusiondb, journeydb, vggface2,
    # coco or local; "" means the source's own name.
    adapter: str = ""
    # URL sources: fetch URLs whose host is this machine or a private network (loopback,
    # 10/8, 172.16/12, 192.168/16, link-local, IPv6 ULA, localhost). Off for real sources (a
    # metadata row must not make the fetcher read internal services); on for the demo.
    # Checked on the URLs (fetch-metadata) and where each download connects, redirects included.
    allow_private_hosts: bool = False
    # Encode also stores the posterior's log-variance (latents of 8 channels), so a phase may
    # draw a latent from the posterior instead of taking its mean (docs/training-data.md).
    latent_sampling: bool = False
    options: dict = field(default_factory=dict)


@dataclass(kw_only=True, slots=True, frozen=True)
class FilterProfile:
    """What a sample must meet to be kept. None (or empty) disables a rule.

    Score thresholds apply to the metadata's scores or, where the metadata has none, to those
    the score stage computed from the pixels. Duplicates are judged among the rows that pass
    every other rule, level by level in the order url, sha256, phash, semantic; a near or
    semantic duplicate is dropped only as a copy of a row that is kept (`tasks.curation.survivors`).
    """

    name: str
    min_aesthetic: float | None = None
    min_similarity: float | None = None
    max_pwatermark: float | None = None
    max_punsafe: float | None = None
    min_side: int = 0
    min_caption_words: int = 0
    caption_blocklist: tuple[str, ...] = ()  # words or phrases, whole-word, any case
    url_blocklist: tuple[str, ...] = ()  # domains, their subdomains included
    min_values: dict = field(default_factory=dict)  # any other numeric column -> its minimum
    max_values: dict = field(default_factory=dict)  # any other numeric column -> its maximum
    dedup: tuple[str, ...] = ("url", "sha256")  # of: url, sha256, phash, semantic
    phash_distance: int = 4  # near duplicates: pHash Hamming distance <= this
    semantic_threshold: float = 0.95  # semantic duplicates: embedding cosine >= this
    # Nearest other clusters a row near a boundary also visits in semantic dedup. The stage's
    # record and waterfall give the rows that could lose a duplicate (`semantic_beyond_visits`)
    # and, from a sample of them, the rows estimated to have lost one
    # (`semantic_missed_estimate`): more visits find those, at more work per cluster.
    semantic_visits: int = 2
    # Semantic dedup before fetch (URL sources whose `options.embeddings` names a folder of
    # LAION's published image embeddings; docs/sources.md): filtered rows that are copies, at
    # `semantic_threshold`, of a better-ranked row are never fetched (`semantic_prefetch`).
    semantic_prefetch: bool = False
    # Tagged local folders (JSON metadata with `tags` and `score`, as in seed 002): an image with
    # any of `exclude_tags` is dropped (`excluded_tag`); `remove_tags` are left out of the
    # caption; `tag_replacements` rewrite substrings of each tag (in order); the caption is the
    # tags joined by `tag_separator`; a raw score under `abs_min_score` is dropped
    # (`abs_min_score`); the score plus `tag_bonus_scores` (tag -> bonus, each of its tags once)
    # under `min_score` is dropped (`min_score`); `score_tags` (thresholds, highest first): the
    # first one the raw score exceeds puts `scr<threshold>` first in the caption.
    exclude_tags: tuple[str, ...] = ()
    remove_tags: tuple[str, ...] = ()
    tag_replacements: dict = field(default_factory=dict)
    tag_separator: str = ", "
    min_score: float | None = None
    abs_min_score: float | None = None
    tag_bonus_scores: dict = field(default_factory=dict)
    score_tags: tuple[float, ...] = ()
    # Scoring models (models.yaml, kind: scoring) that score a source built at this profile
    # from its pixels, in a score stage after fetch-images; "": the source is not scored.
    scorer: str = ""


@dataclass(kw_only=True, slots=True, frozen=True)
class Dataset:
    """A named view over a source: the source's samples that pass a profile."""

    name: str
    source: str
    profile: str


@dataclass(kw_only=True, slots=True, frozen=True)
class MixEntry:
    """One dataset's share of a phase: an absolute `count` or a `ratio` of the phase total."""

    dataset: str
    count: int | None = None
    ratio: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Phase:
    """A curriculum phase: a seeded mix of datasets plus its training settings."""

    name: str
    description: str = ""
    mix: tuple[MixEntry, ...]
    total: int | None = None  # required when the mix uses ratios
    # A dataset with fewer encoded samples than its share fails the phase (before training),
    # naming requested vs available, unless allowed: true (take what there is), or a fraction
    # (each dataset must hold at least that share of what it was asked for). With ratios, a
    # short dataset's shortfall goes to the others in proportion to their ratios.
    allow_short: bool | float = False
    model: str
    init_from: str | None = None  # previous phase whose final weights this one starts from
    lr: float
    warmup_steps: int
    epochs: int
    max_steps: int | None = None  # caps the run (demo, smoke tests)
    cfg_dropout: float
    min_snr_gamma: float
    batch_size: int
    grad_accum: int = 1
    seed: int = 0
    # Nodes the phase trains on, every GPU of each (above 1: through the Ray cluster, see
    # docs/scale-out.md); the curriculum flow's `nodes` parameter overrides it.
    nodes: int = 1
    sample_prompts: tuple[str, ...] = ()  # prompts of the sample grids; empty: the trainer's
    # Training settings a phase may change; null keeps the base run config's value
    # (`sdtrain.config.TrainConfig`, which documents each).
    prediction_type: Literal["epsilon", "v_prediction"] | None = None
    offset_noise: float | None = None
    ema_every: int | None = None
    ema_on_cpu: bool | None = None
    ema_carry: bool | None = None  # continue init_from's EMA (default) or restart its warmup
    max_nonfinite_steps: int | None = None
    channels_last: bool | None = None
    gradient_checkpointing: bool | None = None
    compile: bool | None = None  # torch.compile the UNet (sdtrain/config.py: off)
    latents_in_ram: bool | None = None
    num_val_samples: int | None = None  # rows held out of the mix for the validation loss
    # A row is read mirrored with this probability, per (seed, epoch, row); above 0, encode
    # stores the latents of each image's mirror too (docs/training-data.md).
    flip_p: float = 0.0
    sample_latents: bool = True  # draw latents whose source keeps the posterior's log-variance
    checkpoint_every: int | None = None  # rolling `latest` checkpoint every N steps
    keep_every: int | None = None  # checkpoints kept forever every N steps
    validate_every: int | None = None  # validation loss + `best` checkpoint every N steps
    log_every: int | None = None
    sample_every: int | None = None
    # The eval set (eval.yaml) the phase is evaluated on after training; "": not evaluated.
    eval_set: str = "default"
    # Captions at train time (docs/training-data.md): mix writes `captions.arrow` and the loader
    # tokenizes each batch, drawn per (seed, epoch, row): one caption of several; with
    # probability `shuffle_tags_p` the tags (split on `tag_separator`) after the first
    # `keep_tokens` are shuffled; each of those is dropped with probability `tag_dropout`.
    # The augmentation settings need `train_time_captions: true`.
    train_time_captions: bool = False
    shuffle_tags_p: float = 0.0
    keep_tokens: int = 0
    tag_separator: str = ", "
    tag_dropout: float = 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Model:
    """The three networks and tokenizer of an SD1.x model.

    Each network is either `pretrained` (a local folder or Hugging Face repo id, loaded with
    `local_files_only` unless downloads are enabled) or built from `*_config` with random
    weights (the tiny twins used by tests and the demo).
    """

    name: str
    resolution: int  # image side in pixels; latents are resolution / 8
    scaling_factor: float = 0.18215
    unet_config: dict = field(default_factory=dict)
    unet_pretrained: str = ""
    vae_config: dict = field(default_factory=dict)
    vae_pretrained: str = ""
    text_config: dict = field(default_factory=dict)
    text_pretrained: str = ""
    # Aspect-ratio buckets ({area, step, min_side, max_side, max_aspect}: catalog.buckets); None:
    # one bucket, the `resolution` square.
    buckets: dict | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class ScoringModel:
    """The networks of the score stage, as LAION scored LAION-5B (models.yaml, `kind: scoring`).

    `embed_*`: the open_clip model whose L2-normalized image embedding feeds the aesthetic and
    NSFW heads and semantic dedup (ViT-L/14); `similarity_*`: the one whose image-caption
    cosine is `similarity` (ViT-B/32); `watermark_*`: the timm classifier. A network is an
    architecture name, or a custom open_clip `*_config` (the tiny twins). Weights load from the
    local `*_weights` files (relative paths: under `SDPIPE_WEIGHTS`, default `./weights`) unless
    `random_weights` (tests, the demo, benchmarks).
    """

    name: str
    kind: Literal["scoring"]
    random_weights: bool = False
    embed_model: str = "ViT-L-14-quickgelu"
    embed_config: dict = field(default_factory=dict)
    embed_weights: str = ""
    similarity_model: str = "ViT-B-32-quickgelu"
    similarity_config: dict = field(default_factory=dict)
    similarity_weights: str = ""
    aesthetic_weights: str = ""
    nsfw_weights: str = ""
    watermark_model: str = "efficientnet_b3"
    watermark_weights: str = ""
    watermark_side: int = 256  # LAION stretches every image to this square
    batch_size: int = 64


@dataclass(kw_only=True, slots=True, frozen=True)
class Finetune:
    """A fine-tune of a trained model (finetunes.yaml): DreamBooth or inpainting, LoRA optional.

    The defaults are seed 001's DreamBooth numbers (lr 5e-6, batch 2, 400 steps, prior weight
    1.0, clip 1.0, 200 class images). Relative paths are under the data root.
    """

    name: str
    mode: Literal["dreambooth", "inpaint"]
    # A phase or run name under <root>/runs/ (its final/ EMA weights), a weights folder, or a
    # diffusers pipeline folder (model_index.json; its own VAE and text encoder).
    base: str
    images: str  # folder: the subject's instance images (dreambooth), the images (inpaint)
    # DreamBooth: "{token}" and "{class_noun}" are filled into the prompts.
    token: str = "sks"
    class_noun: str = ""
    instance_prompt: str = "a photo of {token} {class_noun}"
    class_prompt: str = "a photo of {class_noun}"
    prior_preservation: bool = True
    num_class_images: int = 200  # made by the base model, reused when already there
    prior_loss_weight: float = 1.0
    class_steps: int = 50  # DDIM steps of a class image
    train_text_encoder: bool = False
    # Inpainting: 4 = seed 000 (UNet only, unconditional: a zeros null embedding); 9 = an
    # inpainting UNet (noisy latents + mask + masked-image latents), captioned by the .txt
    # beside each image, else `prompt`.
    inpaint_channels: int = 4
    prompt: str = ""
    num_demo_images: int = 4  # images of the inpainting demo grid
    # LoRA (peft): rank 0 trains every weight; else adapters of this rank, the base frozen.
    lora_rank: int = 0
    lora_alpha: float | None = None  # default: the rank (scale 1)
    # Training (one rank's batch; with prior preservation, that many pairs).
    lr: float = 5e-6
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    steps: int = 400
    batch_size: int = 2
    max_grad_norm: float = 1.0
    seed: int = 0
    flip: bool = False  # also train on each image mirrored (off: subjects are asymmetric)
    min_side: int | None = None  # shorter images are dropped (too_small); default: half the side
    checkpoint_every: int = 100
    sample_every: int = 100  # the sample grid (dreambooth) or inpainting demo grid
    log_every: int = 10
    sample_steps: int = 20
    sample_prompts: tuple[str, ...] = ()  # default: the instance and class prompts
    channels_last: bool = True
    gradient_checkpointing: bool = True
    num_gpus: int = 1  # devices of the node's GPU pool a run holds (a sweep's runs share them)
    # Nodes a run trains on, every GPU of each, instead (above 1: through the Ray cluster, see
    # docs/scale-out.md); the finetune flow's `nodes` parameter overrides it.
    nodes: int = 1


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalCategory:
    """A category of an eval set: its prompts and the CFG scale they are generated at."""

    name: str
    prompts: tuple[str, ...]
    guidance_scale: float = 7.5


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalSet:
    """What a phase is evaluated on (eval.yaml): prompts per category x fixed seeds, generated
    as the recipe samples (DDIM, EMA weights, the run's negative prompt unless set), scored by
    the `scorer`'s ViT-L/14 and aesthetic head, FID by the Inception weights file `fid_weights`
    (relative: under `SDPIPE_WEIGHTS`) unless `fid_random_weights` (tests, the demo)."""

    name: str
    description: str = ""
    categories: tuple[EvalCategory, ...]
    seeds: tuple[int, ...] = (0, 1)
    num_steps: int = 100
    use_ema: bool = True
    negative_prompt: str | None = None  # None: the run's own (what its sample grids used)
    batch_size: int = 8
    scorer: str = "laion-scoring"
    fid_weights: str = ""
    fid_random_weights: bool = False
    # A generation whose nearest training image (embedding cosine) is at least this is counted
    # as memorised.
    memorisation_threshold: float = 0.95
    num_worst_pairs: int = 8  # generation / nearest training image pairs shown
    # The metric `sdpipe eval --checkpoints` picks the phase's best checkpoint by:
    # clip_score, aesthetic (higher is better), fid, memorised, val_loss (lower is better).
    select_by: str = "clip_score"
