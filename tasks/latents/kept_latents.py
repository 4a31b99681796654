"""Files that phase sets link, kept aside when a stage writes the shard again; pruning them.

A phase set links a shard's latents and tokens by name. Any rewrite of the shard (encode under
another spec, a refetch or a re-selection that removed its records, a bucket file gone) would
replace those files under the same names, and a phase mixed before could then be neither
resumed nor evaluated. So before encode writes a shard (`encode_spec.forget_other_spec`), its
latents files that a phase set links are moved into `latents/spec-<digest>/` (the digest of the
spec they were encoded under, `LatentSpec.digest`; `spec-legacy` for a legacy shard of an older
sdpipe that names none) with a hard link of its keys file, and those sets' links re-pointed
there (a relative link, swapped atomically); tokenize does the same with linked tokens files,
into `tokens/kept/`. A folder holds one generation of a shard: when it already holds the
shard's files (the spec left and returned to, or rewritten under one spec) the next free of
`<name>.2`, `<name>.3`, ... is taken, so a kept generation is never overwritten. Keeping costs
renames, and only for shards some set links; nothing under the kept folders is read by mix,
encode or tokenize.

Kept files stay until `sdpipe prune-latents` (`prune`) removes those no phase set links any
more, with the latents files of a done shard that its record does not name (an old bucket
plan's): it lists them by default and deletes them with `--yes`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import threading
from pathlib import Path

import pyarrow as pa

from tasks.latents import latent_keys
from tasks.runtime.shards import ShardStats, stats_path

KEPT = "spec-"  # latents/spec-<digest>[.N]/
KEPT_TOKENS = "kept"  # tokens/kept[.N]/
TOKENS = "tokens"
_FROM_KEYS = object()  # keep_linked: the spec the shard's keys file names
log = logging.getLogger(__name__)


def spec_digest(spec: dict | None) -> str:
    """`LatentSpec.digest()` of a spec as recorded (`to_dict()`), "legacy" when none is."""
    if spec is None:
        return "legacy"
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _norm(path: Path | str) -> str:
    return os.path.normpath(os.path.abspath(path))


class PhaseLinks:
    """The latents and tokens links of every phase set under the data root, by their target:
    read once, when first asked (`phase_links` shares one per root while the sets stay)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lock = threading.Lock()  # held by a keep: its lookups and re-pointing
        self._by_target: dict[str, list[Path]] | None = None
        self._by_shard: dict[tuple[str, str], set[str]] = {}  # (folder, shard) -> targets

    def by_target(self) -> dict[str, list[Path]]:
        if self._by_target is None:
            found: dict[str, list[Path]] = {}
            phases = self.root / "phases"
            for folder in sorted(phases.iterdir()) if phases.is_dir() else []:
                for kind in (latent_keys.STAGE, TOKENS):
                    links = folder / kind
                    if not links.is_dir():
                        continue
                    for entry in os.scandir(links):
                        if entry.is_symlink():
                            target = _norm(os.path.join(links, os.readlink(entry.path)))
                            found.setdefault(target, []).append(Path(entry.path))
                            self._index(target)
            self._by_target = found
        return self._by_target

    def _index(self, target: str) -> None:
        folder, name = os.path.split(target)
        self._by_shard.setdefault((folder, name.split(".", 1)[0]), set()).add(target)

    def linked_in(self, folder: Path, shard: str, suffixes: tuple[str, ...]) -> list[Path]:
        """The shard's files in `folder` ending in one of `suffixes` that a phase set links
        now: from the index (no listing of the folder), each checked by its links."""
        self.by_target()
        targets = self._by_shard.get((_norm(folder), shard), set())
        return [Path(t) for t in sorted(targets) if t.endswith(suffixes) and self.links_to(t)]

    def links_to(self, path: Path | str) -> list[Path]:
        """The links that point at `path` now (another process may have re-pointed some)."""
        target = _norm(path)
        return [
            link
            for link in self.by_target().get(target, [])
            if os.path.islink(link)
            and _norm(os.path.join(link.parent, os.readlink(link))) == target
        ]

    def moved(self, old: Path, new: Path) -> None:
        """Re-point the links to `old` at `new` (each link swapped in one rename)."""
        links = self.links_to(old)
        self.by_target().pop(_norm(old), None)
        folder, name = os.path.split(_norm(old))
        self._by_shard.get((folder, name.split(".", 1)[0]), set()).discard(_norm(old))
        for link in links:
            tmp = link.with_name(f".{link.name}.{os.getpid()}.relink")
            tmp.unlink(missing_ok=True)
            os.symlink(os.path.relpath(new, link.parent), tmp)
            os.replace(tmp, link)
        self.by_target().setdefault(_norm(new), []).extend(links)
        self._index(_norm(new))


_shared: dict[str, tuple[tuple, PhaseLinks]] = {}
_shared_lock = threading.Lock()


def phase_links(root: Path) -> PhaseLinks:
    """This process's `PhaseLinks` of `root`, read again when a phase set came or went (mix
    renames each set into place: the listing of `phases/` with inodes changes). One listing
    of a few names per call: cheap per shard."""
    phases = Path(root) / "phases"
    try:
        state = tuple(sorted((e.name, e.inode()) for e in os.scandir(phases)))
    except FileNotFoundError:
        state = ()
    with _shared_lock:
        held = _shared.get(_norm(root))
        if held is None or held[0] != state:
            held = (state, PhaseLinks(root))
            _shared[_norm(root)] = held
        return held[1]


def _free_folder(folder: Path, base: str, names: list[str]) -> Path:
    """The first of `base`, `base.2`, ... under `folder` holding none of `names` (a kept
    generation of the shard is never overwritten), made if new."""
    for n in itertools.count(1):
        kept = folder / (base if n == 1 else f"{base}.{n}")
        if not any(os.path.lexists(kept / name) for name in names):
            kept.mkdir(exist_ok=True)
            return kept
    raise AssertionError("unreachable")


def _keys_spec(keys: Path) -> dict | None:
    """The spec a keys file names (None: legacy, or no keys file)."""
    try:
        return latent_keys.spec(pa.ipc.open_file(pa.memory_map(str(keys))).read_all())
    except FileNotFoundError:
        return None


def keep_linked(
    root: Path, source: str, shard: str, links: PhaseLinks, spec=_FROM_KEYS
) -> list[Path]:
    """Move the shard's latents files that a phase set links (and hard-link its keys file,
    which encode then replaces) into a free folder of the spec they were encoded under
    (`spec`: as recorded; default: as their keys file names it), re-pointing the links;
    returns where they went (nothing when no set links them)."""
    folder = root / source / latent_keys.STAGE
    with links.lock:
        linked = links.linked_in(folder, shard, (".npy",))  # an index lookup: no listing
        if not linked:
            return []
        keys = latent_keys.path(root, source, shard)
        if spec is _FROM_KEYS:
            spec = _keys_spec(keys)
        names = [keys.name, f"{shard}.npy", *(f.name for f in linked)]
        kept = _free_folder(folder, f"{KEPT}{spec_digest(spec)}", names)
        if keys.exists():
            # A link, not a move: the keys file left in place tells encode the shard's
            # unlinked files of an earlier encode are there to remove (`_encoded_before`).
            os.link(keys, kept / keys.name)
        out = _move(linked, kept, links)
    log.warning(
        "encode %s/%s: %d latents file(s) that phase sets link are kept in %s before it is "
        "encoded again (sdpipe prune-latents removes them once no phase set links them)",
        source, shard, len(out), kept,
    )  # fmt: skip
    return out


def keep_linked_tokens(root: Path, source: str, shard: str, links: PhaseLinks) -> list[Path]:
    """Move the shard's tokens files (`NNNNN.parquet`, `NNNNN.npy`) that a phase set links into
    a free `tokens/kept[.N]/`, re-pointing the links; returns where they went."""
    folder = root / source / TOKENS
    with links.lock:
        linked = links.linked_in(folder, shard, (".parquet", ".npy"))
        if not linked:
            return []
        kept = _free_folder(folder, KEPT_TOKENS, [f"{shard}.parquet", f"{shard}.npy"])
        out = _move(linked, kept, links)
    log.warning(
        "tokenize %s/%s: %d tokens file(s) that phase sets link are kept in %s before it is "
        "tokenized again (sdpipe prune-latents removes them once no phase set links them)",
        source, shard, len(out), kept,
    )  # fmt: skip
    return out


def _move(files: list[Path], kept: Path, links: PhaseLinks) -> list[Path]:
    out = []
    for f in files:
        os.replace(f, kept / f.name)
        links.moved(f, kept / f.name)
        out.append(kept / f.name)
    return out


def _shard(path: Path) -> str:
    return path.name.split(".", 1)[0]


def _left_over(stage: Path, linked: dict[str, list[Path]]) -> list[Path]:
    """Latents files in `stage` (not kept) of a done shard that its record does not name and no
    phase set links: an earlier encode's (an old bucket plan's). Files newer than the record
    are an encode at work, not left over."""
    out = []
    by_shard: dict[str, list[Path]] = {}
    for p in stage.glob("*.npy"):
        by_shard.setdefault(_shard(p), []).append(p)
    for shard, files in sorted(by_shard.items()):
        record = stats_path(stage.parent.parent, stage.parent.name, stage.name, shard)
        try:
            outputs, written = ShardStats.read(record).outputs, record.stat().st_mtime_ns
        except FileNotFoundError:
            continue  # not done: encode replaces or removes its files
        for f in sorted(files):
            if f.name in outputs or _norm(f) in linked or f.stat().st_mtime_ns > written:
                continue
            out.append(f)
    return out


def unreferenced(root: Path, sources: list[str] | None = None) -> list[Path]:
    """Kept files no phase set links (a kept shard's files go together: its keys file stays
    while any of its latents files is linked), and latents files left over (`_left_over`)."""
    linked = PhaseLinks(root).by_target()
    out: list[Path] = []
    folders = [
        *Path(root).glob(f"*/{latent_keys.STAGE}/{KEPT}*"),
        *Path(root).glob(f"*/{TOKENS}/{KEPT_TOKENS}*"),
    ]
    for kept in sorted(folders):
        if not kept.is_dir() or (sources and kept.parent.parent.name not in sources):
            continue
        files = sorted(kept.iterdir())
        live = {_shard(f) for f in files if _norm(f) in linked}
        out += [f for f in files if _shard(f) not in live]
    for stage in sorted(Path(root).glob(f"*/{latent_keys.STAGE}")):
        name = stage.parent.name
        if stage.is_dir() and name != "phases" and (not sources or name in sources):
            out += _left_over(stage, linked)
    return out


def prune(root: Path, sources: list[str] | None = None, *, delete: bool = False) -> dict:
    """The kept and left-over files no phase set links ({"files": [(path, bytes)], "bytes",
    "deleted"}); `delete`: remove them (and the kept folders left empty)."""
    files = [(f, f.stat().st_size) for f in unreferenced(root, sources)]
    if delete:
        for f, _ in files:
            f.unlink(missing_ok=True)
        for folder in {f.parent for f, _ in files}:
            if folder.name.startswith((KEPT, KEPT_TOKENS)) and not any(folder.iterdir()):
                folder.rmdir()
    return {"files": files, "bytes": sum(n for _, n in files), "deleted": delete}
