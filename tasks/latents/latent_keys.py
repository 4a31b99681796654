"""The keys of an encoded shard: `latents/NNNNN.keys.arrow`, written by encode beside its latents.

Row i of `latents/NNNNN.npy` is row i of this file: the sample's `key` (string) and its row in
`tokens/NNNNN.parquet` (`token_row`, int32). It is an uncompressed Arrow IPC file, so mix maps
10,000 shards' keys in well under a second and keeps them as Arrow columns, never a Python object
per row (the stats record held them as JSON lists before). Its schema metadata holds the size and
mtime of the tokens file the rows point into, as encode saw it: mix trusts `token_row` while that
file is unchanged and checks the keys against it when it is not.

With a bucket plan, flips or latent sampling (docs/training-data.md, "Latents on disk") the
latents are one file per bucket, `latents/NNNNN.WxH.npy` [n, V, C, H/8, W/8], and this file has
three more columns: `bucket` ("WxH"), `bucket_row` (int32, the row in that bucket's file) and
`sha256` (the image bytes' digest, "" when unknown); its schema metadata holds `latent_spec`
(JSON: VAE, plan, views, channels), what the shard was encoded under.

Shards encoded before this file existed carry their keys in the stats record (`extra["keys"]`,
`extra["token_rows"]`): `read` falls back to them (slower, checked against the tokens file each
time), so an older data root mixes without re-encoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path
from tasks.runtime.shards import ShardStats, stats_path

STAGE = "latents"
SUFFIX = ".keys.arrow"
SCHEMA = pa.schema([("key", pa.string()), ("token_row", pa.int32())])
BUCKETED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("token_row", pa.int32()),
        ("bucket", pa.string()),
        ("bucket_row", pa.int32()),
        ("sha256", pa.string()),
    ]
)
SPEC_KEY = b"latent_spec"
_TOKEN_IDENTITY = (b"tokens_bytes", b"tokens_mtime_ns")


def path(root: Path, source: str, shard: str) -> Path:
    return root / source / STAGE / f"{shard}{SUFFIX}"


def latents_path(root: Path, source: str, shard: str, bucket: str | None = None) -> Path:
    """The latents of a shard (legacy: `NNNNN.npy`) or of one of its buckets (`NNNNN.WxH.npy`)."""
    return root / source / STAGE / (f"{shard}.{bucket}.npy" if bucket else f"{shard}.npy")


def tokens_path(root: Path, source: str, shard: str) -> Path:
    return root / source / "tokens" / f"{shard}.parquet"


def _identity(tokens: Path) -> dict[bytes, bytes]:
    """What marks the tokens file a shard was encoded against: its size and mtime."""
    try:
        st = tokens.stat()
    except FileNotFoundError:
        return {}
    return {
        b"tokens_bytes": str(st.st_size).encode(),
        b"tokens_mtime_ns": str(st.st_mtime_ns).encode(),
    }


def write(
    root: Path, source: str, shard: str, keys: Sequence[str], token_rows: Sequence[int]
) -> None:
    """The shard's keys file (temp then rename, like every output)."""
    write_table(
        path(root, source, shard), table(keys, token_rows, tokens_path(root, source, shard))
    )


def table(keys, token_rows, tokens: Path) -> pa.Table:
    """A keys file's table (keys and token rows: sequences or Arrow/numpy arrays), marked with
    the identity of the tokens file `tokens` its rows point into."""
    return pa.table(
        {
            "key": keys if isinstance(keys, pa.Array) else pa.array(keys, pa.string()),
            "token_row": pa.array(token_rows, pa.int32()),
        },
        schema=SCHEMA.with_metadata(_identity(tokens)),
    )


def bucketed_table(
    keys, token_rows, buckets, bucket_rows, sha256, tokens: Path, spec: dict
) -> pa.Table:
    """A keys file's table of the per-bucket layout: the columns above, marked with the tokens
    file's identity and the latent spec the shard was encoded under."""
    metadata = _identity(tokens) | {SPEC_KEY: json.dumps(spec, sort_keys=True).encode()}
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "token_row": pa.array(token_rows, pa.int32()),
            "bucket": pa.array(buckets, pa.string()),
            "bucket_row": pa.array(bucket_rows, pa.int32()),
            "sha256": pa.array(sha256, pa.string()),
        },
        schema=BUCKETED_SCHEMA.with_metadata(metadata),
    )


def write_table(final: Path, table: pa.Table) -> None:
    with (
        atomic_path(final) as tmp,
        pa.OSFile(str(tmp), "wb") as f,
        pa.ipc.new_file(f, table.schema) as writer,
    ):
        writer.write_table(table)


def read(root: Path, source: str, shard: str, record: ShardStats | None = None) -> pa.Table:
    """key, token_row of the shard's latent rows, in latent order (memory-mapped).

    Without a keys file (a shard encoded by an older sdpipe), from its stats record; a record
    without keys either raises FileNotFoundError naming the shard.
    """
    p = path(root, source, shard)
    try:
        return pa.ipc.open_file(pa.memory_map(str(p))).read_all()
    except FileNotFoundError:
        pass
    if record is None:
        record = ShardStats.read(stats_path(root, source, STAGE, shard))
    if "keys" not in record.extra:
        raise FileNotFoundError(
            f"{p}: missing, and the stats record of {source}/{shard} lists no keys; "
            f"encode the shard again (delete {p.with_name(f'{shard}.stats.json')})"
        )
    return pa.table(
        {
            "key": pa.array(record.extra["keys"], pa.string()),
            "token_row": pa.array(record.extra["token_rows"], pa.int32()),
        }
    )


def tokens_unchanged(root: Path, source: str, shard: str, table: pa.Table) -> bool:
    """True when the tokens file is the one the keys file was written against (size, mtime)."""
    recorded = {k: v for k, v in (table.schema.metadata or {}).items() if k in _TOKEN_IDENTITY}
    return bool(recorded) and recorded == _identity(tokens_path(root, source, shard))


def tokens_match(root: Path, source: str, shard: str, table: pa.Table) -> bool:
    """The exact check: the tokens file's key at each `token_row` is the row's key."""
    tokens = tokens_path(root, source, shard)
    if not tokens.exists():
        return False
    token_keys = pq.read_table(tokens, columns=["key"])["key"]
    rows = table["token_row"].to_numpy()
    if len(rows) and (rows.min() < 0 or rows.max() >= len(token_keys)):
        return False
    return len(rows) == 0 or pc.all(pc.equal(token_keys.take(rows), table["key"])).as_py() is True


def sample(
    root: Path, source: str, records: Sequence[ShardStats], num_samples: int, seed: int
) -> list[tuple[str, int, str]]:
    """(shard, row of its keys file, key) of the first `num_samples` of a permutation (seeded)
    of every encoded row of `records`, in row order: only the picked shards' keys are read.
    The row is the latent row of the legacy layout; of the per-bucket one, `locate` it."""
    counts = np.array([s.num_out for s in records], np.int64)
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    chosen = np.sort(np.random.default_rng(seed).permutation(total)[:num_samples])
    which = np.searchsorted(ends, chosen, side="right")
    picked = []
    for c, w in zip(chosen.tolist(), which.tolist(), strict=True):
        record = records[w]
        row = c - int(ends[w] - counts[w])
        key = read(root, source, record.shard, record)["key"][row].as_py()
        picked.append((record.shard, row, key))
    return picked


def locate(table: pa.Table, row: int) -> tuple[str | None, int]:
    """(bucket or None for the legacy layout, row in that latents file) of a keys file's row."""
    if "bucket" not in table.column_names:
        return None, row
    return table["bucket"][row].as_py(), int(table["bucket_row"][row].as_py())


def spec(table: pa.Table) -> dict | None:
    """The latent spec of a keys file encoded in buckets (`{"vae", "plan", "views", "channels"}`,
    its schema metadata `latent_spec`), or None for a legacy shard (no `bucket` column: one
    `NNNNN.npy` [N, 4, h, w]). A bucketed file without one is read as 1 view of 4 channels."""
    if "bucket" not in table.column_names:
        return None
    recorded = (table.schema.metadata or {}).get(SPEC_KEY)
    return json.loads(recorded) if recorded else {"views": 1, "channels": 4}
