"""The filter waterfall: counts that add up, written next to the outputs with a gallery of what
each rule threw away (a page and the dashboard's markdown, neither loading anything from the
network), and a clean zero-row report for an empty input."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from catalog import FilterProfile
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels, waterfall
from tasks.curation.waterfall import MAX_SAMPLES, Waterfall
from tasks.runtime import pictures
from tests.image_sources import html_sources, markdown_sources, not_embedded
from tests.tasks.metadata_rows import RECIPE, row, write_metadata

PROFILE = dataclasses.replace(RECIPE, dedup=("url",))


def test_counts_alone_and_in_sequence_add_up(tmp_path):
    rows = (
        [row(f"ok{i}") for i in range(3)]
        + [row(f"small{i}", width=100.0, aesthetic=1.0) for i in range(2)]  # fails two rules
        + [row(f"ugly{i}", aesthetic=2.0) for i in range(20)]
        + [row(f"dup{i}", url="http://x/ok0.jpg") for i in range(4)]
        + [row("dupugly", url="http://x/ok0.jpg", aesthetic=2.0)]
    )
    write_metadata(tmp_path, rows)
    stats = filter_stage.filter_metadata(tmp_path, "src", PROFILE, 100)
    wf = Waterfall.read(tmp_path / "src" / "filtered" / "waterfall.json")
    steps = {s.rule: s for s in wf.steps}
    assert [s.rule for s in wf.steps] == [
        "too_small", "aesthetic", "similarity", "pwatermark", "punsafe", "duplicate_key",
        "duplicate_url",
    ]  # fmt: skip
    assert (steps["too_small"].alone, steps["too_small"].removed) == (2, 2)
    assert (steps["aesthetic"].alone, steps["aesthetic"].removed) == (23, 21)
    # The copy of ok0's URL that fails aesthetic is not a duplicate: it was dropped already.
    assert (steps["duplicate_url"].alone, steps["duplicate_url"].removed) == (4, 4)
    assert wf.num_in == len(rows) == wf.num_out + sum(s.removed for s in wf.steps)
    assert [s.remaining for s in wf.steps][-1] == wf.num_out == stats.num_out == 3
    assert stats.dropped == {r: s.removed for r, s in steps.items() if s.removed}
    assert wf.table()[0] == {"rule": "input", "alone": 0, "in sequence": 0, "remaining": 30}


def test_gallery_shows_up_to_16_rejected_samples_per_reason(tmp_path):
    write_metadata(tmp_path, [row("ok")] + [row(f"ugly{i:02d}", aesthetic=2.0) for i in range(20)])
    filter_stage.filter_metadata(tmp_path, "src", PROFILE, 100)
    out = tmp_path / "src" / "filtered"
    samples = json.loads((out / "waterfall.json").read_text())["samples"]
    assert [s["key"] for s in samples["aesthetic"]] == [f"ugly{i:02d}" for i in range(MAX_SAMPLES)]
    page = (out / "gallery.html").read_text()
    assert page.count("class='card'") == MAX_SAMPLES
    assert "&lt;b&gt;caption&lt;/b&gt; ugly00" in page  # captions are escaped
    assert "aesthetic=2" in page
    # Never downloaded: the URL is shown as text with its host, and nothing is loaded from it.
    assert "<div class='url'>http://x/ugly00.jpg</div>" in page
    assert html_sources(page) == []
    dashboard = (out / "gallery.md").read_text()
    assert markdown_sources(dashboard) == []
    assert "**x** `http://x/ugly00.jpg`" in dashboard
    assert dashboard.count("| `ugly") == MAX_SAMPLES


def test_captions_and_urls_from_the_web_never_load_anything(tmp_path):
    # Rejected rows are exactly the ones a reviewer must not fetch (NSFW, blocklisted): their
    # captions may carry markup of their own.
    hostile = [
        "![pixel](http://tracker.example/a.png)",
        "<img src='http://tracker.example/b.png'>",
        "[![x](https://tracker.example/c.png)](http://y)",
        "a | b ` c <style>body{background:url(http://tracker.example/d.png)}</style>",
    ]
    rows = [row("ok")] + [
        row(f"bad{i}", caption=c, aesthetic=2.0, url=f"https://tracker.example/{i}.jpg")
        for i, c in enumerate(hostile)
    ]
    write_metadata(tmp_path, rows)
    filter_stage.filter_metadata(tmp_path, "src", PROFILE, 100)
    out = tmp_path / "src" / "filtered"
    assert not_embedded(html_sources((out / "gallery.html").read_text())) == []
    dashboard = (out / "gallery.md").read_text()
    assert not_embedded(markdown_sources(dashboard)) == []
    assert dashboard.count("**tracker.example**") == len(hostile)  # the host, as text


def test_pixel_gallery_embeds_thumbnails_of_the_fetched_images(fetched, scene, tmp_path):
    rows = [
        {"key": "big", "caption": "kept", "width": 600, "height": 600, "image": scene(0)},
        {"key": "tiny", "caption": "too small", "width": 90, "height": 90, "image": scene(1)},
    ]
    fetched(tmp_path, "src", rows)
    profile = FilterProfile(name="size", min_side=512, dedup=("sha256",))
    stats = filter_pixels.select_pixels(tmp_path, "src", profile)
    assert stats.dropped == {"too_small": 1}
    page = (tmp_path / "src" / "selected" / "gallery.html").read_text()
    assert page.count("data:image/jpeg;base64,") == 1
    # The dashboard's gallery embeds the same thumbnail: a JPEG of the rejected image, small.
    dashboard = (tmp_path / "src" / "selected" / "gallery.md").read_text()
    (uri,) = markdown_sources(dashboard)
    thumb = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert thumb.format == "JPEG" and thumb.size == (pictures.THUMB_SIDE,) * 2  # from 256 px
    assert "too\\_small: 1 of 1 removed" in dashboard
    # A gallery written before sdpipe wrote its markdown is rendered again from the shards.
    out = tmp_path / "src" / "selected"
    (out / "gallery.md").unlink()
    wf = Waterfall.read(out / "waterfall.json")
    assert waterfall.dashboard_markdown(wf, out / "gallery.html") == dashboard


def test_dashboard_gallery_stays_under_its_budget():
    # 30 rules x 16 rejects of noise (the worst case for JPEG) are ~1.7 MB of thumbnails: they
    # go in rule order while they fit, the rest are named as left out.
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8))
    rules = [f"rule{i:02d}" for i in range(30)]
    samples = {
        r: [{"key": f"{r}-{j}", "caption": "c", "tar": "x.tar"} for j in range(MAX_SAMPLES)]
        for r in rules
    }
    thumb = pictures.jpeg_uri(noise, side=pictures.THUMB_SIDE)
    thumbs = {s["key"]: thumb for rows in samples.values() for s in rows}
    assert sum(map(len, thumbs.values())) > 1.5 * waterfall.ARTIFACT_BUDGET
    wf = waterfall.build(
        stage="filter-pixels",
        profile="p",
        num_in=1000,
        counts=[(r, MAX_SAMPLES, MAX_SAMPLES) for r in rules],
        samples=samples,
    )
    text = waterfall.artifact_markdown(wf, thumbs, Path("/data/src/selected/gallery.html"))
    assert len(text.encode()) <= waterfall.ARTIFACT_BUDGET
    shown = markdown_sources(text)
    assert len(shown) > 15 * MAX_SAMPLES  # most of the budget is pictures
    assert text.count("left out (size limit)") == len(thumbs) - len(shown)
    in_rule_order = [s["key"] for r in rules for s in samples[r]]
    assert re.findall(r"!\[([^\]]*)\]\(data:", text) == in_rule_order[: len(shown)]


def test_empty_metadata_folder_gives_a_zero_row_report(tmp_path):
    (tmp_path / "src" / "metadata").mkdir(parents=True)
    stats = filter_stage.filter_metadata(tmp_path, "src", PROFILE, 100)
    assert (stats.num_in, stats.num_out, stats.dropped) == (0, 0, {})
    wf = Waterfall.read(tmp_path / "src" / "filtered" / "waterfall.json")
    assert wf.num_in == wf.num_out == 0 and all(s.removed == 0 for s in wf.steps)
    assert (tmp_path / "src" / "filtered" / "gallery.html").exists()


def test_no_fetched_shards_gives_a_zero_row_report(tmp_path):
    profile = FilterProfile(name="all-levels", dedup=("sha256", "phash", "semantic"))
    stats = filter_pixels.select_pixels(tmp_path, "src", profile, scored=True)
    assert (stats.num_in, stats.num_out, stats.dropped) == (0, 0, {})
    wf = Waterfall.read(tmp_path / "src" / "selected" / "waterfall.json")
    assert [s.rule for s in wf.steps][-2:] == ["duplicate_phash", "duplicate_semantic"]


RICH = FilterProfile(
    name="rich",
    min_aesthetic=6.5,
    min_similarity=0.28,
    min_side=512,
    min_caption_words=3,
    caption_blocklist=("bad",),
    url_blocklist=("blocked.com",),
    dedup=("url",),
)


def test_counts_and_samples_match_a_row_by_row_reference(tmp_path, monkeypatch):
    # Every rule kind, string and numeric rules interleaved, over three files; the gallery's
    # samples must be the first rows in file order whether or not the head scan holds them.
    rng = np.random.default_rng(0)
    rows = []
    for i in range(600):
        rows.append(
            row(
                f"k{i:04d}",
                url=rng.choice(["http://x/{i}.jpg", "http://cdn.blocked.com/{i}", "http://y/{i}"]),
                caption=rng.choice(["a fine caption", "bad caption here", "two words", None]),
                width=float(rng.choice([800, 100, np.nan])),
                aesthetic=float(rng.choice([7.0, 5.0, np.nan])),
                similarity=float(rng.choice([0.3, 0.1])),
            )
        )
        rows[-1]["url"] = rows[-1]["url"].format(i=i % 150)
    passes = {
        "url_blocklist": lambda r: "blocked.com" not in (r["url"] or ""),
        "too_small": lambda r: not r["width"] < 512,
        "short_caption": lambda r: len((r["caption"] or "").split()) >= 3,
        "caption_blocklist": lambda r: "bad" not in (r["caption"] or ""),
        "aesthetic": lambda r: r["aesthetic"] >= 6.5,
        "similarity": lambda r: r["similarity"] >= 0.28,
    }
    first = [next((n for n, p in passes.items() if not p(r)), None) for r in rows]
    write_metadata(tmp_path, rows[:250], rows[250:260], rows[260:], row_group_size=64)
    for head in (filter_stage.SAMPLE_HEAD, 40):
        monkeypatch.setattr(filter_stage, "SAMPLE_HEAD", head)
        shutil.rmtree(tmp_path / "src" / "filtered", ignore_errors=True)
        filter_stage.filter_metadata(tmp_path, "src", RICH, 100)
        wf = Waterfall.read(tmp_path / "src" / "filtered" / "waterfall.json")
        steps = {s.rule: s for s in wf.steps}
        for name, p in passes.items():
            assert steps[name].alone == sum(not p(r) for r in rows), name
            assert steps[name].removed == first.count(name), name
            expected = [r["key"] for r, f in zip(rows, first, strict=True) if f == name]
            assert [s["key"] for s in wf.samples.get(name, [])] == expected[:MAX_SAMPLES]
