"""The stats records after a removal: as if the rows had been blocked at fetch-metadata.

A removed row is counted once, as `removed`, by the metadata shard that held it; every later
stage sees it neither come in nor go out, so a stage that had dropped it drops one less under
that reason. The reason is read where the stage kept one per row (a fetch shard's `status`),
judged again by the profile's rules where the stage is one filter over the source (filter,
filter-pixels: the first rule the row fails, else the first dedup level that dropped rows),
and otherwise taken from the stage's own reasons in order.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels
from tasks.removal.rewrite import hit
from tasks.runtime.shards import (
    WHOLE_STAGE,
    ShardStats,
    missing_outputs,
    stats_path,
    write_record,
)


def removed_in(path: Path, keys: pa.Array, column: str = "key") -> set[str]:
    """The removed keys a parquet or keys file holds."""
    if not path.exists():
        return set()
    if path.suffix == ".arrow":
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all().select([column])
    else:
        table = pq.read_table(path, columns=[column])
    return set(table[column].filter(pa.array(hit(table[column], keys))).to_pylist())


def _rule_reasons(
    rows_sql, root: Path, profile: FilterProfile, stage: str, dropped: set[str], stats
) -> Counter:
    """The reason each of `dropped` (keys the stage dropped) was dropped under."""
    if not dropped:
        return Counter()
    con = filter_stage.connect(root)
    rows_sql(con)
    available = {r[0] for r in con.sql("DESCRIBE rows").fetchall()}
    rules = filter_stage.rules(profile, stage=stage, available=available)
    con.register("gone", pa.table({"gone_key": pa.array(sorted(dropped), pa.string())}))
    fails = ", ".join(f"NOT coalesce({r.passes}, false)" for r in rules) or "false"
    found = con.sql(f"SELECT {fails} FROM rows JOIN gone ON key = gone_key").fetchall()
    levels = [f"duplicate_{lv}" for lv in filter_stage.levels(profile, stage)]
    duplicate = next((lv for lv in levels if stats.dropped.get(lv)), None)
    reasons: Counter = Counter()
    for row in found:
        first = next((i for i, failed in enumerate(row) if failed and rules), None)
        reasons[rules[first].reason if first is not None else duplicate or "duplicate"] += 1
    return reasons


def _any_reasons(stats: ShardStats, n: int) -> Counter:
    out: Counter = Counter()
    for reason, count in sorted(stats.dropped.items()):
        take = min(n, count)
        if take:
            out[reason] = take
            n -= take
    return out


def _change(stats: ShardStats, num_in: int, num_out: int, reasons: Counter) -> dict:
    """`stats` less the removed rows: in, out and each reason (never below zero)."""
    stats.num_in -= num_in
    stats.num_out -= num_out
    for reason, n in reasons.items():
        left = stats.dropped.get(reason, 0) - n
        if left > 0:
            stats.dropped[reason] = left
        else:
            stats.dropped.pop(reason, None)
    stats.check_balanced()
    return {
        "num_in": stats.num_in,
        "num_out": stats.num_out,
        "dropped": stats.dropped,
        "removed_out": num_out,  # removed rows its output held
    }


def targets(
    root: Path, source: str, keys: pa.Array, profile: FilterProfile, *, scored: bool
) -> dict[str, dict]:
    """Per stats record (path relative to the source folder) the counts it will hold."""
    d = root / source
    out: dict[str, dict] = {}

    def rel(stage: str, shard: str) -> str:
        return str(stats_path(root, source, stage, shard).relative_to(d))

    def shards_of(stage: str) -> list[str]:
        return sorted(p.name.removesuffix(".stats.json") for p in (d / stage).glob("*.stats.json"))

    meta_keys: set[str] = set()
    for shard in shards_of("metadata"):
        files = [d / "metadata" / f"{shard}.parquet"]
        if shard == WHOLE_STAGE:  # an archive source's index: one record for every table
            files = sorted((d / "metadata").glob("[0-9]*.parquet"))
        gone = set().union(*(removed_in(p, keys) for p in files))
        meta_keys |= gone
        if gone:
            stats = ShardStats.read(stats_path(root, source, "metadata", shard))
            stats.num_out -= len(gone)
            stats.drop("removed", len(gone))
            stats.check_balanced()
            out[rel("metadata", shard)] = {
                "num_in": stats.num_in, "num_out": stats.num_out, "dropped": stats.dropped,
                "removed_out": len(gone),
            }  # fmt: skip
    filtered: set[str] = set()
    for p in sorted((d / "filtered").glob("[0-9]*.parquet")):
        filtered |= removed_in(p, keys)
    record = stats_path(root, source, "filtered", WHOLE_STAGE)
    if record.exists() and meta_keys:
        stats = ShardStats.read(record)
        files = sorted(str(p) for p in (d / "metadata").glob("[0-9]*.parquet"))

        def metadata_rows(con, files=files):
            con.sql(f"CREATE VIEW rows AS SELECT * FROM read_parquet({files!r})")

        dropped = meta_keys - filtered
        reasons = _rule_reasons(metadata_rows, root, profile, "metadata", dropped, stats)
        out[rel("filtered", WHOLE_STAGE)] = _change(stats, len(meta_keys), len(filtered), reasons)
    fetched: dict[str, set[str]] = {}  # per shard, removed keys fetched with success
    for shard in shards_of("shards"):
        table = pq.read_table(d / "shards" / f"{shard}.parquet", columns=["key", "status"])
        mine = table.filter(pa.array(hit(table["key"], keys)))
        if not mine.num_rows:
            continue
        statuses = Counter(mine["status"].to_pylist())
        fetched[shard] = {
            k for k, s in zip(mine["key"].to_pylist(), mine["status"].to_pylist(), strict=True)
            if s == "success"
        }  # fmt: skip
        stats = ShardStats.read(stats_path(root, source, "shards", shard))
        reasons = Counter({s: n for s, n in statuses.items() if s != "success"})
        out[rel("shards", shard)] = _change(stats, mine.num_rows, statuses["success"], reasons)
    per_shard_inputs = {"scores": "shards", "tokens": "selected", "latents": "tokens"}
    later: dict[str, dict[str, set[str]]] = {"shards": fetched}
    selected_in = 0
    for stage in ("scores", "selected", "tokens", "latents"):
        if stage == "selected":
            inputs = later.get("scores", fetched) if scored else fetched
            selected_in = sum(len(v) for v in inputs.values())
            kept: dict[str, set[str]] = {}
            for p in sorted((d / "selected").glob("[0-9]*.parquet")):
                if gone := removed_in(p, keys):
                    kept[p.stem] = gone
            later["selected"] = kept
            record = stats_path(root, source, "selected", WHOLE_STAGE)
            if record.exists() and selected_in:
                stats = ShardStats.read(record)
                dropped = set().union(*inputs.values()) - set().union(set(), *kept.values())

                def pixel_rows(con):
                    filter_pixels.pixel_rows(con, root, source, profile, scored=scored)

                reasons = _rule_reasons(pixel_rows, root, profile, "pixels", dropped, stats)
                total = sum(len(v) for v in kept.values())
                out[rel("selected", WHOLE_STAGE)] = _change(stats, selected_in, total, reasons)
            continue
        inputs = later.get(per_shard_inputs[stage], {})
        found: dict[str, set[str]] = {}
        for shard in shards_of(stage):
            if stage == "latents":
                gone = removed_in(d / "latents" / f"{shard}.keys.arrow", keys)
            else:
                gone = removed_in(d / stage / f"{shard}.parquet", keys)
            came = inputs.get(shard, set())
            if not gone and not came:
                continue
            found[shard] = gone
            stats = ShardStats.read(stats_path(root, source, stage, shard))
            target = _change(stats, len(came), len(gone), _any_reasons(stats, len(came - gone)))
            if stage == "latents" and "buckets" in stats.extra:
                target["buckets"] = _bucket_counts(d / "latents" / f"{shard}.keys.arrow", keys)
            out[rel(stage, shard)] = target
        later[stage] = found
    return out


def _bucket_counts(path: Path, keys: pa.Array) -> dict[str, int]:
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    if "bucket" not in table.column_names:
        return {}
    kept = table.filter(pa.array(~hit(table["key"], keys)))
    counts = Counter(kept["bucket"].to_pylist())
    buckets = set(table["bucket"].to_pylist())
    return {b: counts.get(b, 0) for b in sorted(buckets)}


def write(root: Path, source: str, planned: dict[str, dict]) -> list[str]:
    """Every stats record of the source that the removal touched: the planned counts, and its
    outputs as they are now (a record listing a rewritten file's old size reads as undone)."""
    changed = []
    for record in sorted((root / source).glob("*/*.stats.json")):
        rel = str(record.relative_to(root / source))
        stats = ShardStats.read(record)
        target = planned.get(rel)
        if target is None and not missing_outputs(record.parent, stats.outputs):
            continue
        if target is not None:
            stats.num_in, stats.num_out = target["num_in"], target["num_out"]
            stats.dropped = dict(sorted(target["dropped"].items()))
            if "buckets" in target:
                stats.extra["buckets"] = target["buckets"]
        before = record.read_text()
        write_record(record, stats)  # its outputs listed again, as they are now
        if record.read_text() != before:
            changed.append(rel)
    return changed
