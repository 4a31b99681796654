"""local: a folder of images with captions, in either of two layouts (any depth):

- a `.txt` caption beside each image (`a/b/cat.jpg` + `a/b/cat.txt`);
- JSON metadata as in seed 002: `{"tags": [...], "score": 123, "path": "a/b/cat.jpg"}`, either
  beside the image with the same stem or anywhere with `path` (or `file`/`image`) relative to
  the folder. The caption is the tags, filtered and rewritten by the profile's tag settings
  (`exclude_tags`, `remove_tags`, `tag_replacements`, `tag_separator`); a `caption` key, when
  there are no tags, is used as is.

Scores, in this order (seed 002's metadata dataloader): an image with an excluded tag is
dropped (`excluded_tag`); a raw score under `abs_min_score` is dropped (`abs_min_score`),
before any bonus; the score plus the `tag_bonus_scores` of its tags (each tag once) under
`min_score` is dropped (`min_score`); a missing score fails either rule. `score_tags`
(thresholds, highest first): the first one the raw score strictly exceeds puts the tag
`scr<threshold>` first in the caption (`scr3200`), so a phase's `keep_tokens: 1` keeps it there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import PurePosixPath

import pyarrow as pa

from tasks.sources.adapters.base import (
    IMAGE_EXTENSIONS,
    Adapter,
    Entry,
    Refused,
    SourceLayoutError,
    unsafe,
)

PATH_KEYS = ("path", "file", "image", "file_name")


class LocalFolder(Adapter):
    extras = {"score": pa.float64(), "tags": pa.list_(pa.string())}

    def entries(self) -> Iterator[Entry | Refused]:
        if not self.fs.isdir(self.base):
            raise SourceLayoutError(
                f"source {self.source.name!r}: folder {self.location} does not exist "
                f"(set {self.source.name}.location in the catalog's sources.yaml)"
            )
        prefix = self.base.rstrip("/") + "/"
        files = sorted(f.removeprefix(prefix) for f in self.fs.find(self.base))
        present = set(files)
        images = [f for f in files if PurePosixPath(f).suffix.lower() in IMAGE_EXTENSIONS]
        stems = {str(PurePosixPath(f).with_suffix("")): f for f in images}
        captions = {str(PurePosixPath(f).with_suffix("")): f for f in files if f.endswith(".txt")}
        metadata: dict[str, dict] = {}
        for name in (f for f in files if f.endswith(".json")):
            try:
                with self.open(name) as fh:
                    meta = json.load(fh)
                if not isinstance(meta, dict):
                    raise ValueError("not an object")
            except (ValueError, UnicodeDecodeError):
                yield Refused(name, "bad_metadata")
                continue
            target = next((meta[k] for k in PATH_KEYS if isinstance(meta.get(k), str)), None)
            if target is None:
                target = stems.get(str(PurePosixPath(name).with_suffix("")))
                if target is None:
                    yield Refused(name, "missing_image")
                    continue
            elif unsafe(target):
                yield Refused(name, "unsafe_path")
                continue
            elif target not in present:
                yield Refused(name, "missing_image")
                continue
            metadata[target] = meta
        for image in images:
            if image in metadata:
                yield self.tagged(image, metadata[image])
            elif (txt := captions.get(str(PurePosixPath(image).with_suffix("")))) is not None:
                with self.open(txt) as fh:
                    yield Entry(image, fh.read())
            else:
                yield Refused(image, "missing_caption")

    def tagged(self, image: str, meta: dict) -> Entry | Refused:
        p = self.profile
        tags = [str(t) for t in meta.get("tags") or []]
        score = meta.get("score")
        score = float(score) if isinstance(score, int | float) else None
        if set(tags) & set(p.exclude_tags):
            return Refused(image, "excluded_tag")
        if p.abs_min_score is not None and (score is None or score < p.abs_min_score):
            return Refused(image, "abs_min_score")
        if p.min_score is not None:
            bonus = sum(p.tag_bonus_scores.get(t, 0) for t in set(tags))
            if score is None or score + bonus < p.min_score:
                return Refused(image, "min_score")
        kept = []
        for tag in tags:
            if tag in p.remove_tags:
                continue
            for old, new in p.tag_replacements.items():
                tag = tag.replace(old, new)
            kept.append(tag)
        caption = p.tag_separator.join(kept) if tags else meta.get("caption")
        tag = score_tag(score, p.score_tags)
        if tag is not None:
            caption = tag if not caption else f"{tag}{p.tag_separator}{caption}"
        return Entry(image, caption, {"score": score, "tags": tags})


def score_tag(score: float | None, thresholds: tuple[float, ...]) -> str | None:
    """`scr<t>` for the first threshold t (highest first) the raw score strictly exceeds."""
    if score is None:
        return None
    for t in thresholds:
        if score > t:
            return f"scr{int(t) if float(t).is_integer() else t}"
    return None
