"""journeydb: JourneyDB (JourneyDB/JourneyDB, a gated dataset on the Hugging Face hub).

Layout (the upstream's train split, relative to the source location; every name this module
assumes is one of the constants below):
- `ANNOTATION`: a gzipped tar holding one `.jsonl`, one JSON object per line: `img_path`
  (like `./000/<id>.jpg`, relative to `IMAGES`), `prompt`, and other caption keys (e.g.
  `Task2: {Caption: ...}`);
- `IMAGES/NNN.tgz` (`ARCHIVE_DIGITS` digits, from 000): a gzipped tar of `NNN/<id>.jpg`; the
  first folder of an `img_path` names its archive.

Samples are the annotation rows whose image lies in a chosen archive, in annotation order.
An annotation line that is not a JSON object, or has no usable `img_path`, is counted as
`bad_metadata`; an `img_path` with `..` or an absolute one as `unsafe_path` (both whichever
archives are chosen). Source options:
- `caption_field`: the annotation key of the caption (default `prompt`); a dotted path reads a
  nested key (`Task2.Caption`);
- `archives`: how many image archives (the first N: 000 .. N-1) or a list of them (numbers,
  or names like `"007"`); default every archive the annotation names.
"""

from __future__ import annotations

import json
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import PurePosixPath

from tasks.sources.adapters.base import SEP, Adapter, Entry, Refused, SourceLayoutError, unsafe

ANNOTATION = "data/train/train_anno_realease_repath.jsonl.tgz"  # upstream's spelling
IMAGES = "data/train/imgs"
ARCHIVE_DIGITS = 3
ARCHIVE_SUFFIX = ".tgz"
DEFAULT_CAPTION_FIELD = "prompt"


def archive_path(name: str) -> str:
    """`IMAGES/<name>.tgz` of an archive name like `000`."""
    return f"{IMAGES}/{name}{ARCHIVE_SUFFIX}"


class JourneyDB(Adapter):
    extras: dict = {}

    def entries(self) -> Iterator[Entry | Refused]:
        self.require(ANNOTATION)
        chosen = self.chosen_archives()
        if chosen is not None:
            self.require(*(archive_path(a) for a in chosen))
        field_path = str(self.source.options.get("caption_field") or DEFAULT_CAPTION_FIELD)
        for where, line in self.annotation_lines():
            try:
                row = json.loads(line.decode("utf-8", "surrogateescape"))
            except ValueError:
                yield Refused(where, "bad_metadata")
                continue
            img_path = row.get("img_path") if isinstance(row, dict) else None
            if not isinstance(img_path, str) or not is_text(img_path):
                yield Refused(where, "bad_metadata")
                continue
            if unsafe(img_path):
                yield Refused(f"{IMAGES}/{img_path}", "unsafe_path")
                continue
            parts = PurePosixPath(img_path.replace("\\", "/")).parts  # drops a leading ./
            if len(parts) < 2:
                yield Refused(where, "bad_metadata")
                continue
            if chosen is not None and parts[0] not in chosen:
                continue
            member = "/".join(parts)
            caption = lookup(row, field_path)
            if isinstance(caption, str) and not is_text(caption):
                caption = caption.encode("utf-8", "surrogateescape")  # a caption fault
            elif caption is not None and not isinstance(caption, str):
                yield Refused(where, "bad_metadata")
                continue
            yield Entry(f"{archive_path(parts[0])}{SEP}{member}", caption)

    def chosen_archives(self) -> set[str] | None:
        option = self.source.options.get("archives")
        if option is None:
            return None
        if isinstance(option, int) and not isinstance(option, bool):
            return {f"{i:0{ARCHIVE_DIGITS}d}" for i in range(option)}
        if isinstance(option, list | tuple):
            names = set()
            for a in option:
                if isinstance(a, int) and not isinstance(a, bool):
                    names.add(f"{a:0{ARCHIVE_DIGITS}d}")
                elif isinstance(a, str) and a and not unsafe(a) and "/" not in a:
                    names.add(a.removesuffix(ARCHIVE_SUFFIX))
                else:
                    break
            else:
                return names
        raise SourceLayoutError(
            f"source {self.source.name!r}: option archives must be a count or a list of "
            f"archive numbers or names like '000', not {option!r}"
        )

    def annotation_lines(self) -> Iterator[tuple[str, bytes]]:
        """(where, line) of every non-blank line of the annotation's .jsonl member(s), streamed
        (block_size=0: no ranged reads, so any HTTP server will do)."""
        found = False
        try:
            with (
                self.fs.open(self.path(ANNOTATION), "rb", block_size=0) as f,
                tarfile.open(fileobj=f, mode="r|*") as tar,
            ):
                for info in tar:
                    if not (info.isfile() and info.name.endswith(".jsonl")):
                        continue
                    found = True
                    for i, line in enumerate(tar.extractfile(info), 1):
                        if line.strip():
                            yield f"{ANNOTATION}{SEP}{info.name}:{i}", line
        except (tarfile.TarError, EOFError, zlib.error) as e:
            raise SourceLayoutError(
                f"source {self.source.name!r}: {self.path(ANNOTATION)} is cut off or not a "
                f"gzipped tar ({e})"
            ) from None
        if not found:
            raise SourceLayoutError(
                f"source {self.source.name!r}: {self.path(ANNOTATION)} holds no .jsonl file"
            )


def lookup(row: dict, dotted: str):
    """`row[a][b]...` of a dotted path `a.b...`; None where a key is missing."""
    value = row
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def is_text(s: str) -> bool:
    """Whether a string decoded with surrogateescape was valid UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
