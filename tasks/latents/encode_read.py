"""encode's reader: a shard's inputs as a stream, its images read from the tar as the decoders
take them, so what a pipeline holds is a few batches' bytes, not a shard's.

A first pass reads the tar's headers only (the member of each token key: the last one, as an
extraction would keep); the images are then read in token order, which is the tar's order
when fetch-images wrote it (the reads are sequential), and any order otherwise.
"""

from __future__ import annotations

import contextlib
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.latents.images import image_members
from tasks.latents.images import read_images as read_tar_images

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")


def read_images(tar_path: Path, keys: set[str]) -> dict[str, bytes]:
    """The image bytes of `keys` from a webdataset tar (only theirs are read)."""
    return read_tar_images(tar_path, keys, IMAGE_EXTENSIONS)


@dataclass(slots=True)
class ShardInput:
    """A shard's header in the stream: its images in token order, read next (`open_shard`)."""

    shard: str
    num_in: int = 0  # token keys
    keys: list[str] | None = None  # those with an image in the tar, in token order
    token_rows: list[int] | None = None
    sha256: list[str] | None = None  # per key (bucketed layout), "" when unknown
    error: Exception | None = None  # its inputs could not be read: this shard fails, alone
    skip: bool = False  # done already


@contextlib.contextmanager
def open_shard(
    root: Path, source: str, shard: str, *, digests: bool
) -> Iterator[tuple[ShardInput, Callable[[Iterable[tuple[int, int]]], Iterator[list[bytes]]]]]:
    """A shard's token keys and tar, opened: (its header, which says which images come; a
    reader of them, one list of bytes per (start, stop) range of the header's keys).
    `digests`: the header carries the images' sha256 from the sample table."""
    tokens = root / source / "tokens" / f"{shard}.parquet"
    token_keys = pq.read_table(tokens, columns=["key"])["key"].to_pylist()
    with tarfile.open(root / source / "shards" / f"{shard}.tar") as tar:
        members = image_members(tar, set(token_keys), IMAGE_EXTENSIONS)
        present = [(row, key) for row, key in enumerate(token_keys) if key in members]
        header = ShardInput(
            shard,
            num_in=len(token_keys),
            keys=[key for _, key in present],
            token_rows=[row for row, _ in present],
        )
        if digests:
            header.sha256 = sample_digests(root, source, shard, header.keys)
        in_order = [members[key] for _, key in present]

        def images(pieces: Iterable[tuple[int, int]]) -> Iterator[list[bytes]]:
            for start, stop in pieces:
                yield [tar.extractfile(m).read() for m in in_order[start:stop]]

        yield header, images


def sample_digests(root: Path, source: str, shard: str, keys: list[str]) -> list[str]:
    """The sha256 of each key's image bytes from the shard's sample table
    (`shards/NNNNN.parquet`), "" where the table, its column or the key is missing."""
    table_path = root / source / "shards" / f"{shard}.parquet"
    try:
        names = pq.read_schema(table_path).names
    except FileNotFoundError:
        return [""] * len(keys)
    if "key" not in names or "sha256" not in names:
        return [""] * len(keys)
    table = pq.read_table(table_path, columns=["key", "sha256"])
    where = pc.index_in(pa.array(keys, pa.string()), value_set=table["key"].combine_chunks())
    digests = table["sha256"].combine_chunks().cast(pa.string()).take(where)
    return pc.fill_null(digests, "").to_pylist()
