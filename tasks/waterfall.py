"""The filter waterfall: per rule, the rows it removes alone and in sequence; JSON + HTML gallery.

`removed` counts each row under the first rule it fails, so the steps add up: num_in minus the
sum of `removed` is num_out. `alone` is what the rule would remove by itself; for a dedup level
that is among the rows passing every rule, the only rows duplicates are ever judged among.
"""

from __future__ import annotations

import base64
import html
import io
import json
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image

from tasks.shards import atomic_path

MAX_SAMPLES = 16  # rejected samples shown per reason
THUMB_SIDE = 160
SHOWN_COLUMNS = ("aesthetic", "similarity", "pwatermark", "punsafe", "width", "height")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


@dataclass(kw_only=True, slots=True)
class Step:
    rule: str
    alone: int
    removed: int
    remaining: int


@dataclass(kw_only=True, slots=True)
class Waterfall:
    stage: str  # filter, filter-pixels, view <dataset>
    profile: str
    num_in: int
    num_out: int
    steps: list[Step]
    # Up to MAX_SAMPLES rejected rows per reason: key, caption, url, scores, `tar` if fetched.
    samples: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def dropped(self) -> dict[str, int]:
        return {s.rule: s.removed for s in self.steps if s.removed}

    def table(self) -> list[dict]:
        """Rows of the dashboard table: one per rule, then the total."""
        rows = [{"rule": "input", "alone": 0, "in sequence": 0, "remaining": self.num_in}]
        rows += [
            {"rule": s.rule, "alone": s.alone, "in sequence": s.removed, "remaining": s.remaining}
            for s in self.steps
        ]
        return rows

    def write(self, json_path: Path, gallery_path: Path) -> None:
        """The JSON record and the HTML gallery of rejected samples, each written atomically."""
        with atomic_path(json_path) as tmp:
            tmp.write_text(json.dumps(asdict(self), indent=1, default=str))
        with atomic_path(gallery_path) as tmp:
            tmp.write_text(gallery_html(self))

    @classmethod
    def read(cls, path: Path) -> Waterfall:
        raw = json.loads(path.read_text())
        raw["steps"] = [Step(**s) for s in raw["steps"]]
        return cls(**raw)


def build(
    *,
    stage: str,
    profile: str,
    num_in: int,
    counts: list[tuple[str, int, int]],
    samples: dict[str, list[dict]],
) -> Waterfall:
    """A waterfall from (rule, alone, removed) in rule order."""
    steps, remaining = [], num_in
    for rule, alone, removed in counts:
        remaining -= removed
        steps.append(Step(rule=rule, alone=alone, removed=removed, remaining=remaining))
    return Waterfall(
        stage=stage,
        profile=profile,
        num_in=num_in,
        num_out=remaining,
        steps=steps,
        samples={r: rows for r, rows in samples.items() if rows},
    )


def thumbnails(samples: dict[str, list[dict]]) -> dict[str, str]:
    """key -> data URI of a JPEG thumbnail, for samples whose images sit in a shard tar."""
    wanted: dict[str, set[str]] = {}
    for rows in samples.values():
        for row in rows:
            if row.get("tar"):
                wanted.setdefault(row["tar"], set()).add(row["key"])
    out = {}
    for tar_path, keys in wanted.items():
        if not Path(tar_path).is_file():
            continue
        with tarfile.open(tar_path) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if key not in keys or ext.lower() not in IMAGE_EXTENSIONS or not member.isfile():
                    continue
                try:
                    img = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                except Exception:  # an image the gallery cannot show is shown as missing
                    continue
                img.thumbnail((THUMB_SIDE, THUMB_SIDE))
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=80)
                out[key] = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return out


def gallery_html(wf: Waterfall) -> str:
    """One self-contained page: the waterfall table, then up to 16 rejected samples per reason.

    Fetched images are embedded as thumbnails; rows judged before download show their URL.
    """
    thumbs = thumbnails(wf.samples)
    esc = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{esc(wf.stage)}: {esc(wf.profile)}</title>",
        "<style>body{font:14px sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        ".grid{display:flex;flex-wrap:wrap;gap:10px}.card{width:180px;font-size:12px}"
        ".card img{width:160px;height:160px;object-fit:contain;background:#eee}"
        ".cap{overflow-wrap:anywhere}</style>",
        f"<h1>{esc(wf.stage)} &mdash; profile {esc(wf.profile)}</h1>",
        f"<p>{wf.num_in} in, {wf.num_out} kept.</p>",
        "<table><tr><th>rule</th><th>removed alone</th><th>removed in sequence</th>"
        "<th>remaining</th></tr>",
    ]
    for s in wf.steps:
        parts.append(
            f"<tr><td style='text-align:left'><a href='#{esc(s.rule)}'>{esc(s.rule)}</a></td>"
            f"<td>{s.alone}</td><td>{s.removed}</td><td>{s.remaining}</td></tr>"
        )
    parts.append("</table>")
    for s in wf.steps:
        rows = wf.samples.get(s.rule, [])
        if not rows:
            continue
        parts.append(
            f"<h2 id='{esc(s.rule)}'>{esc(s.rule)}: {len(rows)} of {s.removed} removed</h2>"
            "<div class='grid'>"
        )
        for row in rows:
            src = thumbs.get(row["key"]) or row.get("url") or ""
            scores = " ".join(
                f"{c}={_fmt(row[c])}" for c in SHOWN_COLUMNS if row.get(c) is not None
            )
            parts.append(
                f"<div class='card'><img loading='lazy' src='{esc(src)}' alt=''>"
                f"<div><b>{esc(str(row['key']))}</b></div>"
                f"<div class='cap'>{esc(str(row.get('caption') or ''))}</div>"
                f"<div>{esc(scores)}</div></div>"
            )
        parts.append("</div>")
    return "\n".join(parts)


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
