"""One image download with a wall-clock limit, a byte cap and the source's private-host rule,
for img2dataset's downloader.

img2dataset (1.47) downloads each URL with `urllib.request.urlopen(url, timeout).read()`: its
timeout is per socket operation, so a server that keeps sending (an image URL that redirects
to a live stream, a slow drip below the timeout) holds a download thread forever, and the body
grows in memory until the OOM killer ends the process; the piece, the shard, the stage and the
flow wait on it. sdpipe's downloader processes (`fetch_images.serve`) install
`download_with_retry` in img2dataset's place (`install`), which:

- ends a download `max_seconds` after it started, whatever the server does once connected: a
  watchdog thread shuts the download's sockets down at its deadline (redirects included), so
  a read blocked on a dripping server returns at once; the row fails with TIMEOUT (`timeout`).
  Name lookups run in a thread of their own that the deadline abandons (a lookup cannot be
  interrupted), and connects wait at most until the deadline;
- reads the body in chunks and stops past `max_bytes` (at once when the announced length is
  over it); the row fails with TOO_LARGE (`too_large`); memory per download is at most the cap;
- unless the source allows private hosts, connects only to public addresses: every address a
  host name resolves to is checked, the socket connects to a checked one and its peer is
  checked again before the request is sent, for every hop of a redirect (a rebinding name
  cannot slip in between); the row fails with PRIVATE_HOST (`private_host`). Through a proxy
  (the operator's choice, not checked) the rule applies to the URL's host, resolved here;
- does not try a download that hit a limit or the rule again (the same answer would come
  back, after the same wait); other failures are retried as img2dataset does;
- fetches http(s) URLs only (img2dataset's urlopen also reads `file://` from the local disk).

The limits and the rule reach each download through img2dataset's unchanged code as its
`timeout` argument: a `Limits`, a float (the per-read socket timeout) that also carries them.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import http.client
import io
import ipaddress
import itertools
import os
import socket
import threading
import time
import urllib.parse
import urllib.request

MAX_SECONDS = 60  # default wall-clock limit of one download (its retries each have their own)
MAX_BYTES = 32 * 1024 * 1024  # default byte cap: above the largest images the decode rules keep
CHUNK = 256 * 1024
TIMEOUT = "download timeout: no complete response within {} s"
TOO_LARGE = "download too large: over {} bytes"
PRIVATE_HOST = (
    "private host: {} ({}) is this machine or a private network; the source does not allow "
    "private hosts (allow_private_hosts)"
)
# Not tried again: the same answer would come back.
FINAL = ("download timeout:", "download too large:", "private host:")
# The tests' seam: loopback `host:port` pairs (comma-separated) the address rule treats as
# public, so that a test can serve a "public" page on 127.0.0.1 that redirects to a private one.
PUBLIC_FOR_TESTS = "SDPIPE_FETCH_PUBLIC_FOR_TESTS"
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
    allow_private_hosts: bool

    def __new__(
        cls,
        timeout: float,
        max_seconds: float = MAX_SECONDS,
        max_bytes: int = MAX_BYTES,
        allow_private_hosts: bool = False,
    ):
        limits = super().__new__(cls, timeout)
        limits.max_seconds, limits.max_bytes = max_seconds, max_bytes
        limits.allow_private_hosts = allow_private_hosts
        return limits

    def __reduce__(self):
        return (
            Limits,
            (float(self), self.max_seconds, self.max_bytes, self.allow_private_hosts),
        )


# ---- the address rule ------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _public_for_tests(setting: str) -> frozenset:
    pairs = set()
    for item in setting.replace(" ", ",").split(","):
        if not item:
            continue
        host, _, port = item.rpartition(":")
        try:
            address = ipaddress.ip_address(host.strip("[]"))
            pairs.add((address, int(port)))
        except ValueError:
            address = None
        if address is None or not address.is_loopback:
            raise ValueError(f"{PUBLIC_FOR_TESTS}: {item!r} is not a loopback host:port")
    return frozenset(pairs)


def _within(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list:
    """`address` and the IPv4 addresses an IPv6 one carries (mapped, 6to4, Teredo), which a
    connection to it may reach. (NAT64's 64:ff9b::/96 lies in ::/8, reserved: refused.)"""
    if address.version == 6 and address.ipv4_mapped is not None:
        return [address.ipv4_mapped]  # what it reaches (the ::ffff:0:0/96 block is "private")
    found = [address]
    if address.version == 6:
        teredo = address.teredo
        found += [a for a in (address.sixtofour, teredo and teredo[1]) if a is not None]
    return found


def is_public_address(ip: str, port: int) -> bool:
    """Whether a connection to `ip` (a resolved or peer address) leaves this machine and its
    private networks: not loopback, private (RFC 1918, ULA fc00::/7), shared (CGNAT 100.64/10),
    link-local (169.254/16: cloud metadata), unspecified, multicast or reserved, in any form."""
    address = ipaddress.ip_address(ip.split("%")[0])
    if (address, port) in _public_for_tests(os.environ.get(PUBLIC_FOR_TESTS, "")):
        return True
    return all(
        a.is_global
        and not (
            a.is_private
            or a.is_loopback
            or a.is_link_local
            or a.is_multicast
            or a.is_reserved
            or a.is_unspecified
            or (a.version == 6 and a.is_site_local)
        )
        for a in _within(address)
    )


class _Attempt:
    """One download's deadline, its private-host rule and the sockets it opened."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.allow_private_hosts = False
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
        attempt = _Attempt(seconds)
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


class _Refused(Exception):
    """A hop the private-host rule refuses (not an OSError: urllib passes it on unwrapped)."""


class _LimitReached(Exception):
    pass


def resolve(host: str, port: int) -> list[tuple]:
    """getaddrinfo for a TCP connection to `host`; the tests' seam for a slow name server."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _lookup(attempt: _Attempt, host: str, port: int) -> list[tuple]:
    """`resolve` within the attempt's deadline: in a thread of its own, abandoned (left to end
    by itself) at the deadline, since a lookup cannot be interrupted."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["infos"] = resolve(host, port)
        except Exception as e:  # noqa: BLE001  (raised in the download's thread)
            box["error"] = e
        done.set()

    threading.Thread(target=run, name="fetch-lookup", daemon=True).start()
    if not done.wait(max(0.0, attempt.deadline - time.monotonic())):
        raise _LimitReached(TIMEOUT.format(attempt.seconds))
    if "error" in box:
        raise box["error"]
    return box["infos"]


def _check(attempt: _Attempt, host: str, ip: str, port: int) -> None:
    if not attempt.allow_private_hosts and not is_public_address(ip, port):
        raise _Refused(PRIVATE_HOST.format(host, ip))


def _open_socket(
    attempt: _Attempt, address: tuple, timeout: float | None, source_address, *, checked: bool
) -> socket.socket:
    """A TCP connection to `address` (host, port), as `socket.create_connection` makes, to an
    address resolved within the deadline. `checked`: every resolved address must pass the
    rule, and the connected peer is checked again."""
    host, port = address
    infos = _lookup(attempt, host, port)
    if checked:
        for *_, sockaddr in infos:
            _check(attempt, host, sockaddr[0], port)
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        left = attempt.deadline - time.monotonic()
        if left <= 0:
            raise _LimitReached(TIMEOUT.format(attempt.seconds))
        sock = socket.socket(family, kind, proto)
        attempt.add(sock)  # from now on the watchdog can end it
        try:
            sock.settimeout(left if timeout is None else min(timeout, left))
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            if checked:
                peer = sock.getpeername()
                _check(attempt, host, peer[0], peer[1])
            sock.settimeout(timeout)
            return sock
        except OSError as e:
            sock.close()
            if attempt.deadline <= time.monotonic():
                raise _LimitReached(TIMEOUT.format(attempt.seconds)) from None
            error = e
        except BaseException:
            sock.close()
            raise
    raise error or OSError(f"{host}: no address to connect to")


class _HTTPConnection(http.client.HTTPConnection):
    """Connections of one download: within its deadline, under its private-host rule.
    `target`: the URL's (host, port) when the connection goes to a proxy."""

    def __init__(self, *args, target: tuple | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._target = target
        self._create_connection = self._open

    def _open(self, address, timeout=None, source_address=None) -> socket.socket:
        attempt = _current.attempt
        if self._target is not None:  # the proxy is the operator's choice; the URL's host is not
            host, port = self._target
            for *_, sockaddr in _lookup(attempt, host, port):
                _check(attempt, host, sockaddr[0], port)
        return _open_socket(attempt, address, timeout, source_address, checked=self._target is None)


class _HTTPSConnection(_HTTPConnection, http.client.HTTPSConnection):
    def connect(self):
        # As HTTPSConnection.connect, with the TLS socket in the watchdog's hands before
        # its handshake (wrapping detaches the plain socket registered at connect).
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(
            self.sock,
            server_hostname=self._tunnel_host or self.host,
            do_handshake_on_connect=False,
        )
        _register(self.sock)
        self.sock.do_handshake()


def _target(req: urllib.request.Request) -> tuple | None:
    """The URL's (host, port) when `req` goes through a proxy, else None."""
    if not (req.has_proxy() or req._tunnel_host):
        return None
    url = urllib.parse.urlsplit(req.full_url)
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(functools.partial(_HTTPConnection, target=_target(req)), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(
            functools.partial(_HTTPSConnection, target=_target(req)), req, context=self._context
        )


def _opener(proxies: dict[str, str] | None = None) -> urllib.request.OpenerDirector:
    """http(s) only (no file://, ftp:// or data:), `proxies` (default: the environment's),
    redirects."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(proxies),
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
    attempt.allow_private_hosts = getattr(timeout, "allow_private_hosts", False)
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
    except (_LimitReached, _Refused) as e:
        return key, None, str(e)
    except Exception as err:  # noqa: BLE001  (as img2dataset: any failure is the row's error)
        if attempt.expired:
            return key, None, TIMEOUT.format(max_seconds)
        return key, None, str(err)
    finally:
        _current.attempt = None
        attempt.finish()


def final(error: str | None) -> bool:
    """Whether `error` is a limit or the private-host rule: trying again would not help."""
    return bool(error) and error.startswith(FINAL)


def download_with_retry(
    row, timeout: float, retries: int, user_agent_token, disallowed_header_directives
) -> tuple[int, io.BytesIO | None, str | None]:
    """img2dataset's `download_image_with_retry`, without retrying a download past a limit
    or refused by the private-host rule."""
    for _ in range(retries + 1):
        key, stream, error = download_image(
            row, timeout, user_agent_token, disallowed_header_directives
        )
        if stream is not None or final(error):
            break
    return key, stream, error


def install() -> None:
    """Make img2dataset's Downloader (of this process) download through `download_with_retry`."""
    from img2dataset import downloader

    downloader.download_image_with_retry = download_with_retry
