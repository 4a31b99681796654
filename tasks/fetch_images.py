"""fetch-images: one filtered URL shard -> img2dataset -> `shards/NNNNN.tar` + sample table.

img2dataset runs in a child process (it installs signal handlers, which only the main thread
of a process may do, and stage tasks run in threads) and downloads into a hidden temporary
folder; its tar is then copied member by member
under sdpipe's stable keys (img2dataset numbers samples by position), and its status parquet
becomes the shard's sample table, with every failure mapped to a named drop reason.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.shards import ShardStats, atomic_path, run_shard

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


def _repack(src_tar: Path, dst_tar: Path, keys: dict[str, str]) -> None:
    """Copy the tar with members renamed from img2dataset keys to sdpipe keys."""
    with tarfile.open(src_tar) as src, tarfile.open(dst_tar, "w") as dst:
        for member in src:
            if not member.isfile():
                continue
            old_key, _, ext = member.name.partition(".")
            key = keys[old_key]
            data = src.extractfile(member).read()
            if ext == "json":
                meta = json.loads(data)
                meta["key"] = key
                meta.pop(KEY_COLUMN, None)
                data = json.dumps(meta).encode()
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mtime = member.mtime
            dst.addfile(info, io.BytesIO(data))


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


def fetch_images_shard(
    root: Path,
    source: str,
    shard: str,
    *,
    image_size: int,
    min_side: int,
    thread_count: int = 16,
    retries: int = 2,
    timeout: int = 10,
) -> ShardStats:
    filtered = root / source / "filtered" / f"{shard}.parquet"
    out_dir = root / source / STAGE

    def work(stats: ShardStats) -> None:
        table = pq.read_table(filtered)
        stats.num_in = table.num_rows
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{shard}.tmp-") as tmp:
            tmp = Path(tmp)
            pq.write_table(
                table.select(["url", "caption", "key"]).rename_columns(
                    ["url", "caption", KEY_COLUMN]
                ),
                tmp / "input.parquet",
            )
            run_img2dataset(
                tmp,
                dict(
                    url_list=str(tmp / "input.parquet"),
                    input_format="parquet",
                    url_col="url",
                    caption_col="caption",
                    save_additional_columns=[KEY_COLUMN],
                    output_folder=str(tmp / "out"),
                    output_format="webdataset",
                    image_size=image_size,
                    resize_mode="center_crop",
                    min_image_size=min_side,
                    processes_count=1,
                    thread_count=thread_count,
                    number_sample_per_shard=max(table.num_rows, 1),
                    retries=retries,
                    timeout=timeout,
                    compute_hash="sha256",
                    enable_wandb=False,
                ),
            )
            status = pq.read_table(tmp / "out" / "00000.parquet")
            img2dataset_keys = dict(
                zip(status["key"].to_pylist(), status[KEY_COLUMN].to_pylist(), strict=True)
            )
            with atomic_path(out_dir / f"{shard}.tar") as tar_tmp:
                _repack(tmp / "out" / "00000.tar", tar_tmp, img2dataset_keys)
        samples = _sample_table(table, status, source)
        with atomic_path(out_dir / f"{shard}.parquet") as tmp_table:
            pq.write_table(samples, tmp_table)
        for s in samples["status"].to_pylist():
            if s != "success":
                stats.drop(s)
        stats.num_out = stats.num_in - sum(stats.dropped.values())
        failed = [
            u
            for u, s in zip(samples["url"].to_pylist(), samples["status"].to_pylist(), strict=True)
            if s != "success"
        ]
        stats.extra = {"failed_urls": failed}

    out_dir.mkdir(parents=True, exist_ok=True)
    return run_shard(root, source, STAGE, shard, work)


def _sample_table(filtered: pa.Table, status: pa.Table, source: str) -> pa.Table:
    """The shard's sample table: metadata scores + fetched size, sha256 and status."""
    by_key = {
        k: (s, e, w, h, sha)
        for k, s, e, w, h, sha in zip(
            status[KEY_COLUMN].to_pylist(),
            status["status"].to_pylist(),
            status["error_message"].to_pylist(),
            status["original_width"].to_pylist(),
            status["original_height"].to_pylist(),
            status["sha256"].to_pylist(),
            strict=True,
        )
    }
    keys = filtered["key"].to_pylist()
    fetched = [by_key[k] for k in keys]
    statuses = ["success" if f[0] == "success" else drop_reason(f[1]) for f in fetched]
    out = filtered.drop_columns(
        [c for c in ("width", "height", "source") if c in filtered.column_names]
    )
    return (
        out.append_column("source", pa.array([source] * len(keys), pa.string()))
        .append_column("width", pa.array([f[2] for f in fetched], pa.int64()))
        .append_column("height", pa.array([f[3] for f in fetched], pa.int64()))
        .append_column("sha256", pa.array([f[4] for f in fetched], pa.string()))
        .append_column("status", pa.array(statuses, pa.string()))
        .append_column("error_message", pa.array([f[1] for f in fetched], pa.string()))
    )
