"""fetch-metadata: read a URL source's metadata parquet and write the normalized sample table.

One unit of work per upstream file. Upstream column dialects (LAION's `URL/TEXT/WIDTH/...`
and the lowercase `url/caption/...`) are renamed on ingest to the one schema every stage
reads; a file missing a required column fails with what is missing and what was found.
A row with no URL to fetch (null, empty or only whitespace) is dropped here, counted as
`missing_url`, and so is a URL that is not http(s) (`bad_url_scheme`: img2dataset would read a
`file://` URL from the local disk) or, unless the source allows it, one whose host is this
machine or a private network (`private_host`): every later stage may rely on a fetchable URL.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from catalog import Source
from sdtrain.atomic import atomic_path
from tasks.removal import lists
from tasks.runtime.shards import ShardStats, run_shard, shard_name
from tasks.sources import demo_source
from tasks.sources.table import SourceError, write_table

STAGE = "metadata"
# Normalized column -> upstream spellings, first match wins.
COLUMNS = {
    "url": ("URL", "url"),
    "caption": ("TEXT", "caption", "text"),
    "width": ("WIDTH", "width"),
    "height": ("HEIGHT", "height"),
    "similarity": ("similarity",),
    "punsafe": ("punsafe",),
    "pwatermark": ("pwatermark",),
    "aesthetic": ("aesthetic", "AESTHETIC_SCORE"),
    "hash": ("hash",),
}
REQUIRED = ("url", "caption")
FLOAT_COLUMNS = ("width", "height", "similarity", "punsafe", "pwatermark", "aesthetic")


def list_metadata_files(root: Path, source: Source) -> list[str]:
    """The upstream metadata parquet files of a URL source, in a stable order."""
    if source.kind == "demo":
        opts = source.options
        mirror = demo_source.generate_mirror(
            root / source.name / "mirror",
            num_images=int(opts.get("num_images", 240)),
            seed=int(opts.get("seed", 0)),
        )
        return [str(p) for p in sorted((mirror / "metadata").glob("*.parquet"))]
    location = source.location
    if location.startswith("hf://datasets/") and source.revision:
        owner, name, *rest = location.removeprefix("hf://datasets/").split("/")
        location = f"hf://datasets/{owner}/{name}@{source.revision}/" + "/".join(rest)
    try:
        fs, path = fsspec.core.url_to_fs(location)
        files = sorted(f for f in fs.find(path.rstrip("/")) if f.endswith(".parquet"))
    except Exception as e:  # any filesystem backend error means the same thing to the user
        raise SourceError(f"source {source.name!r}: cannot list {location}: {e}") from None
    if not files:
        raise SourceError(f"source {source.name!r}: no parquet files under {location}")
    return [fs.unstrip_protocol(f) for f in files]


def check_source(source: Source) -> None:
    """Fail early, in one line, on a local location that does not exist or an unknown layout."""
    if "://" not in source.location and not Path(source.location).exists():
        what = "folder" if source.kind == "folder" else "location"
        raise SourceError(
            f"source {source.name!r}: {what} {source.location} does not exist "
            f"(set {source.name}.location in the catalog's sources.yaml). "
            + " ".join(source.license.split())
        )
    if source.kind in ("archive", "folder"):
        from tasks.sources.adapters import ADAPTERS, adapter_name

        if adapter_name(source) not in ADAPTERS:
            raise SourceError(
                f"source {source.name!r} is of kind {source.kind!r} with no adapter "
                f"{adapter_name(source)!r}: set `adapter:` to one of {', '.join(sorted(ADAPTERS))}"
            )


def normalize(table: pa.Table, source: str, shard: str, origin: str) -> pa.Table:
    """Rename upstream columns to the sample-table schema and assign stable keys."""
    found = table.column_names
    columns = {}
    for name, spellings in COLUMNS.items():
        match = next((s for s in spellings if s in found), None)
        if match is None:
            if name in REQUIRED:
                missing = [n for n in REQUIRED if not any(s in found for s in COLUMNS[n])]
                raise SourceError(
                    f"{origin}: missing required column(s) {missing} "
                    f"(accepted spellings {[COLUMNS[n] for n in missing]}); found {found}"
                )
            continue
        col = table[match]
        if name in FLOAT_COLUMNS:
            col = pc.cast(col, pa.float64())
        elif name == "hash":
            col = pc.cast(col, pa.int64())
        else:
            col = pc.cast(col, pa.string())
        columns[name] = col
    n = table.num_rows
    keys = pa.array([f"{shard}{i:07d}" for i in range(n)], pa.string())
    out = {"key": keys, "source": pa.array([source] * n, pa.string())}
    out.update(columns)
    return pa.table(out)


def drop_missing_urls(table: pa.Table) -> tuple[pa.Table, int]:
    """(`table` without its rows whose URL is null, empty or only ASCII whitespace, how many).

    Whitespace bytes sort below `!`, so only URLs that start below it are trimmed (rare).
    """
    drop = []
    for chunk in table["url"].chunks:  # a take() over a chunked array would copy every URL
        maybe = pc.or_kleene(pc.is_null(chunk), pc.less(chunk, "!"))
        candidates = np.flatnonzero(maybe.to_numpy(zero_copy_only=False))
        blank = np.zeros(len(chunk), bool)
        if len(candidates):
            trimmed = pc.ascii_trim_whitespace(chunk.take(pa.array(candidates)))
            blank[candidates] = pc.fill_null(pc.equal(trimmed, ""), True).to_numpy(
                zero_copy_only=False
            )
        drop.append(blank)
    removed = int(sum(d.sum() for d in drop))
    if not removed:
        return table, 0
    return _without(table, np.concatenate(drop)), removed


def _without(table: pa.Table, drop: np.ndarray) -> pa.Table:
    """`table` minus the rows `drop` marks. A few dropped rows: the runs between them, zero-copy
    (filter() would copy every column: seconds per 10M rows, for a handful of rows)."""
    dropped = np.flatnonzero(drop)
    if len(dropped) > 65536:
        return table.filter(pa.array(~drop))
    starts = np.concatenate([[0], dropped + 1])
    ends = np.concatenate([dropped, [len(drop)]])
    runs = [
        table.slice(a, b - a) for a, b in zip(starts.tolist(), ends.tolist(), strict=True) if b > a
    ]
    return pa.concat_tables(runs) if runs else table.slice(0, 0)


# An http(s) URL with a host (userinfo skipped; an IPv6 host keeps its brackets).
_HTTP_HOST = r"^(?i:https?)://(?:[^/?#@]*@)?(?P<host>\[[^\]/?#]+\]|[^/?#:]+)"
# Hosts that may name this machine or a private network, checked one by one: IP literals in
# any notation the resolver accepts (dotted, decimal, hex, octal; bracketed IPv6) and
# localhost. A public name that resolves to a private address is not caught here.
_MAYBE_PRIVATE = r"^(?:[0-9a-fx.]+|\[.*\]|(?:.*\.)?localhost\.?)$"


def is_private_host(host: str) -> bool:
    """Whether `host` (lowercase, from a URL) is this machine or a private network."""
    if host == "" or host == "localhost" or host.rstrip(".").endswith(".localhost"):
        return True
    try:
        if host.startswith("["):
            address = ipaddress.ip_address(host[1:-1].split("%")[0])
        else:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
    except (ValueError, OSError):
        return False  # not an address: a name (resolved at fetch time)
    return not address.is_global


def drop_unfetchable(table: pa.Table, *, allow_private_hosts: bool) -> tuple[pa.Table, dict]:
    """(`table` without rows whose URL is not http(s), or names a private host unless
    allowed, {reason: rows removed}). Only hosts that look like addresses are parsed in Python."""
    urls = table["url"]
    http = pc.fill_null(pc.match_substring_regex(urls, _HTTP_HOST), False)
    bad_scheme = pc.invert(http).to_numpy(zero_copy_only=False)
    drop, counts = bad_scheme.copy(), {}
    if n := int(bad_scheme.sum()):
        counts["bad_url_scheme"] = n
    if not allow_private_hosts:
        hosts = pc.utf8_lower(pc.struct_field(pc.extract_regex(urls, _HTTP_HOST), [0]))
        maybe = pc.fill_null(pc.match_substring_regex(hosts, _MAYBE_PRIVATE), False)
        candidates = np.flatnonzero(maybe.to_numpy(zero_copy_only=False) & ~bad_scheme)
        if len(candidates):
            picked = hosts.take(pa.array(candidates)).to_pylist()
            private = candidates[[is_private_host(h) for h in picked]]
            drop[private] = True
            if len(private):
                counts["private_host"] = len(private)
    return (_without(table, drop) if drop.any() else table), counts


def blocklist(source: Source) -> tuple[pa.Array, pa.Array] | None:
    """(blocked URLs, blocked hashes) from the parquet the source option `blocklist` names, or
    None. The file has a `url` column, a `hash` column (LAION's int64 hash), or both."""
    location = source.options.get("blocklist")
    if not location:
        return None
    try:
        with fsspec.open(location, "rb") as f:
            table = pq.read_table(f)
    except (OSError, ValueError) as e:
        raise SourceError(
            f"source {source.name!r}: cannot read blocklist {location}: {e}"
        ) from None
    found = table.column_names
    if "url" not in found and "hash" not in found:
        raise SourceError(
            f"source {source.name!r}: blocklist {location} needs a `url` or `hash` column; "
            f"found {found}"
        )
    urls = (
        pc.unique(pc.cast(table["url"], pa.string()))
        if "url" in found
        else pa.array([], pa.string())
    )
    hashes = (
        pc.unique(pc.cast(table["hash"], pa.int64()))
        if "hash" in found
        else pa.array([], pa.int64())
    )
    return urls, hashes


def drop_blocked(table: pa.Table, blocked: tuple[pa.Array, pa.Array]) -> tuple[pa.Table, int]:
    """Anti-join of the sample table with the blocklist; (kept rows, number removed)."""
    urls, hashes = blocked
    hit = pc.fill_null(pc.is_in(table["url"], value_set=urls), False)
    if "hash" in table.column_names and len(hashes):
        hit = pc.or_(hit, pc.fill_null(pc.is_in(table["hash"], value_set=hashes), False))
    drop = hit.to_numpy(zero_copy_only=False)
    removed = int(drop.sum())
    return (_without(table, drop), removed) if removed else (table, 0)


def fetch_metadata_shard(root: Path, source: Source, index: int, location: str) -> ShardStats:
    """One upstream metadata file -> `metadata/NNNNN.parquet`, minus the blocklisted rows (the
    catalog's `blocklist`, counted `blocklist`; the data root's removals, counted `removed`)."""
    shard = shard_name(index)
    out = root / source.name / STAGE / f"{shard}.parquet"

    def work(stats: ShardStats) -> None:
        with fsspec.open(location, "rb") as f:
            table = pq.read_table(f)
        table = normalize(table, source.name, shard, location)
        stats.num_in = table.num_rows
        table, removed = drop_missing_urls(table)
        if removed:
            stats.drop("missing_url", removed)
        table, removed_by = drop_unfetchable(table, allow_private_hosts=source.allow_private_hosts)
        for reason, n in removed_by.items():
            stats.drop(reason, n)
        blocked = blocklist(source)
        if blocked is not None:
            table, removed = drop_blocked(table, blocked)
            if removed:
                stats.drop("blocklist", removed)
        taken_back = lists.read_blocklist(root, source.name)  # `sdpipe remove`'s, kept here
        if taken_back.num_rows:
            drop = lists.blocked_rows(table, taken_back)
            if drop.any():
                table = _without(table, drop)
                stats.drop("removed", int(drop.sum()))
        with atomic_path(out) as tmp:
            write_table(table, tmp)
        stats.num_out = table.num_rows
        stats.extra = {"origin": location}

    return run_shard(root, source.name, STAGE, shard, work)
