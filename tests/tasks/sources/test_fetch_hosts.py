"""fetch-images connects only where the source's private-host rule allows, on every redirect hop
and after name resolution, and resolves names within the download's deadline (issue 33, item 4).
Loopback only: `SDPIPE_FETCH_PUBLIC_FOR_TESTS` makes one server's 127.0.0.1 port "public", the
other stays private; `bounded_download.resolve` stands in for a name server."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.runtime import node as node_module
from tasks.sources import bounded_download, fetch_images
from tests.tasks import bad_images as bad
from tests.tasks.conftest import loopback_server

SOCKET_TIMEOUT = 5


@contextmanager
def two_servers() -> Iterator[tuple[str, str, dict]]:
    """(public URL, private URL, requests by server): both on 127.0.0.1. The public one serves
    `/ok/N.jpg` and redirects `/to-private/N.jpg` to the private one's `/N.jpg` (302); the
    private one serves any path as a JPEG. `hosts` records the Host header of each request."""
    jpeg = bad.jpeg()
    seen: dict = {"public": [], "private": [], "hosts": []}

    def handler(name: str, redirect_to: str | None):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen[name].append(self.path)
                seen["hosts"].append(self.headers["Host"])
                if redirect_to and self.path.startswith("/to-private/"):
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path[len("/to-private") :])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", str(len(jpeg)))
                self.end_headers()
                self.wfile.write(jpeg)

            def log_message(self, *args):
                pass

        return Handler

    with (
        loopback_server(handler("private", None)) as private,
        loopback_server(handler("public", private)) as public,
    ):
        yield public, private, seen


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _download(url: str, *, max_seconds: float = 10, allow: bool = False):
    start = time.monotonic()
    _, stream, error = bounded_download.download_with_retry(
        (0, url),
        timeout=bounded_download.Limits(
            SOCKET_TIMEOUT, max_seconds=max_seconds, allow_private_hosts=allow
        ),
        retries=2,
        user_agent_token=None,
        disallowed_header_directives=None,
    )
    return stream, error, time.monotonic() - start


@pytest.mark.parametrize(
    "ip",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "0.0.0.0",
        "::",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata (link-local)
        "fe80::1",
        "100.64.0.1",  # CGNAT
        "fc00::1",  # unique-local
        "fd12:3456::1",
        "fec0::1",  # site-local
        "224.0.0.1",  # multicast
        "240.0.0.1",  # reserved
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    ],
)
def test_private_addresses_in_every_form_are_refused(ip):
    assert not bounded_download.is_public_address(ip, 80)


def test_public_addresses_pass_and_the_seam_names_loopback_only(monkeypatch):
    for ip in ("8.8.8.8", "::ffff:8.8.8.8", "2606:4700:4700::1111"):  # never connected to
        assert bounded_download.is_public_address(ip, 80), ip
    monkeypatch.setenv(bounded_download.PUBLIC_FOR_TESTS, "127.0.0.1:8123")
    assert bounded_download.is_public_address("127.0.0.1", 8123)
    assert not bounded_download.is_public_address("127.0.0.1", 8124)
    monkeypatch.setenv(bounded_download.PUBLIC_FOR_TESTS, "10.0.0.1:80")
    with pytest.raises(ValueError, match="not a loopback"):
        bounded_download.is_public_address("10.0.0.1", 80)


def test_every_hop_is_checked_where_it_connects(monkeypatch):
    with two_servers() as (public, private, seen):
        # Without the seam the first hop is refused already, before any request is sent.
        stream, error, _ = _download(f"{public}/ok/1.jpg")
        assert stream is None and fetch_images.drop_reason(error) == "private_host", error
        assert seen["public"] == []
        monkeypatch.setenv(bounded_download.PUBLIC_FOR_TESTS, f"127.0.0.1:{_port(public)}")
        stream, error, _ = _download(f"{public}/ok/1.jpg")
        assert error is None and stream.read() == bad.jpeg()
        # The redirect's second hop goes to a private address: refused, not tried again.
        stream, error, _ = _download(f"{public}/to-private/2.jpg")
        assert stream is None and fetch_images.drop_reason(error) == "private_host", error
        assert seen["public"] == ["/ok/1.jpg", "/to-private/2.jpg"]
        assert seen["private"] == []
        # A source that allows private hosts follows it.
        stream, error, _ = _download(f"{public}/to-private/3.jpg", allow=True)
        assert error is None and stream.read() == bad.jpeg()
        assert seen["private"] == ["/3.jpg"]


def test_a_name_is_resolved_once_and_its_checked_address_connected_to(monkeypatch):
    """A name that answers public, then private (rebinding) is connected where it was checked;
    one that has a private address among its answers is refused."""
    with two_servers() as (public, _, seen):
        port = _port(public)
        monkeypatch.setenv(bounded_download.PUBLIC_FOR_TESTS, f"127.0.0.1:{port}")
        lookups = []

        def resolve(host, port):
            lookups.append(host)
            first = host == "rebind.test" and lookups.count(host) == 1
            ips = {
                "rebind.test": ["127.0.0.1" if first else "127.0.0.2"],
                "mixed.test": ["127.0.0.1", "127.0.0.2"],
            }[host]
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

        monkeypatch.setattr(bounded_download, "resolve", resolve)
        stream, error, _ = _download(f"http://rebind.test:{port}/ok/1.jpg")
        assert error is None and stream.read() == bad.jpeg()
        assert lookups == ["rebind.test"]
        assert seen["hosts"] == [f"rebind.test:{port}"]  # the name kept for the server
        stream, error, _ = _download(f"http://mixed.test:{port}/ok/2.jpg")
        assert fetch_images.drop_reason(error) == "private_host", error
        assert len(seen["public"]) == 1


def test_through_a_proxy_the_rule_applies_to_the_urls_host(monkeypatch):
    """The proxy (the operator's choice, here private) is connected to; a URL whose host is
    private never reaches it."""
    with two_servers() as (public, private, seen):
        monkeypatch.setenv(bounded_download.PUBLIC_FOR_TESTS, f"127.0.0.1:{_port(public)}")
        # The private server plays the proxy: it answers any request line with the image.
        opener = bounded_download._opener({"http": private})
        monkeypatch.setattr(bounded_download, "_OPENER", opener)
        stream, error, _ = _download(f"{public}/ok/1.jpg")
        assert error is None and stream.read() == bad.jpeg()
        assert seen["private"] == [f"{public}/ok/1.jpg"]  # through the proxy
        stream, error, _ = _download(f"{private}/x.jpg")
        assert fetch_images.drop_reason(error) == "private_host", error
        assert len(seen["private"]) == 1 and seen["public"] == []


def test_a_slow_name_lookup_ends_at_the_deadline(monkeypatch):
    """A lookup of 8 s with a limit of 2 s: the download returns at 2 s as `timeout`, once."""
    lookups = []

    def resolve(host, port):
        lookups.append(host)
        time.sleep(8)  # the abandoned lookup ends on its own, in its own thread
        return []

    monkeypatch.setattr(bounded_download, "resolve", resolve)
    stream, error, seconds = _download("http://slow.test/1.jpg", max_seconds=2)
    assert stream is None and fetch_images.drop_reason(error) == "timeout", error
    assert 2 <= seconds < 2.5, seconds
    assert lookups == ["slow.test"]  # a limit: not tried again


def test_a_stalled_tls_handshake_ends_at_the_deadline():
    """A server that accepts and never answers the TLS handshake: the deadline, not the socket
    timeout (three tries of 5 s before), ends it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        accepted = []
        threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
        stream, error, seconds = _download(
            f"https://127.0.0.1:{port}/1.jpg", max_seconds=1, allow=True
        )
    assert stream is None and fetch_images.drop_reason(error) == "timeout", error
    assert 1 <= seconds < 2, seconds


def test_a_redirect_to_a_private_host_is_a_counted_row_and_the_shard_completes(
    tmp_path, monkeypatch
):
    """The whole stage, through the node's downloader processes. The seam reaches them through
    the environment, so they are started for this test (not the kept ones of earlier tests)."""
    monkeypatch.setenv("SDPIPE_FETCH_PROCESSES", "1")
    monkeypatch.setattr(node_module, "_nodes", {})  # a fresh node: fresh downloaders
    root = tmp_path / "data"
    (root / "src" / "filtered").mkdir(parents=True)
    with two_servers() as (public, private, seen):
        monkeypatch.setenv(bounded_download.PUBLIC_FOR_TESTS, f"127.0.0.1:{_port(public)}")
        urls = [f"{public}/ok/{i}.jpg" for i in range(3)]
        urls += [f"{public}/to-private/{i}.jpg" for i in range(2)] + [f"{private}/5.jpg"]
        keys = [f"{i:09d}" for i in range(len(urls))]
        rows = pa.table({"key": keys, "url": urls, "caption": [f"row {i}" for i in keys]})
        pq.write_table(rows, root / "src" / "filtered" / "00000.parquet")
        try:
            stats = fetch_images.fetch_images_shard(
                root, "src", "00000", image_size=32, min_side=0, thread_count=4
            )
        finally:
            node_module.close_nodes()
    assert stats.dropped == {"private_host": 3}
    assert stats.num_out == 3
    assert seen["private"] == []
    table = pq.read_table(root / "src" / "shards" / "00000.parquet")
    status = dict(zip(table["key"].to_pylist(), table["status"].to_pylist(), strict=True))
    assert [status[k] for k in keys] == ["success"] * 3 + ["private_host"] * 3
