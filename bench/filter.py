"""Filter throughput: the recipe's phase-1 profile (laion-broad) + URL dedup on LAION-like rows.

Generates a LAION-like metadata parquet once (cached), as the metadata stage writes it: rows
without a URL dropped by `tasks.sources.metadata.drop_missing_urls` (its cost is printed too), the
file written by `tasks.sources.table.write_table`. Then times the filter stage as a flow runs it
(`tasks.curation.filter.filter_metadata`: rules, waterfall, dedup, gallery, sharded output) and the
same decisions + output in pandas, on the same file in the same run, best of each. Prints one JSON
object.
With `--memory-limit 2GB` the stage runs once under that DuckDB memory limit, spilling under
its data root, over files of 10M rows each: `completed`, `rows_per_s`, peak memory and spill.
Usage: python bench/filter.py [--rows N] [--repeat R] [--pandas-repeat P] [--cache-dir DIR]
       [--memory-limit SIZE] [--work-dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

GENERATOR_VERSION = 3
FILE_ROWS = 10_000_000  # rows per metadata file (10M: the one file the bench always had)


def _hex(rng: np.random.Generator, n: int, num_bytes: int) -> pa.Array:
    raw = rng.integers(0, 256, (n, num_bytes), dtype=np.uint8)
    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    chars = np.empty((n, 2 * num_bytes), np.uint8)
    chars[:, 0::2], chars[:, 1::2] = digits[raw >> 4], digits[raw & 15]
    fixed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(2 * num_bytes), n, [None, pa.py_buffer(chars.tobytes())]
    )
    return fixed.cast(pa.binary()).cast(pa.string())


def laion_like(n: int, seed: int = 0, first_key: int = 0) -> pa.Table:
    """The normalized sample table of LAION metadata, with LAION's score distributions roughly,
    3% repeated URLs, blank/missing URLs, NaN scores and missing or negative sizes."""
    rng = np.random.default_rng(seed)
    hosts = rng.choice(["img", "cdn", "media", "static", "i"], 20_000)
    tlds = rng.choice(["com", "net", "org", "co.uk", "de"], 20_000)
    domains = pa.array(
        [f"https://{h}{i}.example.{t}/" for i, (h, t) in enumerate(zip(hosts, tlds, strict=True))]
    )
    folders = pa.array(["images/", "uploads/2019/05/", "wp-content/uploads/", "photo/", "p/l/"])
    url = pc.binary_join_element_wise(
        pc.take(domains, pa.array(np.minimum(rng.zipf(1.3, n) - 1, 19_999))),
        pc.take(folders, pa.array(rng.integers(0, 5, n))),
        _hex(rng, n, 16),
        pa.scalar(".jpg"),
        "",
    )
    repeated = np.flatnonzero(rng.random(n) < 0.03)
    source_row = np.arange(n)
    source_row[repeated] = (rng.random(repeated.size) * repeated).astype(np.int64)
    url = pc.take(url, pa.array(source_row))
    u = rng.random(n)
    url = pc.if_else(pa.array(u < 0.0005), pa.scalar(None, pa.string()), url)
    url = pc.if_else(pa.array((u >= 0.0005) & (u < 0.001)), pa.scalar("  "), url)
    words = np.array([f"word{i}" for i in range(5000)])
    captions = pa.array([" ".join(rng.choice(words, rng.integers(3, 20))) for _ in range(50_000)])

    def with_nan(x: np.ndarray, fraction: float = 0.01) -> np.ndarray:
        x[rng.random(n) < fraction] = np.nan
        return x

    width = with_nan(np.round(np.exp(rng.normal(6.5, 0.6, n))), 0.005)
    width[rng.random(n) < 0.001] = -1.0
    return pa.table(
        {
            "key": pc.utf8_lpad(pc.cast(pa.array(first_key + np.arange(n)), pa.string()), 12, "0"),
            "source": pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(n, np.int32)), pa.array(["laion"])
            ).cast(pa.string()),
            "url": url,
            "caption": pc.take(captions, pa.array(rng.integers(0, 50_000, n))),
            "width": width,
            "height": with_nan(np.round(np.exp(rng.normal(6.4, 0.6, n))), 0.005),
            "similarity": with_nan(rng.normal(0.31, 0.035, n)),
            "punsafe": with_nan(rng.beta(0.4, 8, n)),
            "pwatermark": with_nan(rng.beta(0.7, 3, n)),
            "aesthetic": with_nan(rng.normal(5.6, 0.75, n)),
            "hash": rng.integers(-(2**62), 2**62, n),
        }
    )


def cached_files(rows: int, cache_dir: Path) -> tuple[list[Path], dict]:
    """The metadata shards of `rows` LAION-like upstream rows (one file per FILE_ROWS, each its
    own seed: memory holds one), and what ingest dropped."""
    from tasks.sources import metadata
    from tasks.sources import table as sample_table

    paths, record = [], {"missing_url": 0, "ingest_check_seconds": 0.0}
    for i, first in enumerate(range(0, rows, FILE_ROWS)):
        n = min(FILE_ROWS, rows - first)
        name = f"laion-like-{rows}-v{GENERATOR_VERSION}"
        path = cache_dir / (f"{name}.parquet" if rows <= FILE_ROWS else f"{name}-{i:03d}.parquet")
        info = path.with_suffix(".ingest.json")
        if not path.exists() or not info.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            raw = laion_like(n, seed=i, first_key=first)
            start = time.perf_counter()
            table, removed = metadata.drop_missing_urls(raw)
            part = {"missing_url": removed, "ingest_check_seconds": time.perf_counter() - start}
            del raw
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            sample_table.write_table(table, tmp)  # the stage's writer: its codec, its row groups
            os.replace(tmp, path)
            info.write_text(json.dumps(part))
        part = json.loads(info.read_text())
        record = {k: record[k] + part[k] for k in record}
        paths.append(path)
    record["ingest_check_seconds"] = round(record["ingest_check_seconds"], 3)
    return paths, record


def spilled_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*") if f.is_file())


def run_capped(args, profile, source, paths: list[Path]) -> dict:
    """The stage once under DuckDB memory limit `args.memory_limit`, spilling under the data
    root: whether it completed, its speed, its peak memory and the spill folder's peak."""
    import resource
    import threading

    from tasks.curation import duck
    from tasks.curation import filter as filter_stage

    os.environ[duck.MEMORY_ENV] = args.memory_limit
    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-filter-", dir=args.work_dir))
    (work / "laion" / "metadata").mkdir(parents=True)
    for path in paths:
        (work / "laion" / "metadata" / path.name).symlink_to(path)
    spill_dir, peak, done = duck.temp_directory(work), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], spilled_bytes(spill_dir) if spill_dir.exists() else 0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        stats = filter_stage.filter_metadata(work, "laion", profile, source.samples_per_shard)
        out = {"completed": True, "kept": stats.num_out, "dropped": stats.dropped}
        out["duckdb"] = stats.extra["duckdb"]
    except duck.SpillError as exc:
        out = {"completed": False, "error": str(exc)}
    finally:
        seconds = time.perf_counter() - start
        done.set()
        watcher.join()
        shutil.rmtree(work)
    return out | {
        "seconds": round(seconds, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
        "rows_per_s": round(args.rows / seconds),
        "memory_limit": args.memory_limit,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "spill_peak_gb": round(peak[0] / 1e9, 2),
    }


def pandas_filter(path: Path, profile, out_dir: Path, samples_per_shard: int) -> dict:
    """The stage's decisions in pandas: first failing rule, each rule alone, key then URL dedup
    among the rows that pass (smallest key kept), the keys of up to 16 samples per reason, kept
    rows written as key-ordered shards."""
    import pandas as pd

    df = pd.read_parquet(path)
    side = np.fmin(df["width"].where(df["width"] > 0), df["height"].where(df["height"] > 0))
    fails = {"too_small": (side < profile.min_side).to_numpy()}
    for column, bound, low, high in (
        ("aesthetic", profile.min_aesthetic, None, 10.0),
        ("similarity", profile.min_similarity, None, 1.0),
        ("pwatermark", None, 0.0, profile.max_pwatermark),
        ("punsafe", None, 0.0, profile.max_punsafe),
    ):
        low = bound if low is None else low
        x = df[column]
        fails[column] = (~((x >= low) & (x <= high))).to_numpy()
    code = np.select(list(fails.values()), list(range(1, len(fails) + 1)), 0)
    dropped = {r: int((code == i + 1).sum()) for i, r in enumerate(fails)}
    alone = {r: int(f.sum()) for r, f in fails.items()}
    samples = {
        r: df["key"].iloc[np.flatnonzero(code == i + 1)[:16]].tolist() for i, r in enumerate(fails)
    }
    passing = df[code == 0].sort_values("key", kind="stable")
    for level in ("key", "url"):
        dup = passing[level].duplicated() & passing[level].notna()
        dropped[f"duplicate_{level}"] = alone[f"duplicate_{level}"] = int(dup.sum())
        samples[f"duplicate_{level}"] = passing["key"][dup].iloc[:16].tolist()
        passing = passing[~dup]
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, start in enumerate(range(0, len(passing), samples_per_shard)):
        shard = passing.iloc[start : start + samples_per_shard]
        # Column by column from numpy: DataFrame.to_parquet would write NaN sizes as nulls.
        table = pa.table({c: pa.array(shard[c].to_numpy()) for c in shard.columns})
        pq.write_table(table, out_dir / f"{i:05d}.parquet")
    return {
        "kept": len(passing),
        "dropped": {r: n for r, n in dropped.items() if n},
        "alone": alone,
        "samples": {r: keys for r, keys in samples.items() if keys},
    }


def check_same(reference: dict, stats, waterfall: dict, duck_dir: Path, pandas_dir: Path) -> None:
    """The two implementations made the same decisions and wrote the same rows."""
    alone = {s["rule"]: s["alone"] for s in waterfall["steps"]}
    samples = {r: [row["key"] for row in rows] for r, rows in waterfall["samples"].items()}
    for what, mine, theirs in (
        ("dropped", stats.dropped, reference["dropped"]),
        ("kept", stats.num_out, reference["kept"]),
        ("alone", alone, reference["alone"]),
        ("samples", samples, reference["samples"]),
    ):
        if mine != theirs:
            raise SystemExit(f"pandas and DuckDB disagree on {what}: {theirs} vs {mine}")
    duck = sorted(duck_dir.glob("[0-9]*.parquet"))
    if [p.name for p in duck] != [p.name for p in sorted(pandas_dir.glob("*.parquet"))]:
        raise SystemExit("pandas and DuckDB wrote different shards")
    for p in duck:
        a = pq.read_table(p)
        b = pq.read_table(pandas_dir / p.name, columns=a.column_names).cast(a.schema)
        for name in a.column_names:
            x, y = a[name], b[name]
            if pa.types.is_floating(x.type):  # NaN equals NaN here; null equals null
                same = x.is_null().equals(y.is_null()) and np.array_equal(
                    np.asarray(x.fill_null(0)), np.asarray(y.fill_null(0)), equal_nan=True
                )
            else:
                same = x.equals(y)
            if not same:
                raise SystemExit(f"pandas and DuckDB wrote different {name!r} in {p.name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    # pandas' first run is its slowest (18-21 s against 13-15 s here): with two runs its best
    # still varied 13.9-17.1 s, which moved the ratio by 20%.
    parser.add_argument("--pandas-repeat", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/sdpipe/bench")
    # A DuckDB memory limit ("2GB"): the stage once, spilling, no pandas (it holds every row).
    parser.add_argument("--memory-limit", default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="the data root's disk")
    # `loose`: sizes and URL dedup only, most rows kept: the passing rows far exceed memory.
    parser.add_argument("--profile", default=None, help="a catalog profile, or loose")
    args = parser.parse_args()
    from catalog import FilterProfile, load_catalog
    from tasks.curation import filter as filter_stage

    catalog = load_catalog()
    source = catalog.source("laion")
    if args.profile == "loose":
        profile = FilterProfile(name="loose", min_side=256, dedup=("url",))
    else:  # default phase 1's dataset laion-broad
        profile = catalog.profile(args.profile or source.profile)
    start = time.perf_counter()
    paths, ingest = cached_files(args.rows, args.cache_dir)
    generate_s = time.perf_counter() - start
    if args.memory_limit:
        load_before = round(os.getloadavg()[0], 2)
        out = run_capped(args, profile, source, paths)
        files_gb = round(sum(p.stat().st_size for p in paths) / 1e9, 2)
        print(
            json.dumps(
                {"bench": "filter-capped", "rows": args.rows, "profile": profile.name, **out}
                | {"files": len(paths), "files_gb": files_gb, "goals": {"completed": True}}
                | {"generate_seconds": round(generate_s, 1), "load_avg_1m_before": load_before}
                | {"machine": f"{platform.machine()} {os.cpu_count()} cores"}
                | {"load_avg_1m": round(os.getloadavg()[0], 2)}
            )
        )
        return
    if len(paths) > 1:
        raise SystemExit(f"over {FILE_ROWS} rows pandas cannot keep up here: add --memory-limit")
    path = paths[0]

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-filter-"))
    (work / "laion" / "metadata").mkdir(parents=True)
    (work / "laion" / "metadata" / "00000.parquet").symlink_to(path)
    duck_s, duck_cpu, pandas_s = [], [], []
    try:
        # Best of each, each side's runs back to back (a pandas run leaves gigabytes of freed
        # memory behind; a stage run right after it measured up to 20% slower).
        for _ in range(args.repeat):
            shutil.rmtree(work / "laion" / "filtered", ignore_errors=True)
            start, cpu = time.perf_counter(), time.process_time()
            stats = filter_stage.filter_metadata(work, "laion", profile, source.samples_per_shard)
            duck_s.append(time.perf_counter() - start)
            duck_cpu.append(time.process_time() - cpu)
        for _ in range(args.pandas_repeat):
            shutil.rmtree(work / "pandas", ignore_errors=True)
            start = time.perf_counter()
            reference = pandas_filter(path, profile, work / "pandas", source.samples_per_shard)
            pandas_s.append(time.perf_counter() - start)
        filtered = work / "laion" / "filtered"
        waterfall = json.loads((filtered / "waterfall.json").read_text())
        check_same(reference, stats, waterfall, filtered, work / "pandas")
    finally:
        shutil.rmtree(work)
    best = min(duck_s)
    print(
        json.dumps(
            {
                "bench": "filter",
                "rows": args.rows,
                "profile": profile.name,
                "dedup": "url",
                "seconds": round(best, 3),
                "seconds_all": [round(s, 3) for s in duck_s],
                # CPU seconds of the best run (both cores): wall time well above cpu / 2 means
                # other processes were competing for the cores.
                "cpu_seconds": round(duck_cpu[duck_s.index(best)], 3),
                "rows_per_s": round(args.rows / best),
                "pandas_seconds": round(min(pandas_s), 3),
                "pandas_seconds_all": [round(s, 3) for s in pandas_s],
                "speedup_vs_pandas": round(min(pandas_s) / best, 1),
                "kept": stats.num_out,
                "dropped": stats.dropped,
                # Dropped before the filter, by the metadata stage, on generation (cached).
                "ingest_dropped": {"missing_url": ingest["missing_url"]},
                "ingest_check_seconds": ingest["ingest_check_seconds"],
                "generate_seconds": round(generate_s, 1),
                "file_mb": round(path.stat().st_size / 2**20),
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
