"""Latents of another spec, kept while a phase set links them; pruning those no set links.

A shard encoded again under another latent spec (flips turned on by a later phase, a source's
`latent_sampling`, a new bucket plan or VAE) would remove or overwrite, under the same names, the
files that phase sets mixed before link to: those phases could then be neither resumed nor
evaluated. So before encode forgets a shard's old spec (`encode_spec.forget_other_spec`), the
shard's latents files that any phase set links, and its keys file, are moved into
`latents/spec-<digest>/` (the digest of the spec they were encoded under, `LatentSpec.digest`;
`spec-legacy` for a record of an older sdpipe that names none) and those sets' links re-pointed
there (a relative link, swapped atomically). Files no set links are left to encode, which
replaces them as before. Nothing under `spec-*/` is ever read by mix or encode.

Kept files stay until `sdpipe prune-latents` (`prune`) removes those no phase set links any
more: it lists them by default and deletes them with `--yes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from tasks.latents import latent_keys

KEPT = "spec-"
log = logging.getLogger(__name__)


def spec_digest(spec: dict | None) -> str:
    """`LatentSpec.digest()` of a spec as recorded (`to_dict()`), "legacy" when none is."""
    if spec is None:
        return "legacy"
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _norm(path: Path | str) -> str:
    return os.path.normpath(os.path.abspath(path))


class PhaseLinks:
    """The latents links of every phase set under the data root, by their target: read once,
    when first asked (an encode run shares one, so a re-encoded source costs one scan)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._by_target: dict[str, list[Path]] | None = None
        self._by_shard: dict[tuple[str, str], set[str]] = {}  # (folder, shard) -> targets

    def by_target(self) -> dict[str, list[Path]]:
        if self._by_target is None:
            found: dict[str, list[Path]] = {}
            phases = self.root / "phases"
            for folder in sorted(phases.iterdir()) if phases.is_dir() else []:
                latents = folder / "latents"
                if not latents.is_dir():
                    continue
                for entry in os.scandir(latents):
                    if entry.is_symlink():
                        target = _norm(os.path.join(latents, os.readlink(entry.path)))
                        found.setdefault(target, []).append(Path(entry.path))
                        self._index(target)
            self._by_target = found
        return self._by_target

    def _index(self, target: str) -> None:
        folder, name = os.path.split(target)
        self._by_shard.setdefault((folder, name.split(".", 1)[0]), set()).add(target)

    def linked_in(self, folder: Path, shard: str) -> list[Path]:
        """The shard's files in `folder` that a phase set links (`NNNNN.npy`, `NNNNN.WxH.npy`)
        and that are there: from the index, no listing of the folder."""
        self.by_target()
        targets = self._by_shard.get((_norm(folder), shard), set())
        return [Path(t) for t in sorted(targets) if t.endswith(".npy") and os.path.exists(t)]

    def links_to(self, path: Path) -> list[Path]:
        return self.by_target().get(_norm(path), [])

    def moved(self, old: Path, new: Path) -> None:
        """Re-point the links to `old` at `new` (each link swapped in one rename)."""
        links = self.by_target().pop(_norm(old), [])
        folder, name = os.path.split(_norm(old))
        self._by_shard.get((folder, name.split(".", 1)[0]), set()).discard(_norm(old))
        for link in links:
            tmp = link.with_name(f".{link.name}.{os.getpid()}.relink")
            tmp.unlink(missing_ok=True)
            os.symlink(os.path.relpath(new, link.parent), tmp)
            os.replace(tmp, link)
        self.by_target().setdefault(_norm(new), []).extend(links)
        self._index(_norm(new))


def keep_linked(
    root: Path, source: str, shard: str, spec: dict | None, links: PhaseLinks
) -> list[Path]:
    """Move the shard's latents files that a phase set links, and its keys file, into the
    folder of the spec they were encoded under, re-pointing the links; returns where they went
    (nothing when no set links them)."""
    folder = root / source / latent_keys.STAGE
    linked = links.linked_in(folder, shard)  # one index lookup: no listing per shard
    if not linked:
        return []
    kept = folder / f"{KEPT}{spec_digest(spec)}"
    kept.mkdir(exist_ok=True)
    keys = latent_keys.path(root, source, shard)
    if keys.exists():
        os.replace(keys, kept / keys.name)
    out = []
    for f in linked:
        os.replace(f, kept / f.name)
        links.moved(f, kept / f.name)
        out.append(kept / f.name)
    log.warning(
        "encode %s/%s: %d latents file(s) of its old spec are linked by phase sets: kept in %s "
        "(sdpipe prune-latents removes them once no phase set links them)",
        source, shard, len(out), kept,
    )  # fmt: skip
    return out


def unreferenced(root: Path, sources: list[str] | None = None) -> list[Path]:
    """Kept files no phase set links: a kept shard's files go together (its keys file stays
    while any of its latents files is linked)."""
    linked = PhaseLinks(root).by_target()
    out: list[Path] = []
    for kept in sorted(Path(root).glob(f"*/{latent_keys.STAGE}/{KEPT}*")):
        if not kept.is_dir() or (sources and kept.parent.parent.name not in sources):
            continue
        files = sorted(kept.iterdir())
        live = {f.name.split(".")[0] for f in files if f.suffix == ".npy" and _norm(f) in linked}
        out += [f for f in files if f.name.split(".")[0] not in live]
    return out


def prune(root: Path, sources: list[str] | None = None, *, delete: bool = False) -> dict:
    """The kept files no phase set links ({"files": [(path, bytes)], "bytes", "deleted"});
    `delete`: remove them (and the spec folders left empty)."""
    files = [(f, f.stat().st_size) for f in unreferenced(root, sources)]
    if delete:
        for f, _ in files:
            f.unlink(missing_ok=True)
        for folder in {f.parent for f, _ in files}:
            if not any(folder.iterdir()):
                folder.rmdir()
    return {"files": files, "bytes": sum(n for _, n in files), "deleted": delete}
