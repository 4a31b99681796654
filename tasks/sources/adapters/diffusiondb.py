"""diffusiondb: DiffusionDB 2M (poloclub/diffusiondb on the Hugging Face hub).

Layout (the upstream's, relative to the source location):
- `metadata.parquet`: one row per image, columns image_name, prompt, part_id, seed, step, cfg,
  sampler, width, height, user_name, timestamp, image_nsfw, prompt_nsfw;
- `images/part-NNNNNN.zip` (part ids from 1, six digits): ~1000 PNGs named `<uuid>.png`,
  plus `part-NNNNNN.json` mapping image name -> {p: prompt, se: seed, c: cfg, st: steps,
  sa: sampler}.

Samples are the metadata rows of the chosen parts, by part id, then in metadata order. The
caption is the metadata's `prompt`; where that is null, the part JSON's `p` (the part's zip is
then opened at index time). An image of a part zip that the metadata does not list is not a
sample. Source options:
- `parts`: how many parts (the first N part ids of the metadata, in order) or a list of part
  ids; default every part the metadata names.
"""

from __future__ import annotations

import contextlib
import io
import json
import zipfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from tasks.sources.adapters.base import SEP, Adapter, Entry, Refused, SourceLayoutError

METADATA = "metadata.parquet"
REQUIRED = ("image_name", "prompt", "part_id", "image_nsfw", "prompt_nsfw")
OPTIONAL = ("seed", "step", "cfg", "sampler")  # kept when present, else null


def part_zip(part: int) -> str:
    return f"images/part-{part:06d}.zip"


def part_json(part: int) -> str:
    return f"part-{part:06d}.json"


class DiffusionDB(Adapter):
    extras = {
        "image_nsfw": pa.float64(),
        "prompt_nsfw": pa.float64(),
        "part_id": pa.int64(),
        "seed": pa.int64(),
        "step": pa.int64(),
        "cfg": pa.float64(),
        "sampler": pa.string(),
    }

    def entries(self) -> Iterator[Entry | Refused]:
        self.require(METADATA)
        table = self.metadata()
        parts = self.chosen_parts(pc.unique(table["part_id"]).to_pylist())
        order = {p: i for i, p in enumerate(parts)}
        chosen = pc.is_in(table["part_id"], value_set=pa.array(parts, pa.int64()))
        rows = table.filter(chosen).to_pylist()  # 2M rows upstream: filter before Python
        rows.sort(key=lambda r: order[r["part_id"]])  # stable: metadata order within a part
        fallback: dict[int, dict] = {}
        for r in rows:
            part, name = r["part_id"], r["image_name"]
            origin = f"{part_zip(part)}{SEP}{name}"
            if not isinstance(name, str) or not name:
                yield Refused(origin, "bad_metadata")
                continue
            caption = r["prompt"]
            if caption is None:
                if part not in fallback:
                    fallback[part] = self.part_prompts(part)
                caption = fallback[part].get(name)
            extras = {k: r.get(k) for k in self.extras}
            yield Entry(origin, caption, extras)

    def metadata(self) -> pa.Table:
        """The metadata's columns this adapter reads, extras cast to their types."""
        with seekable(self, METADATA) as f:
            pf = pq.ParquetFile(f)
            found = pf.schema_arrow.names
            missing = [c for c in REQUIRED if c not in found]
            if missing:
                raise SourceLayoutError(
                    f"source {self.source.name!r}: {self.path(METADATA)} lacks column(s) "
                    f"{', '.join(missing)} (found: {', '.join(found)})"
                )
            table = pf.read(columns=[*REQUIRED, *(c for c in OPTIONAL if c in found)])
        columns = {}
        for name in ("image_name", "prompt", "part_id", *self.extras):
            if name not in table.column_names:
                columns[name] = pa.nulls(table.num_rows, self.extras[name])
                continue
            col = table[name]
            dtype = self.extras.get(name) or {"part_id": pa.int64()}.get(name)
            if dtype is not None and col.type != dtype:
                col = col.cast(dtype)
            columns[name] = col
        return pa.table(columns)

    def chosen_parts(self, part_ids: list) -> list[int]:
        present = sorted({p for p in part_ids if p is not None})
        option = self.source.options.get("parts")
        if option is None:
            return present
        if isinstance(option, int) and not isinstance(option, bool):
            return present[:option]
        if isinstance(option, list | tuple) and all(isinstance(p, int) for p in option):
            absent = [p for p in option if p not in set(present)]
            if absent:
                raise SourceLayoutError(
                    f"source {self.source.name!r}: parts {absent} are not in "
                    f"{self.path(METADATA)} (it has {len(present)} parts, "
                    f"{present[0] if present else '-'}..{present[-1] if present else '-'})"
                )
            return list(dict.fromkeys(option))
        raise SourceLayoutError(
            f"source {self.source.name!r}: option parts must be a count or a list of part ids, "
            f"not {option!r}"
        )

    def part_prompts(self, part: int) -> dict[str, str | bytes]:
        """image name -> prompt from a part's JSON; {} when the zip or JSON is unreadable (the
        samples are then counted under their caption reason, or at repack)."""
        try:
            with seekable(self, part_zip(part)) as f, zipfile.ZipFile(f) as zf:
                raw = zf.read(part_json(part))
            # Invalid UTF-8 stays in the prompt (as bytes) so it is counted as a caption fault.
            data = json.loads(raw.decode("utf-8", "surrogateescape"))
        except (FileNotFoundError, KeyError, zipfile.BadZipFile, OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        out = {}
        for name, meta in data.items():
            p = meta.get("p") if isinstance(meta, dict) else None
            if isinstance(p, str):
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError:
                    p = p.encode("utf-8", "surrogateescape")
            out[name] = p
        return out


@contextlib.contextmanager
def seekable(adapter: Adapter, relative: str):
    """A random-access file of the location: through fsspec's ranged reads, or, where the
    server does not serve ranges (a plain HTTP mirror), the whole file read into memory."""
    f = adapter.open(relative)
    try:
        try:
            if not isinstance(adapter.fs, LocalFileSystem):
                f.seek(-1, 2)
                f.read(1)
                f.seek(0)
        except ValueError:  # fsspec: "The HTTP server doesn't appear to support range requests"
            f.close()
            f = io.BytesIO(adapter.fs.cat_file(adapter.path(relative)))
        yield f
    finally:
        f.close()
