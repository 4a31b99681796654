"""coco: COCO 2017 people, one square crop around the tallest person, with a COCO caption.

Layout, as served at images.cocodataset.org (the catalog's default location) or mirrored:

    annotations/annotations_trainval2017.zip   holds annotations/instances_train2017.json
                                               and annotations/captions_train2017.json
    annotations/instances_train2017.json       (or these two loose; loose files win)
    annotations/captions_train2017.json
    zips/train2017.zip                         holds train2017/000000xxxxxx.jpg
    train2017/000000xxxxxx.jpg                 (or the images loose, when there is no zip)

The annotation zip is read in place (fsspec serves a remote one by ranges); the image zip is
read once per shard by the repack stage.

The rule (the recipe's): an image is kept when one of its person boxes (`category_id` 1,
`iscrowd` 0) is at least `person_min_height` (default 0.55) of the image's height. Choices:

- several persons qualify: the tallest box (then the larger area, then the lower annotation
  id); its box is kept as `person_box` (x, y, w, h as annotated).
- crop: a square of side max(box w, box h) * (1 + `crop_margin`, default 0.1), centered on
  the box and shifted to lie inside the image along each side the image is long enough for;
  along a shorter side (a tall person in a portrait photo: phase 5 is "full body") it covers
  the whole side and the rest is padded with mid-gray (`tasks.latents.images.PAD_FILL`, 127: zero in
  the VAE's input range), so head and feet are never cut. Pixel coordinates are rounded to
  integers. Coordinates are those of the annotation file, whose width/height describe the
  image as displayed: the repack stage applies a JPEG's EXIF orientation before the crop.
- caption: the first of the image's captions by annotation id; all of them are kept in
  `captions` (in that order) and their count in `num_captions`. `coco_id` is the image id.

Counted (every image of the instances file is an input; kept + dropped = images):
`no_person` (no non-crowd person box), `person_too_short` (persons, none tall enough),
`missing_caption`, `unsafe_path` (a file name with `..` or an absolute path),
`bad_annotation` (an image entry without a positive width and height), the caption
reasons of `clean_caption`; at repack, `missing_image` for an image absent from the zip and
the decode reasons of `tasks.latents.images`. An annotation row (person box or caption) whose image
is not in the images list is one more input, counted as `orphan_annotation`.

Options: `split` (default train2017), `person_min_height`, `crop_margin`, `annotations_zip`
(default annotations/annotations_trainval2017.zip), `images_zip` (default zips/<split>.zip).
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Iterator

import pyarrow as pa

from tasks.sources.adapters.base import SEP, Adapter, Entry, Refused, SourceLayoutError, unsafe

PERSON = 1
ANNOTATIONS_ZIP = "annotations/annotations_trainval2017.zip"


def square_crop(
    box: tuple[float, float, float, float], width: int, height: int, margin: float
) -> tuple[int, int, int, int]:
    """(x, y, side, side): the square around `box` by the rule in the module docstring; x or y
    is negative (and x + side or y + side beyond the image) where the square is padded."""
    x, y, w, h = box
    # (rounded first: 100 * 1.1 is 110.00000000000001 in floats, and its ceiling 111)
    side = max(1, math.ceil(round(max(w, h) * (1 + margin), 6)))

    def start(center: float, length: int) -> int:
        # Inside [0, length] where the square fits, else covering all of it; as centered as
        # that allows.
        low, high = sorted((0, length - side))
        return min(max(low, round(center - side / 2)), high)

    return start(x + w / 2, width), start(y + h / 2, height), side, side


def valid_box(box) -> bool:
    return (
        isinstance(box, list | tuple)
        and len(box) == 4
        and all(isinstance(v, int | float) and math.isfinite(v) for v in box)
        and box[2] > 0
        and box[3] > 0
    )


def text(value) -> bool:
    """A string arrow can store (JSON escapes can make lone surrogates, which it cannot)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


class Coco(Adapter):
    extras = {
        "coco_id": pa.int64(),
        "num_captions": pa.int32(),
        "captions": pa.list_(pa.string()),
        "person_box": pa.list_(pa.float64(), 4),
    }

    def entries(self) -> Iterator[Entry | Refused]:
        opts = self.source.options
        split = str(opts.get("split", "train2017"))
        min_height = float(opts.get("person_min_height", 0.55))
        margin = float(opts.get("crop_margin", 0.1))
        images_zip = str(opts.get("images_zip", f"zips/{split}.zip"))
        if self.exists(images_zip):
            prefix = f"{images_zip}{SEP}{split}/"
        elif self.fs.isdir(self.path(split)):
            prefix = f"{split}/"
        else:
            raise SourceLayoutError(
                f"source {self.source.name!r}: neither {images_zip} nor a {split}/ folder "
                f"under {self.location} (set {self.source.name}.location in the catalog's "
                "sources.yaml to a COCO mirror)"
            )
        instances = self.annotations(f"instances_{split}.json")
        captions_file = self.annotations(f"captions_{split}.json")

        images = {}
        for im in instances.get("images", []):
            images[im["id"]] = im
        orphans: list[tuple[str, int]] = []
        best: dict[int, tuple] = {}  # image id -> sort key of the best qualifying person
        has_person: set[int] = set()
        for ann in instances.get("annotations", []):
            if ann.get("category_id") != PERSON or ann.get("iscrowd", 0):
                continue
            image = images.get(ann.get("image_id"))
            if image is None:
                orphans.append((f"instances_{split}.json", ann.get("id")))
                continue
            box = ann.get("bbox")
            if not valid_box(box):
                continue
            has_person.add(image["id"])
            if box[3] < min_height * (image.get("height") or 0):
                continue
            key = (box[3], box[2] * box[3], -ann.get("id", 0), box)
            if image["id"] not in best or key > best[image["id"]]:
                best[image["id"]] = key
        captions: dict[int, list[tuple[int, str]]] = {}
        for ann in captions_file.get("annotations", []):
            if ann.get("image_id") not in images:
                orphans.append((f"captions_{split}.json", ann.get("id")))
                continue
            captions.setdefault(ann["image_id"], []).append((ann.get("id", 0), ann.get("caption")))

        for image_id in sorted(images):
            image = images[image_id]
            file_name = str(image.get("file_name", ""))
            origin = prefix + file_name
            if not file_name or unsafe(file_name):
                yield Refused(origin, "unsafe_path")
                continue
            if not all(isinstance(image.get(k), int) and image[k] > 0 for k in ("width", "height")):
                yield Refused(origin, "bad_annotation")
                continue
            if image_id not in best:
                yield Refused(origin, "person_too_short" if image_id in has_person else "no_person")
                continue
            texts = [c for _, c in sorted(captions.get(image_id, []), key=lambda t: t[0])]
            # (`clean_caption` judges the first; the kept list holds only valid text)
            if not texts:
                yield Refused(origin, "missing_caption")
                continue
            box = tuple(float(v) for v in best[image_id][3])
            yield Entry(
                origin,
                texts[0] if isinstance(texts[0], str) else None,
                {
                    "coco_id": image_id,
                    "num_captions": len(texts),
                    "captions": [t if text(t) else None for t in texts],
                    "person_box": list(box),
                },
                square_crop(box, int(image["width"]), int(image["height"]), margin),
            )
        for file, ann_id in orphans:
            yield Refused(f"annotations/{file}#{ann_id}", "orphan_annotation")

    def annotations(self, name: str) -> dict:
        """One annotation file: loose under annotations/, else from the annotations zip."""
        loose = f"annotations/{name}"
        archive = str(self.source.options.get("annotations_zip", ANNOTATIONS_ZIP))
        try:
            if self.exists(loose):
                with self.open(loose) as f:
                    return json.load(f)
            if self.exists(archive):
                with self.open(archive) as f, zipfile.ZipFile(f) as zf:
                    if loose not in zf.namelist():
                        raise SourceLayoutError(
                            f"source {self.source.name!r}: {archive} under {self.location} "
                            f"has no {loose}"
                        )
                    with zf.open(loose) as member:
                        return json.load(member)
        except (ValueError, zipfile.BadZipFile, EOFError) as e:
            raise SourceLayoutError(
                f"source {self.source.name!r}: cannot read {name} under {self.location}: {e}"
            ) from None
        raise SourceLayoutError(
            f"source {self.source.name!r}: neither {loose} nor {archive} under {self.location}"
        )
