"""fetch-images bounds every download by a wall-clock limit and a byte cap: a URL that streams
forever (slowly, each read well within the socket timeout) or sends a huge body becomes a
`timeout` / `too_large` row, and the shard completes in bounded time with its other rows
fetched (issue 26, item 3). img2dataset alone has a per-read socket timeout only."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.sources import fetch_images
from tests.tasks import bad_images as bad
from tests.tasks.conftest import loopback_server

SIZE = 32
DRIP_S = 0.2  # the endless server's pause between writes: far below the socket timeout
SOCKET_TIMEOUT = 5
MAX_SECONDS = 2
MAX_BYTES = 1_000_000
# What a misbehaving response sends at most, so that a test never streams without end even
# when the fetch under test does not stop reading.
SERVER_LIMIT_S = 90
SERVER_LIMIT_BYTES = 256 * 1024 * 1024


@contextmanager
def misbehaving_server() -> Iterator[tuple[str, dict]]:
    """A loopback server: `/endless` drips 64 bytes every DRIP_S without end (no length, kept
    open), `/huge-declared` announces and streams 1 GiB, `/huge` streams without a length
    as fast as it can, `/ok/N.jpg` a small JPEG. Every stream ends when the server stops,
    the client goes, or SERVER_LIMIT_S / SERVER_LIMIT_BYTES is reached."""
    jpeg = bad.jpeg()
    stop = threading.Event()
    counts = {"endless": 0, "huge": 0, "ok": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # close-delimited bodies: no length needed

        def _stream(self, chunk: bytes, pause: float, length: int | None) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            if length is not None:
                self.send_header("Content-Length", str(length))
            self.end_headers()
            sent, start = 0, time.monotonic()
            try:
                while (
                    not stop.is_set()
                    and sent < SERVER_LIMIT_BYTES
                    and time.monotonic() - start < SERVER_LIMIT_S
                ):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                    if pause:
                        stop.wait(pause)
            except OSError:  # the client hung up: what a bounded fetch does
                pass

        def do_GET(self):  # noqa: N802
            if self.path == "/endless":
                counts["endless"] += 1
                self._stream(jpeg[:2] + b"\0" * 62, DRIP_S, None)
            elif self.path == "/huge-declared":
                counts["huge"] += 1
                self._stream(b"\xff" * 65536, 0, 1 << 30)
            elif self.path == "/huge":
                counts["huge"] += 1
                self._stream(b"\xff" * 65536, 0, None)
            else:
                counts["ok"] += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(jpeg)))
                self.end_headers()
                self.wfile.write(jpeg)

        def log_message(self, *args):
            pass

    with loopback_server(Handler) as url:
        try:
            yield url, counts
        finally:
            stop.set()  # before the shutdown: it waits for the streaming handlers


def _download(url: str, **limits) -> tuple[object, str | None, float]:
    from tasks.sources import bounded_download

    start = time.monotonic()
    _, stream, error = bounded_download.download_with_retry(
        (0, url),
        timeout=bounded_download.Limits(SOCKET_TIMEOUT, allow_private_hosts=True, **limits),
        retries=2,
        user_agent_token=None,
        disallowed_header_directives=None,
    )
    return stream, error, time.monotonic() - start


def test_one_download_stops_at_its_wall_clock_limit_and_its_byte_cap():
    from tasks.sources import bounded_download

    bounded_download.install()  # as a downloader process does: img2dataset imported first
    with misbehaving_server() as (url, counts):
        stream, error, seconds = _download(f"{url}/endless", max_seconds=1, max_bytes=MAX_BYTES)
        assert stream is None and fetch_images.drop_reason(error) == "timeout", error
        assert 1 <= seconds < 1 + SOCKET_TIMEOUT  # the limit, not a socket timeout, ended it
        for path in ("/huge-declared", "/huge"):
            stream, error, seconds = _download(url + path, max_seconds=30, max_bytes=MAX_BYTES)
            assert stream is None and fetch_images.drop_reason(error) == "too_large", error
            assert seconds < 10
        stream, error, _ = _download(f"{url}/ok/1.jpg", max_seconds=30, max_bytes=MAX_BYTES)
        assert error is None and stream.read() == bad.jpeg()
    # A download past a limit is not tried again (img2dataset retries every other failure):
    # the same answer would come back, after the same wait.
    assert counts == {"endless": 1, "huge": 2, "ok": 1}


def test_the_limits_come_from_the_source_else_the_environment_else_the_defaults(monkeypatch):
    from tasks.sources import bounded_download

    monkeypatch.delenv("SDPIPE_FETCH_MAX_SECONDS", raising=False)
    monkeypatch.delenv("SDPIPE_FETCH_MAX_BYTES", raising=False)
    defaults = fetch_images.fetch_limits({})
    assert defaults == {
        "max_seconds": bounded_download.MAX_SECONDS,
        "max_bytes": bounded_download.MAX_BYTES,
    }
    monkeypatch.setenv("SDPIPE_FETCH_MAX_SECONDS", "30")
    monkeypatch.setenv("SDPIPE_FETCH_MAX_BYTES", "5000000")
    assert fetch_images.fetch_limits({}) == {"max_seconds": 30, "max_bytes": 5_000_000}
    source = {"fetch_max_seconds": 7, "fetch_max_bytes": 1234}
    assert fetch_images.fetch_limits(source) == {"max_seconds": 7, "max_bytes": 1234}
    with pytest.raises(ValueError, match="fetch_max_bytes"):
        fetch_images.fetch_limits({"fetch_max_bytes": 0})
    monkeypatch.setenv("SDPIPE_FETCH_MAX_SECONDS", "soon")
    with pytest.raises(ValueError, match="SDPIPE_FETCH_MAX_SECONDS"):
        fetch_images.fetch_limits({})


def test_endless_and_huge_urls_end_as_rows_and_the_shard_completes(tmp_path, monkeypatch):
    """The whole stage, through the node's downloader processes, with its limits taken from the
    environment (as a user would set them)."""
    monkeypatch.setenv("SDPIPE_FETCH_PROCESSES", "1")
    monkeypatch.setenv("SDPIPE_FETCH_MAX_SECONDS", str(MAX_SECONDS))
    monkeypatch.setenv("SDPIPE_FETCH_MAX_BYTES", str(MAX_BYTES))
    root = tmp_path / "data"
    (root / "src" / "filtered").mkdir(parents=True)
    paths = ["/endless", "/huge-declared", "/huge", "/endless"] + [f"/ok/{i}.jpg" for i in range(6)]
    keys = [f"{i:09d}" for i in range(len(paths))]
    done: dict = {}
    with misbehaving_server() as (url, _):
        rows = pa.table(
            {
                "key": keys,
                "url": [url + p for p in paths],
                "caption": [f"row {i}" for i in range(len(paths))],
            }
        )
        pq.write_table(rows, root / "src" / "filtered" / "00000.parquet")

        def fetch() -> None:
            try:
                done["stats"] = fetch_images.fetch_images_shard(
                    root,
                    "src",
                    "00000",
                    image_size=SIZE,
                    min_side=0,
                    thread_count=4,
                    timeout=SOCKET_TIMEOUT,
                    allow_private_hosts=True,  # served on 127.0.0.1
                )
            except BaseException as e:  # noqa: BLE001  (reported below)
                done["error"] = e

        start = time.monotonic()
        worker = threading.Thread(target=fetch, daemon=True)
        worker.start()
        # Downloader start-up (~3 s of imports on a quiet machine) + the limit, with room for a
        # loaded one; without limits the endless rows never end.
        worker.join(60)
        seconds = time.monotonic() - start
        assert not worker.is_alive(), f"the shard still runs after {seconds:.0f} s"
    assert "error" not in done, done.get("error")
    stats = done["stats"]
    assert stats.dropped == {"timeout": 2, "too_large": 2}
    assert stats.num_out == 6
    table = pq.read_table(root / "src" / "shards" / "00000.parquet")
    status = dict(zip(table["key"].to_pylist(), table["status"].to_pylist(), strict=True))
    assert [status[k] for k in keys] == ["timeout", "too_large", "too_large", "timeout"] + [
        "success"
    ] * 6
