"""fetch-images: one filtered URL shard -> img2dataset -> `shards/NNNNN.tar` + sample table.

img2dataset only downloads (`disable_all_reencoding`: it keeps each image's bytes as served);
the images then go through sdpipe's own decode workers (`tasks.images`), the one rule set of
every source: EXIF orientation, 16-bit, alpha, CMYK, bombs (`too_large`), truncation, the size
floor, resize + crop, JPEG. img2dataset runs in a child process (it installs signal handlers,
which only a process's main thread may do, and stage tasks run in threads) and writes into a
hidden temporary folder; its status parquet becomes the shard's sample table, with every
failure mapped to a named drop reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks import images
from tasks.shards import (
    ShardStats,
    atomic_path,
    bump_generation,
    run_shard,
    stats_path,
    write_record,
)

STAGE = "shards"
KEY_COLUMN = "sdpipe_key"


def drop_reason(error_message: str | None) -> str:
    """img2dataset's free-text error -> a drop reason users can count and search for."""
    msg = (error_message or "").lower()
    if m := re.search(r"http error (\d{3})", msg):
        return f"http_{m.group(1)}"
    if "too small" in msg:
        return "too_small"
    if "decoding error" in msg or "cannot identify" in msg:
        return "decode_error"
    if "x-robots-tag" in msg:
        return "robots_optout"
    if "timed out" in msg or "timeout" in msg:
        return "timeout"
    if "hash mismatch" in msg:
        return "hash_mismatch"
    return "fetch_error"


class FetchFailed(Exception):
    """img2dataset itself failed (not one URL: the whole shard)."""


def run_img2dataset(workdir: Path, kwargs: dict) -> None:
    """`img2dataset.download(**kwargs)` in a child process; its output goes to a log file."""
    log = workdir / "img2dataset.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, sys; from img2dataset import download; "
                "download(**json.load(sys.stdin))",
            ],
            input=json.dumps(kwargs),
            text=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-5:]
        raise FetchFailed(f"img2dataset exited with {proc.returncode}: {' | '.join(tail)}")


def download(
    table: pa.Table,
    workdir: Path,
    *,
    thread_count: int = 16,
    retries: int = 2,
    timeout: int = 10,
) -> tuple[pa.Table, Path]:
    """img2dataset over `table`'s rows (url, caption, key) into `workdir`, images kept as
    served: (its status parquet, with the sdpipe key in KEY_COLUMN; its tar)."""
    pq.write_table(
        table.select(["url", "caption", "key"]).rename_columns(["url", "caption", KEY_COLUMN]),
        workdir / "input.parquet",
    )
    run_img2dataset(
        workdir,
        dict(
            url_list=str(workdir / "input.parquet"),
            input_format="parquet",
            url_col="url",
            caption_col="caption",
            save_additional_columns=[KEY_COLUMN],
            output_folder=str(workdir / "out"),
            output_format="webdataset",
            disable_all_reencoding=True,
            processes_count=1,
            thread_count=thread_count,
            number_sample_per_shard=max(table.num_rows, 1),
            retries=retries,
            timeout=timeout,
            compute_hash="sha256",
            enable_wandb=False,
        ),
    )
    return pq.read_table(workdir / "out" / "00000.parquet"), workdir / "out" / "00000.tar"


def _raw_images(raw_tar: Path, i2d_keys: dict[str, str], row_of: dict[str, int]) -> Iterator:
    """(row, bytes, None) of every image img2dataset fetched, in the order of its tar."""
    with tarfile.open(raw_tar) as src:
        for member in src:
            name, _, ext = member.name.partition(".")
            if member.isfile() and ext == "jpg":  # the served bytes, whatever their format
                yield row_of[i2d_keys[name]], src.extractfile(member).read(), None


def repack_fetched(
    tar: tarfile.TarFile,
    rows: pa.Table,
    status: pa.Table,
    raw_tar: Path,
    *,
    size: int,
    min_side: int,
) -> list[tuple[str, int | None, int | None]]:
    """Decode img2dataset's raw images by sdpipe's rules into `tar` (key.jpg/.txt/.json);
    per row of `rows` (url, caption, key): (status, stored width, stored height)."""
    keys = rows["key"].to_pylist()
    row_of = {k: i for i, k in enumerate(keys)}
    fetched = {r[KEY_COLUMN]: r for r in status.to_pylist()}
    out: list[tuple[str, int | None, int | None]] = []
    for key in keys:
        r = fetched[key]
        ok = r["status"] == "success"
        out.append(("success" if ok else drop_reason(r["error_message"]), None, None))
    i2d_keys = dict(zip(status["key"].to_pylist(), status[KEY_COLUMN].to_pylist(), strict=True))
    results = images.repack_stream(
        images.shared_pool(),
        _raw_images(raw_tar, i2d_keys, row_of),
        size,
        min_side=min_side,
    )
    captions = rows["caption"].to_pylist()
    for i, result in results:
        if isinstance(result, str):
            out[i] = (result, None, None)
            continue
        jpeg, width, height = result
        meta = {k: v for k, v in fetched[keys[i]].items() if k != KEY_COLUMN}
        meta.update(key=keys[i], width=width, height=height)
        for drop in ("original_width", "original_height", "exif"):
            meta.pop(drop, None)
        images.write_sample(tar, keys[i], jpeg, captions[i] or "", meta)
        out[i] = ("success", width, height)
    return out


def fetch_images_shard(
    root: Path,
    source: str,
    shard: str,
    *,
    image_size: int,
    min_side: int,
    **download_options,
) -> ShardStats:
    filtered = root / source / "filtered" / f"{shard}.parquet"
    out_dir = root / source / STAGE

    def work(stats: ShardStats) -> None:
        table = pq.read_table(filtered)
        stats.num_in = table.num_rows
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{shard}.tmp-") as tmp:
            status, raw_tar = download(table, Path(tmp), **download_options)
            with (
                atomic_path(out_dir / f"{shard}.tar") as tar_tmp,
                tarfile.open(tar_tmp, "w") as tar,
            ):
                fetched = repack_fetched(
                    tar, table, status, raw_tar, size=image_size, min_side=min_side
                )
        samples = _sample_table(table, status, fetched, source)
        with atomic_path(out_dir / f"{shard}.parquet") as tmp_table:
            pq.write_table(samples, tmp_table)
        _count(stats, samples)

    out_dir.mkdir(parents=True, exist_ok=True)
    return run_shard(root, source, STAGE, shard, work)


def _count(stats: ShardStats, samples: pa.Table) -> None:
    """Drops by reason and the failed URLs (the list `sdpipe refetch` works from)."""
    statuses = samples["status"].to_pylist()
    for s in statuses:
        if s != "success":
            stats.drop(s)
    stats.num_out = statuses.count("success")
    urls = samples["url"].to_pylist()
    stats.extra = {
        **stats.extra,
        "failed_urls": [u for u, s in zip(urls, statuses, strict=True) if s != "success"],
    }


# Failures worth another try by default: the server or the network, not the image.
TRANSIENT = re.compile(r"http_(408|429|5\d\d)|timeout|fetch_error")
# Stages computed from a shard's fetched images, whose records a refetch makes stale.
DOWNSTREAM = ("scores", "tokens", "latents")
DOWNSTREAM_ALL = ("selected", "views")


def failed_samples(root: Path, source: str) -> pa.Table:
    """Every URL whose fetch failed, across the source's shards: shard, key, url, status,
    error_message."""
    parts = []
    for path in sorted((root / source / STAGE).glob("[0-9]*.parquet")):
        t = pq.read_table(path, columns=["key", "url", "status", "error_message"])
        t = t.filter(pc.not_equal(t["status"], "success"))
        parts.append(t.add_column(0, "shard", pa.array([path.stem] * t.num_rows, pa.string())))
    if not parts:
        return pa.table(
            {
                c: pa.array([], pa.string())
                for c in ("shard", "key", "url", "status", "error_message")
            }
        )
    return pa.concat_tables(parts)


def refetch_shard(
    root: Path,
    source: str,
    shard: str,
    *,
    image_size: int,
    min_side: int,
    reasons: re.Pattern | None = TRANSIENT,
    **download_options,
) -> ShardStats | None:
    """Fetch a done shard's failed URLs again (those whose reason matches `reasons`; None: all),
    keeping every image already fetched. The shard's tar, sample table and stats record are
    rewritten (each renamed into place; a rerun after a kill redoes the refetch), and the
    records of the stages computed from the shard are removed, so they run again. Returns the
    new stats, or None when there was nothing to refetch."""
    out_dir = root / source / STAGE
    table_path = out_dir / f"{shard}.parquet"
    record = stats_path(root, source, STAGE, shard)
    if not record.exists():
        raise FetchFailed(f"{source}/{shard}: not fetched yet; run build-latents first")
    samples = pq.read_table(table_path)
    statuses = samples["status"].to_pylist()
    pick = [
        i
        for i, s in enumerate(statuses)
        if s != "success" and (reasons is None or reasons.fullmatch(s))
    ]
    if not pick:
        return None
    retry = samples.take(pick)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{shard}.tmp-refetch-") as tmp:
        status, raw_tar = download(retry, Path(tmp), **download_options)
        again = set(retry["key"].to_pylist())
        with (
            atomic_path(out_dir / f"{shard}.tar") as tar_tmp,
            tarfile.open(out_dir / f"{shard}.tar") as old,
            tarfile.open(tar_tmp, "w") as new,
        ):
            for member in old:  # what was fetched before stays, byte for byte
                if member.name.partition(".")[0] not in again:
                    new.addfile(member, old.extractfile(member))
            fetched = repack_fetched(
                new, retry, status, raw_tar, size=image_size, min_side=min_side
            )
        fresh = _sample_table(retry, status, fetched, source)
    by_key = {k: i for i, k in enumerate(fresh["key"].to_pylist())}
    rows = samples.to_pylist()
    fresh_rows = fresh.to_pylist()
    merged = [fresh_rows[by_key[r["key"]]] if r["key"] in by_key else r for r in rows]
    merged_table = pa.Table.from_pylist(merged, schema=samples.schema)
    stats = ShardStats(stage=STAGE, source=source, shard=shard)
    stats.num_in = samples.num_rows
    _count(stats, merged_table)
    stats.extra["refetched"] = len(pick)
    stats.check_balanced()
    invalidate_downstream(root, source, shard)
    with atomic_path(table_path) as tmp_table:
        pq.write_table(merged_table, tmp_table)
    write_record(record, stats)
    return stats


def invalidate_downstream(root: Path, source: str, shard: str) -> None:
    """Remove the done records of the stages computed from `shard` (and the whole-source
    stages), so the next build-latents run redoes them."""
    for stage in DOWNSTREAM:
        stats_path(root, source, stage, shard).unlink(missing_ok=True)
    for stage in DOWNSTREAM_ALL:
        for p in (root / source / stage).glob("*.stats.json"):
            p.unlink()
    bump_generation(root, source)


def _sample_table(
    filtered: pa.Table,
    status: pa.Table,
    fetched: list[tuple[str, int | None, int | None]],
    source: str,
) -> pa.Table:
    """The shard's sample table: metadata scores + stored size, sha256 of the served bytes,
    status (`success` or the drop reason) and img2dataset's error (or the decode rule's)."""
    by_key = {
        k: (e, sha)
        for k, e, sha in zip(
            status[KEY_COLUMN].to_pylist(),
            status["error_message"].to_pylist(),
            status["sha256"].to_pylist(),
            strict=True,
        )
    }
    keys = filtered["key"].to_pylist()
    errors, hashes = zip(*(by_key[k] for k in keys), strict=True) if keys else ((), ())
    statuses = [f[0] for f in fetched]
    messages = [
        e if e is not None or s == "success" else f"decode rules: {s}"
        for e, s in zip(errors, statuses, strict=True)
    ]
    out = filtered.drop_columns(
        [c for c in ("width", "height", "source") if c in filtered.column_names]
    )
    return (
        out.append_column("source", pa.array([source] * len(keys), pa.string()))
        .append_column("width", pa.array([f[1] for f in fetched], pa.int64()))
        .append_column("height", pa.array([f[2] for f in fetched], pa.int64()))
        .append_column("sha256", pa.array(list(hashes), pa.string()))
        .append_column("status", pa.array(statuses, pa.string()))
        .append_column("error_message", pa.array(messages, pa.string()))
    )
