"""fetch-images sizes its downloads to the node: img2dataset downloader processes (one per core
by default) with many threads each, shared by the shard tasks and kept for every shard, and a
shard split into pieces that download in parallel and are decoded as each one is done."""

from __future__ import annotations

import http.server
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.latents import images
from tasks.runtime import concurrency
from tasks.sources import fetch_images
from tests.tasks import bad_images as bad
from tests.tasks.conftest import loopback_server

SIZE = 32
FETCH_ENV = ("SDPIPE_WORKERS", "SDPIPE_FETCH_PROCESSES", "SDPIPE_FETCH_THREADS")


@pytest.fixture
def no_fetch_env(monkeypatch):
    for name in FETCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_processes_follow_the_cores_and_threads_default_to_64(no_fetch_env):
    no_fetch_env.setattr(concurrency, "cores", lambda: 6)
    assert concurrency.fetch_parallelism() == (6, 64)
    assert fetch_images.parallelism() == (6, 64)
    # The worker budget (SDPIPE_WORKERS, or a flow's `workers`) sizes it instead of the cores.
    no_fetch_env.setenv("SDPIPE_WORKERS", "3")
    assert fetch_images.parallelism() == (3, 64)
    assert concurrency.fetch_parallelism(budget=5) == (5, 64)
    # A task's thread_count (the tests' small servers) overrides the threads only.
    assert fetch_images.parallelism(thread_count=4) == (3, 4)


def test_the_environment_overrides_processes_and_threads(no_fetch_env):
    no_fetch_env.setenv("SDPIPE_FETCH_PROCESSES", "3")
    no_fetch_env.setenv("SDPIPE_FETCH_THREADS", "128")
    assert fetch_images.parallelism() == (3, 128)
    no_fetch_env.setenv("SDPIPE_FETCH_THREADS", "0")
    with pytest.raises(ValueError, match="SDPIPE_FETCH_THREADS"):
        fetch_images.parallelism()


def test_a_shard_is_split_so_that_every_process_works_and_pieces_stay_short():
    # A LAION shard: pieces of at most 8 rounds of 64 threads.
    assert fetch_images.piece_rows(10_000, 2, 64) == 500
    assert fetch_images.piece_rows(10_000, 32, 64) == 313  # 32 pieces: every process busy
    assert fetch_images.piece_rows(1_000, 2, 64) == 500
    # A small shard is not cut below a round of threads per piece.
    assert fetch_images.piece_rows(48, 2, 64) == 48
    assert fetch_images.piece_rows(100, 4, 64) == 50
    assert fetch_images.piece_rows(0, 2, 64) == 1


@contextmanager
def slow_server(body: bytes, delay_s: float) -> Iterator[tuple[str, dict]]:
    """A loopback server answering every GET with `body` after `delay_s`; its counts."""
    lock = threading.Lock()
    counts = {"in_flight": 0, "max_in_flight": 0, "requests": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            with lock:
                counts["in_flight"] += 1
                counts["requests"] += 1
                counts["max_in_flight"] = max(counts["max_in_flight"], counts["in_flight"])
            try:
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
            finally:
                # Ended before the body goes out: the client cannot have its response, and so
                # cannot send its next request, before this count drops (counted after the
                # write, a fast client's next request could be counted beside this one).
                with lock:
                    counts["in_flight"] -= 1
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with loopback_server(Handler, request_queue_size=256) as url:
        yield url, counts


def test_a_shard_downloads_on_the_nodes_processes_in_pieces(tmp_path, no_fetch_env):
    no_fetch_env.setenv("SDPIPE_FETCH_PROCESSES", "2")
    no_fetch_env.setenv("SDPIPE_FETCH_THREADS", "3")
    n = 40
    jpeg = bad.jpeg()
    root = tmp_path / "data"
    (root / "src" / "filtered").mkdir(parents=True)
    keys = [f"{i:09d}" for i in range(n)]
    with slow_server(jpeg, 0.05) as (url, counts):
        rows = pa.table(
            {
                "key": keys,
                "url": [f"{url}/{i}.jpg" for i in range(n)],
                "caption": [f"image {i}" for i in range(n)],
            }
        )
        pq.write_table(rows, root / "src" / "filtered" / "00000.parquet")
        stats = fetch_images.fetch_images_shard(
            root, "src", "00000", image_size=SIZE, min_side=0, allow_private_hosts=True
        )
    assert stats.num_out == n and stats.dropped == {}
    assert counts["requests"] == n
    # 2 processes x 3 threads: never more requests at once than that.
    assert counts["max_in_flight"] <= 6
    pool = fetch_images.fetch_pool(2)  # the pool the shard used, kept
    assert len(pool.threads) == 2
    # 40 rows at 3 threads: pieces of at most 8 rounds (24 rows): 2 pieces, their keys mapped
    # back to the shard's rows, the sample table in the shard's order.
    assert fetch_images.piece_rows(n, 2, 3) == 20
    table = pq.read_table(root / "src" / "shards" / "00000.parquet")
    assert table["key"].to_pylist() == keys
    assert set(table["status"].to_pylist()) == {"success"}
    expected, _, _ = images.repack_image(jpeg, SIZE)
    with tarfile.open(root / "src" / "shards" / "00000.tar") as tar:
        names = tar.getnames()
        assert sorted(names) == sorted(f"{k}.{e}" for k in keys for e in ("jpg", "txt", "json"))
        assert tar.extractfile(f"{keys[7]}.jpg").read() == expected
        assert tar.extractfile(f"{keys[33]}.txt").read() == b"image 33"
    # No piece left behind in the shard folder.
    assert not list((root / "src" / "shards").glob(".*"))


def test_a_piece_that_img2dataset_cannot_run_fails_the_shard_with_its_error(tmp_path):
    pool = fetch_images.FetchPool(1)
    try:
        future = pool.submit(
            dict(
                piece=0,
                input=str(tmp_path / "missing.feather"),
                output_folder=str(tmp_path),
                rows=1,
                thread_count=1,
                timeout=1,
                retries=0,
            )
        )
        with pytest.raises(fetch_images.FetchFailed, match="missing.feather"):
            future.result(timeout=120)
    finally:
        pool.close()
