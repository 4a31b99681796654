"""Eval reports a removal publishes again: an eval's summary names the training images nearest
to its generations (`memorisation.worst`: source, shard, key), and its grid artifact shows them
beside the generations. A pair whose training image was removed leaves the summary (temporary
name, rename); the metrics stay as measured, since they describe what the checkpoint trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from sdtrain.atomic import write_json_atomic
from tasks.evaluation.evaluate import SUMMARY


def _summaries(root: Path):
    for eval_folder in sorted(Path(root).glob("runs/*/eval")):
        yield from sorted(eval_folder.rglob(SUMMARY))


def _shown(summary: dict, source: str, gone: pa.Array) -> list[dict]:
    """The summary's pairs (a few) whose training image is one of the removed keys `gone`."""
    worst = [
        w for w in summary.get("memorisation", {}).get("worst", []) if w.get("source") == source
    ]
    hit = pc.is_in(pa.array([w.get("key") for w in worst], pa.string()), value_set=gone)
    return [w for w, h in zip(worst, pc.fill_null(hit, False).to_pylist(), strict=True) if h]


def showing(root: Path, source: str, gone: pa.Array) -> list[str]:
    """The eval summaries (relative to the root) whose nearest-image pairs show a removed row."""
    return [
        str(p.relative_to(root))
        for p in _summaries(root)
        if _shown(json.loads(p.read_text()), source, gone)
    ]


def rewrite_summary(path: Path, source: str, gone: pa.Array) -> int:
    """The summary without the pairs that show a removed row; how many left (0 the second time)."""
    summary = json.loads(path.read_text())
    shown = _shown(summary, source, gone)
    if shown:
        memo = summary["memorisation"]
        memo["worst"] = [w for w in memo["worst"] if w not in shown]
        memo["removed_pairs"] = memo.get("removed_pairs", 0) + len(shown)
        write_json_atomic(path, summary)
    return len(shown)
