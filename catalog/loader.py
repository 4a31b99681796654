"""Load the catalog YAML into typed entries, failing with one line naming file, field and value.

Each YAML file maps entry names to fields. Values are checked against the dataclass field
types here (one generic checker), and cross references (dataset -> source, phase -> dataset)
after all files are read.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from catalog.schema import (
    Dataset,
    EvalSet,
    FilterProfile,
    Finetune,
    Model,
    Phase,
    ScoringModel,
    Source,
)

PACKAGED_DIR = Path(__file__).parent
FILES = {
    "sources": ("sources.yaml", Source),
    "profiles": ("profiles.yaml", FilterProfile),
    "datasets": ("datasets.yaml", Dataset),
    "phases": ("phases.yaml", Phase),
    "models": ("models.yaml", Model),
    "finetunes": ("finetunes.yaml", Finetune),
    "evals": ("eval.yaml", EvalSet),
}
# A catalog folder of an older sdpipe has no finetunes.yaml or eval.yaml.
OPTIONAL = {"finetunes", "evals"}
SELECT_BY = ("clip_score", "aesthetic", "fid", "memorised", "val_loss")


# Lower bounds of the optional training settings of a phase (null: the trainer's default).
PHASE_MINIMUMS = {
    "max_steps": 1,
    "offset_noise": 0,
    "ema_every": 1,
    "max_nonfinite_steps": 1,
    "num_val_samples": 0,
    "checkpoint_every": 0,
    "keep_every": 0,
    "validate_every": 0,
    "log_every": 1,
    "sample_every": 0,
}

# Dedup levels a profile may list, in the order they are judged.
DEDUP_LEVELS = ("url", "sha256", "phash", "semantic")
# The range a score threshold must lie in (the range of the score itself).
SCORE_RANGES = {
    "min_aesthetic": (0.0, 10.0),
    "min_similarity": (-1.0, 1.0),
    "max_pwatermark": (0.0, 1.0),
    "max_punsafe": (0.0, 1.0),
}

FILES_BY_CLASS = {cls: filename for filename, cls in FILES.values()}
FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class CatalogError(Exception):
    """A catalog entry is invalid or a lookup names nothing in the catalog."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Catalog:
    sources: dict[str, Source]
    profiles: dict[str, FilterProfile]
    datasets: dict[str, Dataset]
    phases: dict[str, Phase]
    models: dict[str, Model]
    directory: Path
    scorers: dict[str, ScoringModel] = dataclasses.field(default_factory=dict)
    finetunes: dict[str, Finetune] = dataclasses.field(default_factory=dict)
    evals: dict[str, EvalSet] = dataclasses.field(default_factory=dict)

    def source(self, name: str) -> Source:
        return self._lookup("sources", "source", name)

    def profile(self, name: str) -> FilterProfile:
        return self._lookup("profiles", "filter profile", name)

    def dataset(self, name: str) -> Dataset:
        return self._lookup("datasets", "dataset", name)

    def phase(self, name: str) -> Phase:
        # Users say "3" or "phase-3"; both name the same phase.
        key = f"phase-{name}" if str(name).isdigit() else str(name)
        return self._lookup("phases", "phase", key)

    def model(self, name: str) -> Model:
        """A catalog model, or the model of a diffusers pipeline folder named by its path (a
        fine-tune's base)."""
        if name not in self.models and (Path(name) / "model_index.json").is_file():
            return diffusers_model(Path(name))
        return self._lookup("models", "model", name)

    def finetune(self, name: str) -> Finetune:
        return self._lookup("finetunes", "fine-tune", name)

    def eval_set(self, name: str) -> EvalSet:
        return self._lookup("evals", "eval set", name)

    def scorer(self, name: str) -> ScoringModel:
        if name not in self.scorers:
            raise CatalogError(
                f"{self.directory / FILES['models'][0]}: unknown scoring model {name!r}; "
                f"the catalog has: {', '.join(sorted(self.scorers))}"
            )
        return self.scorers[name]

    def _lookup(self, kind: str, what: str, name: str):
        entries = getattr(self, kind)
        if name not in entries:
            raise CatalogError(
                f"{self.directory / FILES[kind][0]}: unknown {what} {name!r}; "
                f"the catalog has: {', '.join(sorted(entries))}"
            )
        return entries[name]


def catalog_dir() -> Path:
    """The catalog folder: `SDPIPE_CATALOG` if set, else the YAML shipped with the package."""
    return Path(os.environ.get("SDPIPE_CATALOG") or PACKAGED_DIR)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (plain YAML keeps the
    last one silently: a setting added beside an existing one would not take effect)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_catalog(directory: str | Path | None = None) -> Catalog:
    directory = Path(directory) if directory else catalog_dir()
    loaded: dict[str, dict] = {}
    for kind, (filename, cls) in FILES.items():
        path = directory / filename
        if not path.is_file() and kind in OPTIONAL:
            loaded[kind] = {}
            continue
        if not path.is_file():
            raise CatalogError(f"{path}: catalog file is missing")
        try:
            raw = yaml.load(path.read_text(), Loader=_UniqueKeys) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark else ""
            raise CatalogError(
                f"{path}{where}: not valid YAML: {getattr(e, 'problem', e)}"
            ) from None
        if not isinstance(raw, dict):
            raise CatalogError(f"{path}: expected a mapping of {kind} names to fields")
        if kind == "models":  # scoring models share the file, marked `kind: scoring`
            scoring = {n for n, f in raw.items() if isinstance(f, dict) and "kind" in f}
            loaded["scorers"] = {
                str(n): _build(ScoringModel, raw.pop(n), path, str(n)) for n in sorted(scoring)
            }
        loaded[kind] = {
            str(name): _build(cls, fields, path, str(name)) for name, fields in raw.items()
        }
    catalog = Catalog(directory=directory, **loaded)
    _check_references(catalog)
    return catalog


def _build(cls: type, fields: Any, path: Path, name: str):
    if not isinstance(fields, dict):
        raise CatalogError(f"{path}: {name}: expected a mapping of fields, got {fields!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CatalogError(
            f"{path}: {name}.{unknown[0]}: unknown field "
            f"(allowed: {', '.join(sorted(known - {'name'}))})"
        )
    values = {"name": name}
    for f in dataclasses.fields(cls):
        if f.name == "name":
            continue
        if f.name not in fields:
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            if not has_default:
                raise CatalogError(f"{path}: {name}.{f.name}: required field is missing")
            continue
        values[f.name] = _coerce(hints[f.name], fields[f.name], path, f"{name}.{f.name}")
    return cls(**values)


def coerce_field(cls: type, name: str, value: Any, where: str):
    """`value` checked and converted as the catalog reads field `name` of `cls` (a run's
    override of an entry's setting)."""
    hints = typing.get_type_hints(cls)
    if name not in hints or name == "name":
        raise CatalogError(f"{where}: unknown field (allowed: {', '.join(sorted(hints))})")
    return _coerce(hints[name], value, Path(FILES_BY_CLASS.get(cls, cls.__name__)), where)


def diffusers_model(folder: Path) -> Model:
    """The Model of a diffusers pipeline folder: its own UNet, VAE and text encoder."""
    import json

    unet = json.loads((folder / "unet" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    scale = 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1)
    return Model(
        name=str(folder),
        resolution=int(unet["sample_size"]) * scale,
        scaling_factor=float(vae.get("scaling_factor", 0.18215)),
        unet_pretrained=str(folder),
        vae_pretrained=str(folder / "vae"),
        text_pretrained=str(folder / "text_encoder"),
    )


def _coerce(tp: Any, value: Any, path: Path, where: str):
    """Check `value` against type `tp`, converting lists to tuples and nested mappings."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    fail = CatalogError(f"{path}: {where}: expected {_describe(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path, where)
            except CatalogError:
                continue
        raise fail
    if origin is Literal:
        if value not in args:
            raise fail
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise fail
        return tuple(_coerce(args[0], v, path, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise fail
        fields = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise CatalogError(f"{path}: {where}.{unknown[0]}: unknown field")
        return tp(
            **{
                k: _coerce(typing.get_type_hints(tp)[k], v, path, f"{where}.{k}")
                for k, v in value.items()
            }
        )
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise fail
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise fail
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail
        return value
    if tp is float:
        # YAML 1.1 reads `1e-5` (no dot) as a string; recipe numbers are written that way.
        if isinstance(value, str) and FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail
        return value
    raise fail


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0])}"
    if tp is type(None):
        return "null"
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        dict: "a mapping",
    }
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _check_references(c: Catalog) -> None:
    d = c.directory
    for s in c.sources.values():
        if s.profile not in c.profiles:
            raise CatalogError(
                f"{d / 'sources.yaml'}: {s.name}.profile: unknown profile {s.profile!r}"
            )
        if s.model not in c.models:
            raise CatalogError(f"{d / 'sources.yaml'}: {s.name}.model: unknown model {s.model!r}")
        if c.profiles[s.profile].semantic_prefetch and (
            s.kind not in ("url", "demo") or not s.options.get("embeddings")
        ):
            raise CatalogError(
                f"{d / 'sources.yaml'}: {s.name}: its profile {s.profile!r} sets "
                "semantic_prefetch, which needs a url source with `options: {embeddings: "
                "FOLDER}` (LAION's img_emb/ + metadata_NNNN.parquet layout; docs/sources.md)"
                + (f"; this source is of kind {s.kind!r}" if s.kind not in ("url", "demo") else "")
            )
    for pr in c.profiles.values():
        _check_profile(pr, d / "profiles.yaml")
        if pr.scorer and pr.scorer not in c.scorers:
            raise CatalogError(
                f"{d / 'profiles.yaml'}: {pr.name}.scorer: unknown scoring model {pr.scorer!r} "
                f"(models.yaml entries with kind: scoring: {', '.join(sorted(c.scorers))})"
            )
    for sc in c.scorers.values():
        if sc.random_weights:
            continue
        for net in ("embed", "similarity", "aesthetic", "nsfw", "watermark"):
            if not getattr(sc, f"{net}_weights"):
                raise CatalogError(
                    f"{d / 'models.yaml'}: {sc.name}.{net}_weights: required unless "
                    "random_weights is true"
                )
    for ds in c.datasets.values():
        if ds.source not in c.sources:
            raise CatalogError(
                f"{d / 'datasets.yaml'}: {ds.name}.source: unknown source {ds.source!r}"
            )
        if ds.profile not in c.profiles:
            raise CatalogError(
                f"{d / 'datasets.yaml'}: {ds.name}.profile: unknown profile {ds.profile!r}"
            )
    for p in c.phases.values():
        where = f"{d / 'phases.yaml'}: {p.name}"
        if p.model not in c.models:
            raise CatalogError(f"{where}.model: unknown model {p.model!r}")
        if p.init_from is not None and p.init_from not in c.phases:
            raise CatalogError(f"{where}.init_from: unknown phase {p.init_from!r}")
        if not p.mix:
            raise CatalogError(f"{where}.mix: a phase needs at least one dataset")
        for i, m in enumerate(p.mix):
            if m.dataset not in c.datasets:
                raise CatalogError(f"{where}.mix[{i}].dataset: unknown dataset {m.dataset!r}")
            if (m.count is None) == (m.ratio is None):
                raise CatalogError(f"{where}.mix[{i}]: give exactly one of count or ratio")
            if m.ratio is not None and p.total is None:
                raise CatalogError(f"{where}.total: required when the mix uses ratios")
        short = p.allow_short
        if not isinstance(short, bool) and not 0 < short <= 1:
            raise CatalogError(
                f"{where}.allow_short: true, false or a fraction in (0, 1], got {short!r}"
            )
        for fld in ("lr", "cfg_dropout", "flip_p"):
            if not 0 <= getattr(p, fld) <= 1:
                raise CatalogError(f"{where}.{fld}: must be within [0, 1], got {getattr(p, fld)!r}")
        for fld in ("warmup_steps", "epochs", "batch_size", "grad_accum", "nodes"):
            if getattr(p, fld) < (0 if fld == "warmup_steps" else 1):
                raise CatalogError(f"{where}.{fld}: out of range, got {getattr(p, fld)!r}")
        for fld, low in PHASE_MINIMUMS.items():
            value = getattr(p, fld)
            if value is not None and value < low:
                raise CatalogError(f"{where}.{fld}: must be >= {low}, got {value!r}")
        _check_caption_settings(p, where)
    for f in c.finetunes.values():
        check_finetune(f, d / "finetunes.yaml")
    for e in c.evals.values():
        where = f"{d / 'eval.yaml'}: {e.name}"
        if e.scorer not in c.scorers:
            raise CatalogError(f"{where}.scorer: unknown scoring model {e.scorer!r}")
        if not e.categories or not all(cat.prompts for cat in e.categories):
            raise CatalogError(f"{where}.categories: every category needs at least one prompt")
        if len({cat.name for cat in e.categories}) != len(e.categories):
            raise CatalogError(f"{where}.categories: category names must be distinct")
        if not e.seeds or len(set(e.seeds)) != len(e.seeds):
            raise CatalogError(f"{where}.seeds: at least one, all distinct, got {list(e.seeds)}")
        if not e.fid_random_weights and not e.fid_weights:
            raise CatalogError(f"{where}.fid_weights: required unless fid_random_weights is true")
        if e.select_by not in SELECT_BY:
            raise CatalogError(
                f"{where}.select_by: one of {', '.join(SELECT_BY)}, got {e.select_by!r}"
            )
        if not 0 < e.memorisation_threshold <= 1:
            raise CatalogError(f"{where}.memorisation_threshold: must be within (0, 1]")
        for fld in ("num_steps", "batch_size"):
            if getattr(e, fld) < 1:
                raise CatalogError(f"{where}.{fld}: must be >= 1, got {getattr(e, fld)!r}")
    if c.evals:
        for p in c.phases.values():
            if p.eval_set and p.eval_set not in c.evals:
                raise CatalogError(
                    f"{d / 'phases.yaml'}: {p.name}.eval_set: unknown eval set {p.eval_set!r} "
                    f"(eval.yaml has: {', '.join(sorted(c.evals))})"
                )
    for m in c.models.values():
        where = f"{d / 'models.yaml'}: {m.name}"
        for net in ("unet", "vae", "text"):
            if not getattr(m, f"{net}_config") and not getattr(m, f"{net}_pretrained"):
                raise CatalogError(f"{where}.{net}_config: give {net}_config or {net}_pretrained")
        if m.resolution % 8:
            raise CatalogError(f"{where}.resolution: must be a multiple of 8, got {m.resolution}")
        if m.buckets is not None:
            _check_buckets(m, where)


def _check_buckets(m: Model, where: str) -> None:
    """A model's bucket plan: known keys, numbers, and a plan that holds a bucket."""
    from catalog.buckets import BucketPlan

    allowed = ("area", "step", "min_side", "max_side", "max_aspect")
    for key, value in m.buckets.items():
        if key not in allowed:
            raise CatalogError(
                f"{where}.buckets.{key}: unknown field (allowed: {', '.join(allowed)})"
            )
        integral = key != "max_aspect"
        if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
            kind = "an integer" if integral else "a number"
            raise CatalogError(f"{where}.buckets.{key}: expected {kind}, got {value!r}")
    try:
        BucketPlan.from_dict(m.buckets, m.resolution).sizes()
    except ValueError as e:
        raise CatalogError(f"{where}.buckets: {e}") from None


def needs_flips(catalog: Catalog, source: str) -> bool:
    """Whether a source's latents must hold the mirrored images too: some phase mixing one of
    its datasets flips (`flip_p` > 0)."""
    return any(
        p.flip_p > 0 and any(catalog.datasets[m.dataset].source == source for m in p.mix)
        for p in catalog.phases.values()
    )


def check_finetune(f: Finetune, path: Path) -> None:
    """A fine-tune's settings make sense together (one line naming entry, field and why)."""
    where = f"{path}: {f.name}"
    if f.mode == "dreambooth":
        if not f.class_noun and f.prior_preservation:
            raise CatalogError(f"{where}.class_noun: required for prior preservation (e.g. dog)")
        if f.prior_preservation and f.num_class_images < 1:
            raise CatalogError(
                f"{where}.num_class_images: {f.num_class_images} class images with "
                "prior_preservation on; give a count (seed 001: ~200) or set "
                "prior_preservation: false"
            )
        for fld in ("instance_prompt", "class_prompt"):
            try:
                getattr(f, fld).format(token=f.token, class_noun=f.class_noun)
            except (KeyError, IndexError, ValueError) as e:
                raise CatalogError(
                    f"{where}.{fld}: only {{token}} and {{class_noun}} may be filled in ({e})"
                ) from None
        if not f.token.strip():
            raise CatalogError(f"{where}.token: empty")
    elif f.train_text_encoder:
        raise CatalogError(
            f"{where}.train_text_encoder: only DreamBooth trains the text encoder "
            "(the unconditional inpainting mode has no text)"
        )
    if f.inpaint_channels not in (4, 9):
        raise CatalogError(f"{where}.inpaint_channels: 4 or 9, got {f.inpaint_channels!r}")
    if not 0 < f.lr <= 1:
        raise CatalogError(f"{where}.lr: must be within (0, 1], got {f.lr!r}")
    for fld in (
        "steps",
        "batch_size",
        "class_steps",
        "num_gpus",
        "nodes",
        "log_every",
        "sample_steps",
    ):
        if getattr(f, fld) < 1:
            raise CatalogError(f"{where}.{fld}: must be >= 1, got {getattr(f, fld)!r}")
    for fld in ("lora_rank", "warmup_steps", "checkpoint_every", "sample_every"):
        if getattr(f, fld) < 0:
            raise CatalogError(f"{where}.{fld}: must be >= 0, got {getattr(f, fld)!r}")
    for fld in ("prior_loss_weight", "max_grad_norm", "lora_alpha"):
        value = getattr(f, fld)
        if value is not None and value < 0:
            raise CatalogError(f"{where}.{fld}: must be >= 0, got {value!r}")
    if f.num_demo_images < 1:
        raise CatalogError(f"{where}.num_demo_images: must be >= 1, got {f.num_demo_images!r}")


# A phase's caption augmentation (field -> its off value): each needs train_time_captions.
CAPTION_AUGMENTATION = {
    "shuffle_tags_p": 0.0,
    "keep_tokens": 0,
    "tag_separator": ", ",
    "tag_dropout": 0.0,
}


def _check_caption_settings(p: Phase, where: str) -> None:
    for fld in ("shuffle_tags_p", "tag_dropout"):
        if not 0 <= getattr(p, fld) <= 1:
            raise CatalogError(f"{where}.{fld}: must be within [0, 1], got {getattr(p, fld)!r}")
    if p.keep_tokens < 0:
        raise CatalogError(f"{where}.keep_tokens: must be >= 0, got {p.keep_tokens!r}")
    if not p.tag_separator:
        raise CatalogError(f"{where}.tag_separator: must not be empty")
    if not p.train_time_captions:
        for fld, off in CAPTION_AUGMENTATION.items():
            if getattr(p, fld) != off:
                raise CatalogError(
                    f"{where}.{fld}: caption augmentation needs train_time_captions: true "
                    f"(the stored token ids are fixed), got {getattr(p, fld)!r}"
                )


def _check_profile(pr: FilterProfile, path: Path) -> None:
    where = f"{path}: {pr.name}"
    for level in pr.dedup:
        if level not in DEDUP_LEVELS:
            raise CatalogError(
                f"{where}.dedup: unknown level {level!r} (allowed: {', '.join(DEDUP_LEVELS)})"
            )
    for fld, (low, high) in SCORE_RANGES.items():
        value = getattr(pr, fld)
        if value is not None and not low <= value <= high:
            raise CatalogError(f"{where}.{fld}: must be within [{low}, {high}], got {value!r}")
    for fld in ("min_values", "max_values"):
        for column, value in getattr(pr, fld).items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CatalogError(f"{where}.{fld}.{column}: expected a number, got {value!r}")
    if not 0 <= pr.phash_distance <= 31:
        raise CatalogError(
            f"{where}.phash_distance: must be within [0, 31], got {pr.phash_distance!r}"
        )
    if not 0 < pr.semantic_threshold <= 1:
        raise CatalogError(
            f"{where}.semantic_threshold: must be within (0, 1], got {pr.semantic_threshold!r}"
        )
    for fld in ("min_side", "min_caption_words", "semantic_visits"):
        if getattr(pr, fld) < 0:
            raise CatalogError(f"{where}.{fld}: must be >= 0, got {getattr(pr, fld)!r}")
    for tag, bonus in pr.tag_bonus_scores.items():
        if isinstance(bonus, bool) or not isinstance(bonus, int | float):
            raise CatalogError(f"{where}.tag_bonus_scores.{tag}: expected a number, got {bonus!r}")
    if any(a <= b for a, b in zip(pr.score_tags[:-1], pr.score_tags[1:], strict=True)):
        raise CatalogError(
            f"{where}.score_tags: thresholds highest first, each lower than the one before, "
            f"got {list(pr.score_tags)}"
        )
