"""Captions at train time: a phase set's `captions.arrow`, drawn and tag-augmented per
(seed, epoch, row), tokenized as the tokenize stage tokenizes.

A phase with `train_time_captions: true` trains on text, not on its stored ids: mix writes
`<phase_dir>/captions.arrow` (`write_captions`: an uncompressed Arrow IPC file, column
`captions` list<string>, row i = manifest row i, one or several captions per image) and the
loader asks `TrainTimeCaptions` for a batch's ids. For each (seed, epoch, row), from one
generator seeded as the objective seeds its draws (`np.random.default_rng((seed,
CAPTION_STREAM, epoch, row))`, so the draws depend neither on ranks nor on where a run resumed):

1. one caption of the row's captions;
2. the caption split on `tag_separator` into tags; the first `keep_tokens` stay in place (a
   score tag `scr<N>` or a character name, as kohya's keep_tokens);
3. with probability `shuffle_tags_p` the other tags are shuffled (seed 002's shuffle_tag_p);
4. each of the other tags is dropped with probability `tag_dropout` (kohya's
   caption_tag_dropout_rate); the kept tokens never are;
5. the tags joined by `tag_separator` and tokenized by `sdtrain.models.encode_captions` (the
   tokenize stage's own path: BOS, 75 ids, EOS, EOS padding; built once per process).

The caption dropout of classifier-free guidance stays the objective's (`cfg_dropout`).
Nothing is held per row: the file is memory-mapped (the ranks of a machine share the page
cache), and a row is found from its chunk's offsets.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain import layout

CAPTIONS = "captions.arrow"
# The generator stream of the caption draws: apart from the objective's noise (0, 1) and any
# other per-row draw seeded by (seed, stream, epoch, row).
CAPTION_STREAM = 0x43415054  # "CAPT"
SCHEMA = pa.schema([("captions", pa.list_(pa.string()))])
BATCH_ROWS = 1 << 20  # manifest rows per record batch of captions.arrow


@dataclass(frozen=True, slots=True)
class CaptionSettings:
    """A phase's caption augmentation (the catalog phase's fields of the same names)."""

    shuffle_tags_p: float = 0.0
    keep_tokens: int = 0
    tag_separator: str = ", "
    tag_dropout: float = 0.0

    @classmethod
    def of(cls, config) -> CaptionSettings:
        """The settings of a `TrainConfig` or catalog `Phase`."""
        return cls(
            shuffle_tags_p=config.shuffle_tags_p,
            keep_tokens=config.keep_tokens,
            tag_separator=config.tag_separator,
            tag_dropout=config.tag_dropout,
        )

    @property
    def augments(self) -> bool:
        return self.shuffle_tags_p > 0 or self.tag_dropout > 0


class TrainTimeCaptions:
    """Row i of `<phase_dir>/captions.arrow`: its caption and ids for an epoch.

    Safe to share between loader threads and to hand to DataLoader workers (pickled as its
    path and settings; each process maps the file on first use).
    """

    def __init__(
        self, phase_dir: str | Path, settings: CaptionSettings | None = None, seed: int = 0
    ):
        self.path = Path(phase_dir) / CAPTIONS
        self.settings = settings or CaptionSettings()
        self.seed = seed
        if not self.path.is_file():
            raise FileNotFoundError(
                f"{self.path} is missing: the phase tokenizes at train time but its set was "
                "mixed without captions; mix the phase again (a run with checkpoints keeps the "
                "set it started on: `sdtrain.captions.write_captions(<phase_dir>)` adds the "
                "file to it)"
            )
        self._lock = threading.Lock()
        self._chunks: list[tuple[np.ndarray, pa.Array]] | None = None
        self._starts = np.zeros(1, np.int64)

    def __getstate__(self) -> dict:
        return {"path": self.path, "settings": self.settings, "seed": self.seed}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"].parent, state["settings"], state["seed"])

    def _mapped(self) -> list[tuple[np.ndarray, pa.Array]]:
        """Per chunk: (list offsets, string values), mapped on first use."""
        if self._chunks is None:
            with self._lock:
                if self._chunks is None:
                    with pa.memory_map(str(self.path)) as source:
                        column = pa.ipc.open_file(source).read_all()["captions"]
                    chunks = [c for c in column.chunks if len(c)]
                    self._starts = np.cumsum([0, *(len(c) for c in chunks)], dtype=np.int64)
                    self._chunks = [(c.offsets.to_numpy(), c.values) for c in chunks]
        return self._chunks

    def __len__(self) -> int:
        self._mapped()
        return int(self._starts[-1])

    def options(self, row: int) -> list[str]:
        """Every caption of a row, in stored order."""
        chunks = self._mapped()
        if not 0 <= row < self._starts[-1]:
            raise IndexError(f"{self.path}: row {row} of {int(self._starts[-1])}")
        c = int(np.searchsorted(self._starts, row, side="right")) - 1
        offsets, values = chunks[c]
        i = row - int(self._starts[c])
        a, b = int(offsets[i]), int(offsets[i + 1])
        return values.slice(a, b - a).to_pylist()

    def caption(self, row: int, epoch: int) -> str:
        """The row's caption for this epoch: drawn, tags shuffled and dropped (module doc)."""
        return self._augmented(self.options(row), row, epoch)

    def _augmented(self, options: list[str], row: int, epoch: int) -> str:
        s = self.settings
        if len(options) == 1 and not s.augments:
            return options[0]
        rng = np.random.default_rng((self.seed, CAPTION_STREAM, epoch, row))
        text = options[int(rng.integers(len(options)))] if len(options) > 1 else options[0]
        if not s.augments:
            return text
        tags = text.split(s.tag_separator)
        kept, rest = tags[: s.keep_tokens], tags[s.keep_tokens :]
        if s.shuffle_tags_p > 0 and rng.random() < s.shuffle_tags_p:
            rest = [rest[i] for i in rng.permutation(len(rest))]
        if s.tag_dropout > 0:
            survive = (rng.random(len(rest)) >= s.tag_dropout).tolist()
            rest = [t for t, keep in zip(rest, survive, strict=True) if keep]
        return s.tag_separator.join(kept + rest)

    def captions(self, rows: Sequence[int], epoch: int | Sequence[int]) -> list[str]:
        """The captions of a batch's rows (one epoch, or one per row)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        epochs = np.broadcast_to(np.asarray(epoch, np.int64), rows.shape).tolist()
        return [
            self._augmented(options, r, e)
            for options, r, e in zip(self._options_of(rows), rows.tolist(), epochs, strict=True)
        ]

    def _options_of(self, rows: np.ndarray) -> list[list[str]]:
        """Each row's captions, a batch in one Arrow take per chunk it touches."""
        chunks = self._mapped()
        if len(rows) and (rows.min() < 0 or rows.max() >= self._starts[-1]):
            raise IndexError(f"{self.path}: rows {rows.tolist()} of {int(self._starts[-1])}")
        chunk_of = np.searchsorted(self._starts, rows, side="right") - 1
        out: list[list[str]] = [[] for _ in range(len(rows))]
        for c in np.unique(chunk_of).tolist():
            at = np.flatnonzero(chunk_of == c)
            offsets, values = chunks[c]
            local = rows[at] - int(self._starts[c])
            starts, ends = offsets[local], offsets[local + 1]
            flat = values.take(
                pa.array(
                    np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
                )
                if len(local)
                else pa.array([], pa.int64())
            ).to_pylist()
            cut = np.concatenate([[0], np.cumsum(ends - starts)]).tolist()
            for i, a, b in zip(at.tolist(), cut[:-1], cut[1:], strict=True):
                out[i] = flat[a:b]
        return out

    def ids(self, row: int, epoch: int) -> np.ndarray:
        """The row's token ids for this epoch, int32 [77], as tokenize would store them."""
        return self.ids_batch([row], epoch)[0]

    def ids_batch(self, rows: Sequence[int], epoch: int | Sequence[int]) -> np.ndarray:
        """Token ids int32 [B, 77] of a batch's rows, tokenized in one call (the collate's)."""
        from sdtrain.models import encode_captions  # torch: imported by the trainer anyway

        ids, _ = encode_captions(self.captions(rows, epoch))
        return ids


def for_run(config) -> TrainTimeCaptions | None:
    """A run's train-time captions (a `TrainConfig` with `train_time_captions`), seeded by the
    run's seed; None: the run reads the stored ids."""
    if not config.train_time_captions:
        return None
    return TrainTimeCaptions(config.phase_dir, CaptionSettings.of(config), config.seed)


def _listed(table: pa.Table) -> pa.Array:
    """The `captions` list<string> of a tokens table: its own column, else `caption` as a list
    of one."""
    if "captions" in table.column_names:
        return pc.cast(table["captions"].combine_chunks(), pa.list_(pa.string()))
    caption = pc.cast(table["caption"].combine_chunks(), pa.string())
    offsets = pa.array(np.arange(len(caption) + 1, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, caption)


def _from_shards(tokens: Path, root: Path, name: str) -> pa.Array:
    """The captions of a tokens file written before tokenize kept them: the shard's sample
    table `<root>/<source>/shards/<shard>.parquet` joined on key (whitespace trimmed, as
    tokenize cleaned them; its `captions` list where it has one, for that row's)."""
    source, shard = name.rsplit("-", 1)
    shard = shard.split(".", 1)[0]  # `<shard>.<WxH>`: one bucket's file of the shard
    samples = root / source / "shards" / f"{shard}.parquet"
    keys = pq.read_table(tokens, columns=["key"])["key"]
    wanted = [c for c in ("key", "caption", "captions") if c in pq.read_schema(samples).names]
    table = pq.read_table(samples, columns=wanted)
    where = pc.index_in(keys, value_set=table["key"])
    if where.null_count:
        raise ValueError(f"{tokens}: keys missing from {samples}; tokenize the shard again")
    picked = table.take(where)
    one = _listed(picked.select(["caption"]))
    one = pa.ListArray.from_arrays(one.offsets, pc.utf8_trim_whitespace(one.values))
    if "captions" not in picked.column_names:
        return one
    many = pc.cast(picked["captions"].combine_chunks(), pa.list_(pa.string()))
    many = pa.ListArray.from_arrays(
        many.offsets, pc.utf8_trim_whitespace(many.values), mask=pc.is_null(many)
    )
    return pc.if_else(pc.greater(pc.fill_null(pc.list_value_length(many), 0), 0), many, one)


def write_captions(
    phase_dir: str | Path,
    index: tuple[list, np.ndarray] | None = None,
    root: str | Path | None = None,
) -> Path:
    """`<phase_dir>/captions.arrow` for the phase set's rows (temp name, then renamed).

    `index`: (files, rows) as `sdtrain.layout` holds them (file names or `files.json`
    entries; rows int32 [N, >=3], file and token row in columns 0 and 2); default: the
    folder's own. Each row's captions are its tokens file's `captions` (or `caption`, as a
    list of one) at its token row, taken per file with Arrow (files read once while the
    manifest's rows come in runs of a file, as mix writes them). A tokens file written before
    tokenize kept the text has neither: its captions are read from the shard's sample table
    `<root>/<source>/shards/<shard>.parquet` by key (`root` defaults to the phase folder's
    grandparent, `<root>/phases/<phase>`).
    """
    phase_dir = Path(phase_dir)
    root = Path(root) if root is not None else phase_dir.parent.parent
    if index is None:
        index = layout.mapped_index(phase_dir) or layout.derived_index(phase_dir)
    files, rows = index
    names = [f["name"] if isinstance(f, dict) else f for f in files]
    out = phase_dir / CAPTIONS
    tmp = out.with_name(f".{CAPTIONS}.tmp")
    try:
        _write_batches(tmp, rows, _TokenFiles(phase_dir, root, names))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out


class _TokenFiles:
    """The captions of a phase set's tokens files (list<string> each), read on first use and
    held until released; files linked to one tokens file (a shard's buckets) read it once."""

    def __init__(self, phase_dir: Path, root: Path, names: list[str]):
        self.phase_dir, self.root, self.names = phase_dir, root, names
        self.loaded: dict[Path, pa.Array] = {}  # tokens file (resolved) -> its captions

    def path(self, f: int) -> Path:
        return self.phase_dir / "tokens" / f"{self.names[f]}.parquet"

    def captions(self, f: int) -> pa.Array:
        path = self.path(f)
        target = path.resolve()
        if target not in self.loaded:
            have = pq.read_schema(path).names
            if "captions" in have or "caption" in have:
                wanted = ["captions"] if "captions" in have else ["caption"]
                self.loaded[target] = _listed(pq.read_table(path, columns=wanted))
            else:
                self.loaded[target] = _from_shards(path, self.root, self.names[f])
        return self.loaded[target]

    def release(self, files: list[int]) -> None:
        for f in files:
            self.loaded.pop(self.path(f).resolve(), None)


def _write_batches(tmp: Path, rows: np.ndarray, token_files: _TokenFiles) -> None:
    """captions.arrow's record batches, BATCH_ROWS manifest rows each, in manifest order: a
    block's rows grouped by file, each file's taken at their token rows, put back in order."""
    last = _last_rows(rows, len(token_files.names))
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        for start in range(0, len(rows), BATCH_ROWS):
            block = np.asarray(rows[start : start + BATCH_ROWS])
            file_of, token_rows = block[:, 0], block[:, 2]
            order = np.argsort(file_of, kind="stable")
            bounds = np.flatnonzero(np.diff(file_of[order])) + 1
            parts = []
            for run in np.split(order, bounds):
                f = int(file_of[run[0]])
                listed = token_files.captions(f)
                wanted = token_rows[run]
                if wanted.max() >= len(listed):
                    raise ValueError(
                        f"{token_files.path(f)}: fewer rows than the manifest reads; mix the "
                        "phase again"
                    )
                parts.append(listed.take(pa.array(wanted)))
            taken = pa.concat_arrays(parts) if parts else pa.array([], SCHEMA.field(0).type)
            inverse = np.empty(len(order), np.int64)
            inverse[order] = np.arange(len(order))
            writer.write_batch(pa.record_batch([taken.take(pa.array(inverse))], schema=SCHEMA))
            # Files whose last row is behind: let go (a file's rows come in runs).
            token_files.release(np.unique(file_of[last[file_of] < start + BATCH_ROWS]).tolist())


def _last_rows(rows: np.ndarray, num_files: int) -> np.ndarray:
    """Per file, the last manifest row that reads it (by runs of a file, a block at a time):
    a file's captions are let go once the rows pass it."""
    last = np.full(num_files, -1, np.int64)
    for start in range(0, len(rows), BATCH_ROWS):
        file_of = np.asarray(rows[start : start + BATCH_ROWS, 0])
        ends = np.append(np.flatnonzero(np.diff(file_of)), len(file_of) - 1)
        np.maximum.at(last, file_of[ends], ends + start)
    return last
