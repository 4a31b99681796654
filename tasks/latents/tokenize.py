"""tokenize: the kept captions of a shard -> SD1 CLIP ids, `tokens/NNNNN.parquet` and `.npy`.

77 ids per caption (BOS 49406, caption, EOS 49407, padded with EOS 49407, truncated at 77), stored
as a fixed-size int32 list beside the key, and again as `NNNNN.npy` (int32 [N, 77], row i = row i
of the parquet) that the trainer's ranks memory-map and share through the page cache. The
parquet also holds the cleaned `caption` (string) the ids were made of, and `captions`
(list<string>, the cleaned ones) where the shard's sample table `shards/NNNNN.parquet` keeps
several captions per image (COCO): what a phase that tokenizes at train time reads
(`sdtrain.captions`). Tokens files written before hold key and input_ids only. The ids
come from `sdtrain.models.encode_captions` (the trainer's own tokenizer path; equal to
transformers' CLIPTokenizer configured as SD1's).

Bad captions, each counted: empty or only whitespace -> dropped as `empty_caption`; bytes that
are not UTF-8 -> dropped as `caption_encoding` (source adapters decode with `clean_caption`,
since an Arrow string column cannot hold them); over 77 tokens -> kept, truncated, and counted
in the stats record's `extra["truncated"]` (not a drop: every truncated caption is also out).
Tokens files a phase set links are moved aside before they are written again (kept_latents.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path
from sdtrain.models import MAX_TOKENS, encode_captions
from tasks.latents import kept_latents
from tasks.runtime.shards import ShardStats, run_shard

STAGE = "tokens"
EMPTY = "empty_caption"
ENCODING = "caption_encoding"


def clean_caption(raw: bytes | str | None) -> tuple[str | None, str | None]:
    """(caption, None) for a usable caption, else (None, drop reason).

    Bytes are decoded as strict UTF-8 (`caption_encoding` if they are not UTF-8; a string
    holding lone surrogates, as `surrogateescape` decoding leaves, is treated the same); the
    caption is stripped of surrounding whitespace; nothing left -> `empty_caption`.
    """
    if raw is None:
        return None, EMPTY
    if isinstance(raw, bytes | bytearray | memoryview):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None, ENCODING
    elif not raw.isascii():
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError:
            return None, ENCODING
    caption = raw.strip()
    if not caption:
        return None, EMPTY
    return caption, None


def _table(
    keys: list[str],
    ids: np.ndarray,
    captions: list[str],
    all_captions: pa.Array | None = None,
) -> pa.Table:
    flat = pa.array(ids.reshape(-1), pa.int32())
    columns = {
        "key": pa.array(keys, pa.string()),
        "input_ids": pa.FixedSizeListArray.from_arrays(flat, MAX_TOKENS),
        "caption": pa.array(captions, pa.string()),
    }
    if all_captions is not None:
        columns["captions"] = all_captions
    return pa.table(columns)


def tokens_table(keys: list[str], captions: list[str]) -> pa.Table:
    """The tokens table of already-cleaned captions: key, input_ids int32[77], caption."""
    ids, _ = encode_captions(captions)
    return _table(keys, ids, captions)


def all_captions(samples: Path, keys: list[str], captions: list[str]) -> pa.Array | None:
    """Each key's cleaned captions (list<string>) from the sample table's `captions` column,
    or None when it has none. A caption that `clean_caption` refuses is left out of the list;
    a key whose list is then empty (or that the table lacks) gets its one tokenized caption."""
    if not samples.exists() or "captions" not in pq.read_schema(samples).names:
        return None
    table = pq.read_table(samples, columns=["key", "captions"])
    if table.num_rows == 0:
        return pa.array([[c] for c in captions], pa.list_(pa.string()))
    where = pc.index_in(pa.array(keys, pa.string()), value_set=table["key"])
    lists = table["captions"].take(pc.fill_null(where, 0)).to_pylist()
    found = where.is_valid().to_pylist()
    out = []
    for caption, listed, present in zip(captions, lists, found, strict=True):
        cleaned = [c for c in (clean_caption(x)[0] for x in listed or ()) if c] if present else []
        out.append(cleaned or [caption])
    return pa.array(out, pa.list_(pa.string()))


def tokenize_shard(root: Path, source: str, shard: str) -> ShardStats:
    selected = root / source / "selected" / f"{shard}.parquet"

    def work(stats: ShardStats) -> None:
        table = pq.read_table(selected, columns=["key", "caption"])
        stats.num_in = table.num_rows
        keys, captions = [], []
        for key, raw in zip(table["key"].to_pylist(), table["caption"].to_pylist(), strict=True):
            caption, reason = clean_caption(raw)
            if reason is not None:
                stats.drop(reason)
                continue
            keys.append(key)
            captions.append(caption)
        ids, counts = encode_captions(captions)
        # A phase set mixed before links the files about to be replaced: they move aside.
        kept_latents.keep_linked_tokens(root, source, shard, kept_latents.phase_links(root))
        with atomic_path(root / source / STAGE / f"{shard}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, ids.astype(np.int32, copy=False).reshape(len(keys), MAX_TOKENS))
        listed = all_captions(root / source / "shards" / f"{shard}.parquet", keys, captions)
        with atomic_path(root / source / STAGE / f"{shard}.parquet") as tmp:
            pq.write_table(_table(keys, ids, captions, listed), tmp)
        stats.num_out = len(keys)
        stats.extra["truncated"] = int((counts > MAX_TOKENS - 2).sum())

    return run_shard(root, source, STAGE, shard, work)
