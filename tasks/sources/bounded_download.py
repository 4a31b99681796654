"""One image download with a wall-clock limit and a byte cap, for img2dataset's downloader.

img2dataset (1.47) downloads each URL with `urllib.request.urlopen(url, timeout).read()`: its
timeout is per socket operation, so a server that keeps sending (an image URL that redirects
to a live stream, a slow drip below the timeout) holds a download thread forever, and the body
grows in memory until the OOM killer ends the process; the piece, the shard, the stage and the
flow wait on it. sdpipe's downloader processes (`fetch_images.serve`) install
`download_with_retry` in img2dataset's place (`install`), which:

- ends a download `max_seconds` after it started, whatever the server does once connected: a
  watchdog thread shuts the download's sockets down at its deadline (redirects included), so
  a read blocked on a dripping server returns at once; the row fails with TIMEOUT (`timeout`);
- reads the body in chunks and stops past `max_bytes` (at once when the announced length is
  over it); the row fails with TOO_LARGE (`too_large`); memory per download is at most the cap;
- does not try a download that hit a limit again (the same answer would come back, after the
  same wait); other failures are retried as img2dataset does;
- fetches http(s) URLs only (img2dataset's urlopen also reads `file://` from the local disk).

Connecting (name lookup, TCP and TLS handshakes) is bounded by the socket timeout only.
The limits reach each download through img2dataset's unchanged code as its `timeout`
argument: a `Limits`, a float (the per-read socket timeout) that also carries them.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import io
import itertools
import os
import socket
import threading
import time
import urllib.request

MAX_SECONDS = 60  # default wall-clock limit of one download (its retries each have their own)
MAX_BYTES = 32 * 1024 * 1024  # default byte cap: above the largest images the decode rules keep
CHUNK = 256 * 1024
TIMEOUT = "download timeout: no complete response within {} s"
TOO_LARGE = "download too large: over {} bytes"
USER_AGENT = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"


LIMITS = {
    # setting: (source option, environment variable, default)
    "max_seconds": ("fetch_max_seconds", "SDPIPE_FETCH_MAX_SECONDS", MAX_SECONDS),
    "max_bytes": ("fetch_max_bytes", "SDPIPE_FETCH_MAX_BYTES", MAX_BYTES),
}


def fetch_limits(options: dict | None = None) -> dict[str, int]:
    """Each download's wall-clock limit (`max_seconds`) and byte cap (`max_bytes`): the
    source's options `fetch_max_seconds` / `fetch_max_bytes`, else `SDPIPE_FETCH_MAX_SECONDS`
    / `SDPIPE_FETCH_MAX_BYTES`, else 60 s and 32 MiB."""
    limits = {}
    for name, (option, variable, default) in LIMITS.items():
        value, where = (options or {}).get(option), f"source option {option}"
        if value is None:
            value, where = os.environ.get(variable) or None, variable
        try:
            limits[name] = default if value is None else int(value)
        except (TypeError, ValueError):
            limits[name] = 0
        if limits[name] < 1:
            raise ValueError(f"{where}={value!r}: expected a positive integer")
    return limits


class Limits(float):
    """img2dataset's `timeout` (seconds per socket operation), carrying the wall-clock limit
    and the byte cap of each download."""

    max_seconds: float
    max_bytes: int

    def __new__(cls, timeout: float, max_seconds: float = MAX_SECONDS, max_bytes: int = MAX_BYTES):
        limits = super().__new__(cls, timeout)
        limits.max_seconds, limits.max_bytes = max_seconds, max_bytes
        return limits

    def __reduce__(self):
        return (Limits, (float(self), self.max_seconds, self.max_bytes))


class _Attempt:
    """One download's deadline and the sockets it opened."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.expired = False
        self.done = False

    def add(self, sock: socket.socket) -> None:
        with self.lock:
            if self.expired:
                _shut(sock)
            elif not self.done:
                self.sockets.append(sock)

    def expire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.expired = True
            for sock in self.sockets:
                _shut(sock)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            self.sockets.clear()


def _shut(sock: socket.socket) -> None:
    """End the connection under a blocked read: the read returns (EOF or an error) at once.
    The plain socket's shutdown, also for a TLS socket (its own would drop the TLS state)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Watchdog:
    """One thread per process that expires attempts at their deadlines."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Attempt]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def start(self, seconds: float) -> _Attempt:
        attempt = _Attempt(time.monotonic() + seconds)
        with self._cond:
            heapq.heappush(self._heap, (attempt.deadline, next(self._order), attempt))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fetch-deadlines", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return attempt

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                delay = self._heap[0][0] - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                attempt = heapq.heappop(self._heap)[2]
            attempt.expire()


_watchdog = _Watchdog()
_current = threading.local()  # the attempt of this thread's download, for its connections


def _register(sock: socket.socket | None) -> None:
    attempt = getattr(_current, "attempt", None)
    if attempt is not None and sock is not None:
        attempt.add(sock)


class _HTTPConnection(http.client.HTTPConnection):
    def connect(self):
        super().connect()
        _register(self.sock)


class _HTTPSConnection(http.client.HTTPSConnection):
    def connect(self):
        super().connect()
        _register(self.sock)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._context)


def _opener() -> urllib.request.OpenerDirector:
    """http(s) only (no file://, ftp:// or data:), proxies from the environment, redirects."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),
        _HTTPHandler(),
        _HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


_OPENER = _opener()


class _LimitReached(Exception):
    pass


def download_image(
    row, timeout: float, user_agent_token, disallowed_header_directives
) -> tuple[int, io.BytesIO | None, str | None]:
    """img2dataset's `download_image` (same arguments and result: key, bytes or None, error),
    within `timeout`'s limits when it is a `Limits`."""
    from img2dataset.downloader import is_disallowed

    key, url = row
    max_seconds = getattr(timeout, "max_seconds", MAX_SECONDS)
    max_bytes = getattr(timeout, "max_bytes", MAX_BYTES)
    user_agent = USER_AGENT
    if user_agent_token:
        user_agent += f" (compatible; {user_agent_token}; +https://github.com/rom1504/img2dataset)"
    attempt = _watchdog.start(max_seconds)
    _current.attempt = attempt
    try:
        request = urllib.request.Request(url, data=None, headers={"User-Agent": user_agent})
        with _OPENER.open(request, timeout=float(timeout)) as r:
            if disallowed_header_directives and is_disallowed(
                r.headers, user_agent_token, disallowed_header_directives
            ):
                return key, None, "Use of image disallowed by X-Robots-Tag directive"
            length = r.headers.get("Content-Length", "").strip()
            if length.isdigit() and int(length) > max_bytes:
                raise _LimitReached(TOO_LARGE.format(max_bytes))
            body = io.BytesIO()
            while chunk := r.read1(CHUNK):
                body.write(chunk)
                if body.tell() > max_bytes:
                    raise _LimitReached(TOO_LARGE.format(max_bytes))
            if length.isdigit() and body.tell() < int(length) and not attempt.expired:
                # as r.read() would: a body cut short is an error, not a smaller image
                raise http.client.IncompleteRead(body.getvalue(), int(length) - body.tell())
        if attempt.expired:  # the watchdog's shutdown reads as the end of the body
            raise _LimitReached(TIMEOUT.format(max_seconds))
        body.seek(0)
        return key, body, None
    except _LimitReached as e:
        return key, None, str(e)
    except Exception as err:  # noqa: BLE001  (as img2dataset: any failure is the row's error)
        if attempt.expired:
            return key, None, TIMEOUT.format(max_seconds)
        return key, None, str(err)
    finally:
        _current.attempt = None
        attempt.finish()


def limit_reached(error: str | None) -> bool:
    return bool(error) and error.startswith(("download timeout:", "download too large:"))


def download_with_retry(
    row, timeout: float, retries: int, user_agent_token, disallowed_header_directives
) -> tuple[int, io.BytesIO | None, str | None]:
    """img2dataset's `download_image_with_retry`, without retrying a download past a limit."""
    for _ in range(retries + 1):
        key, stream, error = download_image(
            row, timeout, user_agent_token, disallowed_header_directives
        )
        if stream is not None or limit_reached(error):
            break
    return key, stream, error


def install() -> None:
    """Make img2dataset's Downloader (of this process) download through `download_with_retry`."""
    from img2dataset import downloader

    downloader.download_image_with_retry = download_with_retry
