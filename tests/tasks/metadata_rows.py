"""Metadata sample-table rows for the filter tests: one schema, a row that passes the recipe's
laion-broad thresholds unless told otherwise, and a writer of metadata shards."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile

SOURCE = "src"
SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source", pa.string()),
        ("url", pa.string()),
        ("caption", pa.string()),
        ("width", pa.float64()),
        ("height", pa.float64()),
        ("similarity", pa.float64()),
        ("punsafe", pa.float64()),
        ("pwatermark", pa.float64()),
        ("aesthetic", pa.float64()),
    ]
)
# The recipe's phase-1 thresholds (catalog laion-broad).
RECIPE = FilterProfile(
    name="recipe",
    min_aesthetic=6.5,
    min_similarity=0.28,
    max_pwatermark=0.5,
    max_punsafe=0.5,
    min_side=512,
    dedup=("url", "sha256"),
)
GOOD = {
    "width": 800.0,
    "height": 600.0,
    "similarity": 0.3,
    "punsafe": 0.1,
    "pwatermark": 0.1,
    "aesthetic": 7.0,
}


def row(key: str, **overrides) -> dict:
    """A row passing RECIPE, with its own URL; the caption has markup the gallery must escape."""
    fields = {
        "key": key,
        "source": SOURCE,
        "url": f"http://x/{key}.jpg",
        "caption": f"<b>caption</b> {key}",
        **GOOD,
    }
    fields.update(overrides)
    return fields


def write_metadata(root: Path, *parts: list[dict], **write_options) -> None:
    """Each part of rows as one `<root>/src/metadata/NNNNN.parquet`, in order."""
    folder = root / SOURCE / "metadata"
    folder.mkdir(parents=True)
    for j, rows in enumerate(parts):
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        pq.write_table(table, folder / f"{j:05d}.parquet", **write_options)
