"""vggface2: a user-supplied copy of VGGFace2 in its standard layout.

VGGFace2 is no longer distributed by its authors, so the source's location is a folder the
user provides (local, or any fsspec URL) laid out as released:

    <location>/train/n000002/0001_01.jpg      split / identity (n + 6 digits) / NNNN_NN.jpg

Only the split folders are read (option `splits`, default `[train]`; `test` is the other
released split); `meta/` and `bb_landmark/` beside them are ignored. Any other file under a
split folder (another name, another depth, a stray `.DS_Store`) is counted as
`unexpected_path`, never skipped silently.

Captions come from the option `caption_templates` (as the recipe did: VGGFace2 has no
captions): the template of an image is chosen by a stable hash of its path, so the choice is
the same on every run and machine. The identity is kept in the column `identity`.

Options (catalog `sources.yaml`, all optional): `caption_templates` (list of strings),
`splits`, `identities_limit` (the first N identities in sorted order; the images of the others
are counted as `identities_limit`), `images_per_identity` (the first M images of each identity
in sorted order; the rest are counted as `images_per_identity`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import pyarrow as pa

from tasks.sources.adapters.base import Adapter, Entry, Refused, SourceLayoutError

LAYOUT = "train/nXXXXXX/NNNN_NN.jpg"
DEFAULT_TEMPLATES = ("a photo of a person's face",)
IDENTITY = re.compile(r"n\d{6}")
IMAGE = re.compile(r"\d{4}_\d{2}\.jpg")


def template_index(path: str, count: int) -> int:
    """The template of an image: a stable hash of its path (not Python's salted `hash`)."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") % count


class VGGFace2(Adapter):
    extras = {"identity": pa.string()}

    def entries(self) -> Iterator[Entry | Refused]:
        opts = self.source.options
        name = self.source.name
        if not self.fs.isdir(self.base):
            raise SourceLayoutError(
                f"source {name!r}: folder {self.location} does not exist; VGGFace2 is no longer "
                f"distributed upstream: supply your own copy laid out as {LAYOUT} and set "
                f"{name}.location in the catalog's sources.yaml"
            )
        splits = [str(s) for s in opts.get("splits", ["train"])]
        missing = [s for s in splits if not self.fs.isdir(self.path(s))]
        if missing:
            raise SourceLayoutError(
                f"source {name!r}: no {', '.join(s + '/' for s in missing)} folder under "
                f"{self.location} (expected the VGGFace2 layout {LAYOUT})"
            )
        templates = [str(t) for t in opts.get("caption_templates") or DEFAULT_TEMPLATES]
        identities_limit = opts.get("identities_limit")
        per_identity = opts.get("images_per_identity")
        prefix = self.base.rstrip("/") + "/"
        identities: list[str] = []
        taken: dict[str, int] = {}
        for split in splits:
            for path in sorted(f.removeprefix(prefix) for f in self.fs.find(self.path(split))):
                parts = path.split("/")
                if not (
                    len(parts) == 3 and IDENTITY.fullmatch(parts[1]) and IMAGE.fullmatch(parts[2])
                ):
                    yield Refused(path, "unexpected_path")
                    continue
                identity = parts[1]
                if identity not in taken:
                    if identities_limit is not None and len(identities) >= int(identities_limit):
                        yield Refused(path, "identities_limit")
                        continue
                    identities.append(identity)
                    taken[identity] = 0
                if per_identity is not None and taken[identity] >= int(per_identity):
                    yield Refused(path, "images_per_identity")
                    continue
                taken[identity] += 1
                caption = templates[template_index(path, len(templates))]
                yield Entry(path, caption, {"identity": identity})
