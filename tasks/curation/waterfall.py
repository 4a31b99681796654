"""The filter waterfall: per rule, the rows it removes alone and in sequence; JSON, an HTML
gallery page and the dashboard's markdown gallery, both with their thumbnails embedded.

`removed` counts each row under the first rule it fails, so the steps add up: num_in minus the
sum of `removed` is num_out. `alone` is what the rule would remove by itself; for a dedup level
that is among the rows passing every rule, the only rows duplicates are ever judged among. A row
rejected before download is shown by its URL as text: no page makes a browser fetch it.
"""

from __future__ import annotations

import html
import io
import json
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image

from sdtrain.atomic import atomic_path
from tasks.runtime import pictures

MAX_SAMPLES = 16  # rejected samples shown per reason
# The dashboard artifact's size: Prefect stores it in its database and the UI loads it whole.
# A 112 px thumbnail is 2-4 KB as base64 (noise, the worst case, 3.6 KB): 16 samples of 16
# rules fit; past the budget the rows stay and their thumbnails are left out.
ARTIFACT_BUDGET = 1_000_000
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
    # What a step measured besides its counts (`semantic_visits`, `semantic_missed_estimate`, ...).
    notes: dict = field(default_factory=dict)

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
        """The JSON record, the HTML gallery page and its dashboard markdown (`artifact_path`),
        each written atomically; the thumbnails are read from the shards once for both."""
        thumbs = thumbnails(self.samples)
        with atomic_path(json_path) as tmp:
            tmp.write_text(json.dumps(asdict(self), indent=1, default=str))
        with atomic_path(gallery_path) as tmp:
            tmp.write_text(gallery_html(self, thumbs))
        with atomic_path(artifact_path(gallery_path)) as tmp:
            tmp.write_text(artifact_markdown(self, thumbs, gallery_path))

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
    notes: dict | None = None,
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
        notes=dict(notes or {}),
    )


def notes_text(wf: Waterfall) -> str:
    """The notes in words (plain text), or ""."""
    notes = wf.notes
    if "semantic_beyond_visits" not in notes:
        return ""
    text = (
        f"Semantic dedup: {notes['semantic_beyond_visits']} rows had a cluster within reach that "
        f"they do not visit (semantic_visits: {notes.get('semantic_visits')}), so could miss a "
        "duplicate there."
    )
    if "semantic_sampled" in notes:  # records from before the sample have the bound alone
        text += (
            f" Of {notes['semantic_sampled']} of them searched, {notes['semantic_missed_sample']} "
            f"had a duplicate never compared with them: ~{notes['semantic_missed_estimate']} rows "
            "in all. Raising semantic_visits finds them (more work)."
        )
    return text


def artifact_path(gallery_path: Path) -> Path:
    """The dashboard's markdown of a gallery, written beside it (`gallery.md`)."""
    return gallery_path.with_suffix(".md")


def dashboard_markdown(wf: Waterfall, gallery_path: Path) -> str:
    """The markdown the stage wrote beside its gallery; rendered again (reading the shards) for
    a gallery written before sdpipe wrote one."""
    page = artifact_path(gallery_path)
    if page.exists():
        return page.read_text()
    return artifact_markdown(wf, thumbnails(wf.samples), gallery_path)


def thumbnails(samples: dict[str, list[dict]]) -> dict[str, str]:
    """key -> JPEG data URI, for samples whose images sit in a shard tar (read once per tar)."""
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
                    img = Image.open(io.BytesIO(tar.extractfile(member).read()))
                    out[key] = pictures.jpeg_uri(img, side=pictures.THUMB_SIDE)
                except Exception:  # an image the gallery cannot show is shown as missing
                    continue
    return out


def _scores(row: dict) -> str:
    return " ".join(f"{c}={_fmt(row[c])}" for c in SHOWN_COLUMNS if row.get(c) is not None)


def gallery_html(wf: Waterfall, thumbs: dict[str, str]) -> str:
    """One self-contained page: the waterfall table, then up to 16 rejected samples per reason.

    Fetched images are embedded thumbnails; rows judged before download show their URL as
    text, never as an image source.
    """
    esc = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{esc(wf.stage)}: {esc(wf.profile)}</title>",
        "<style>body{font:14px sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        ".grid{display:flex;flex-wrap:wrap;gap:10px}.card{width:180px;font-size:12px}"
        ".pic{width:160px;height:160px;display:flex;align-items:center;justify-content:center;"
        "background:#eee;color:#666;text-align:center;overflow-wrap:anywhere}"
        ".pic img{max-width:160px;max-height:160px}"
        ".cap,.url{overflow-wrap:anywhere}.url{font-family:monospace;color:#555}</style>",
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
    if notes_text(wf):
        parts.append(f"<p>{esc(notes_text(wf))}</p>")
    for s in wf.steps:
        rows = wf.samples.get(s.rule, [])
        if not rows:
            continue
        parts.append(
            f"<h2 id='{esc(s.rule)}'>{esc(s.rule)}: {len(rows)} of {s.removed} removed</h2>"
            "<div class='grid'>"
        )
        for row in rows:
            url = str(row.get("url") or "")
            if thumb := thumbs.get(row["key"]):
                pic = f"<img src='{esc(thumb)}' alt=''>"
            elif row.get("tar"):
                pic = "no thumbnail (image unreadable)"
            else:
                pic = f"not downloaded<br><b>{esc(pictures.url_domain(url))}</b>"
            parts.append(
                f"<div class='card'><div class='pic'>{pic}</div>"
                f"<div><b>{esc(str(row['key']))}</b></div>"
                f"<div class='cap'>{esc(str(row.get('caption') or ''))}</div>"
                f"<div>{esc(_scores(row))}</div>"
                + ("" if row.get("tar") or not url else f"<div class='url'>{esc(url)}</div>")
                + "</div>"
            )
        parts.append("</div>")
    return "\n".join(parts)


def artifact_markdown(wf: Waterfall, thumbs: dict[str, str], gallery_path: Path) -> str:
    """The dashboard's gallery: per rule, up to 16 rejected samples as table rows (thumbnail or,
    before download, the URL as text; key, caption, scores), at most ARTIFACT_BUDGET characters.

    Thumbnails go in rule order while they fit the budget; the rest are named as left out (the
    gallery page on disk has them all).
    """

    def render(images: dict[str, str]) -> str:
        shown = sum(len(v) for v in wf.samples.values())
        lines = [
            f"# {md(wf.stage)}: what the rules of profile {md(wf.profile)} threw away",
            f"{wf.num_in} in, {wf.num_out} kept; {shown} rejected samples below (up to "
            f"{MAX_SAMPLES} per rule). The same gallery as a self-contained page, to share: "
            f"{pictures.md_code(gallery_path, limit=400)}",
        ]
        if notes_text(wf):
            lines += ["", md(notes_text(wf))]
        for s in wf.steps:
            rows = wf.samples.get(s.rule, [])
            if not rows:
                continue
            fetched = any(row.get("tar") for row in rows)  # pixel stages; metadata: none
            # Before download the URL goes last: long, and the least telling of the four.
            header = "image | sample | caption | scores"
            if not fetched:
                header = "sample | caption | scores | not downloaded: where from"
            lines += ["", f"## {md(s.rule)}: {len(rows)} of {s.removed} removed", ""]
            lines += [f"| {header} |", "|---|---|---|---|"]
            for row in rows:
                key, url = str(row["key"]), str(row.get("url") or "")
                caption = md(row.get("caption") or "")
                text = f"{pictures.md_code(key)} | {caption} | {md(_scores(row))}"
                if not fetched:
                    where = f"**{md(pictures.url_domain(url))}** {pictures.md_code(url)}"
                    lines.append(f"| {text} | {where} |")
                elif key in images:
                    lines.append(f"| ![{md(key)}]({images[key]}) | {text} |")
                else:
                    why = "left out (size limit): in the page" if key in thumbs else "unreadable"
                    lines.append(f"| {why} | {text} |")
        return "\n".join(lines) + "\n"

    allowance = ARTIFACT_BUDGET - len(render({}))
    images: dict[str, str] = {}
    for s in wf.steps:
        for row in wf.samples.get(s.rule, []):
            uri = thumbs.get(row["key"])
            if uri is not None and len(uri) + 8 <= allowance:
                images[row["key"]] = uri
                allowance -= len(uri) + 8  # `![key](...)`: the key is counted in the text
    return render(images)


def md(text: object) -> str:
    return pictures.md_text(text)


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
