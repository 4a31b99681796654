"""The dashboard in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
logs in with the auth string, finds the build-latents/demo run, sees its progress and counts
artifacts, sees the pictures of the galleries, the training and the eval render, and saves
screenshots in the test's output folder. Nothing sdpipe writes makes a browser load an image
from elsewhere."""

from __future__ import annotations

import re

import pytest

from tests.image_sources import html_sources, markdown_sources, not_embedded

pytestmark = pytest.mark.slow


def _login(page, stack) -> None:
    """The dashboard asks for the auth string first."""
    page.goto(f"{stack.ui_url}/runs", wait_until="networkidle")
    page.get_by_placeholder("admin:pass").fill(stack.auth)
    page.get_by_role("button", name="Login").click()


def test_dashboard_shows_the_demo_run(shared_stack, demo_run, out_dir, browser):
    out = out_dir
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    try:
        _login(page, shared_stack)

        # The runs list names the run, its flow and its deployment.
        page.get_by_text(demo_run.name).first.wait_for()
        page.screenshot(path=out / "runs.png")

        # The run's page: completed, from build-latents/demo, with its task runs.
        page.get_by_text(demo_run.name).first.click()
        page.wait_for_url(f"**/runs/flow-run/{demo_run.id}**")
        # The run's header once its data came (the "Task Runs" tab is there before: a body
        # read then lacked the run's details under load).
        page.get_by_text(re.compile(r"\b\d{2,} Task runs")).first.wait_for()
        page.get_by_role("link", name="build-latents").first.wait_for()
        body = page.inner_text("body")
        assert "build-latents" in body and "Completed" in body and "sdpipe" in body
        assert re.search(r"\b\d{2,} Task runs", body), body[:1500]
        page.screenshot(path=out / "flow-run.png", full_page=True)

        def artifact(key: str) -> str:
            page.goto(f"{shared_stack.ui_url}/runs/flow-run/{demo_run.id}")
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text(key, exact=True).first.click()
            page.get_by_text("Show raw data").first.wait_for()
            return page.inner_text("body")

        # Its artifacts: a progress artifact and a counts table per stage.
        page.goto(f"{shared_stack.ui_url}/runs/flow-run/{demo_run.id}")
        page.get_by_text("Artifacts", exact=True).first.click()
        page.get_by_text("demo-encode-progress", exact=True).first.wait_for()
        body = page.inner_text("body")
        for key in ("demo-fetch-images-progress", "demo-encode-counts", "demo-build-summary"):
            assert key in body, key
        page.screenshot(path=out / "artifacts.png", full_page=True)

        assert "Progress: 100%" in artifact("demo-encode-progress")
        page.screenshot(path=out / "encode-progress.png", full_page=True)
        counts = artifact("demo-encode-counts")
        assert "total" in counts and "00000" in counts
        page.screenshot(path=out / "encode-counts.png", full_page=True)
    except Exception:
        page.screenshot(path=out / "failure.png", full_page=True)
        raise
    finally:
        page.close()
    assert (out / "artifacts.png").stat().st_size > 10_000
    print(f"screenshots: {out}")


def _open_artifact(page, stack, flow_run_id, key: str) -> str:
    page.goto(f"{stack.ui_url}/runs/flow-run/{flow_run_id}")
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text(key, exact=True).first.click()
    page.get_by_text("Show raw data").first.wait_for()
    return page.inner_text("body")


def _images(page, *, at_least: int = 0) -> list[dict]:
    """Every image of the page once `at_least` embedded ones are there and all are loaded: its
    source and natural width (0: not rendered)."""
    page.wait_for_function(
        "n => Array.from(document.images).filter(i => i.src.startsWith('data:')).length >= n",
        arg=at_least,
    )
    page.wait_for_function("Array.from(document.images).every(i => i.complete)")
    return page.eval_on_selector_all(
        "img", "els => els.map(e => ({src: e.currentSrc || e.src, width: e.naturalWidth}))"
    )


def test_galleries_and_training_pictures_render(
    shared_stack, demo_run, demo_training, out_dir, browser
):
    assert demo_training.state.is_completed(), demo_training.state.message
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    ui = shared_stack.ui_url

    def pictures(flow_run, key: str, *, text: str, at_least: int) -> str:
        _open_artifact(page, shared_stack, flow_run.id, key)
        page.get_by_text(text).first.wait_for()
        images = _images(page, at_least=at_least)
        page.screenshot(path=out_dir / f"{key}.png", full_page=True)
        embedded = [i for i in images if i["src"].startswith("data:")]
        assert len(embedded) >= at_least, (key, images)
        assert all(i["width"] > 0 for i in embedded), key  # each one decoded and drawn
        # The UI's own files come from its server; nothing from anywhere else.
        assert [i["src"] for i in images if not i["src"].startswith(("data:", ui + "/"))] == []
        return page.inner_text("body")

    try:
        _login(page, shared_stack)
        page.get_by_text(demo_run.name).first.wait_for()
        # The waterfall: rows removed per rule, as a table.
        body = _open_artifact(page, shared_stack, demo_run.id, "demo-filter-pixels-waterfall")
        assert "duplicate_sha256" in body and "remaining" in body
        page.screenshot(path=out_dir / "demo-filter-pixels-waterfall.png", full_page=True)
        # The pixel filter's rejects: their thumbnails, inside the dashboard.
        pictures(
            demo_run,
            "demo-filter-pixels-gallery",
            text="duplicate_sha256: 4 of 4 removed",
            at_least=4,
        )
        # The metadata filter's rejects were never downloaded: their hosts and URLs as text.
        body = pictures(
            demo_run, "demo-filter-gallery", text="not downloaded: where from", at_least=0
        )
        assert "http://127.0.0.1:" in body
        # The training: curves and the latest grid while it runs, the final grid at the end.
        pictures(
            demo_training,
            "demo-train-pictures",
            text="Sample grid, final (EMA weights)",
            at_least=2,
        )
        pictures(demo_training, "demo-train-summary", text="samples in the mix", at_least=2)
        # The demo trains on aspect buckets: the summary says the rows of each, and at this
        # fixture's 60 samples the two narrow buckets are under one global batch (small_bucket).
        # (The dashboard's markdown prints 64x64 as 64×64.)
        page.get_by_text("aspect buckets (training rows):").first.wait_for()
        page.get_by_text("rows left out as small_bucket").first.wait_for()
        # The eval after training: one image per prompt per category, and the generations
        # nearest a training image beside it, each decoded and drawn.
        body = pictures(
            demo_training, "demo-eval-grid", text="Nearest training images", at_least=9 + 1
        )
        assert "cyberpunk-city" in body and "full-body" in body
        body = _open_artifact(page, shared_stack, demo_training.id, "demo-eval-table")
        assert "clip_score" in body and "memorised" in body and "forest" in body
        page.screenshot(path=out_dir / "demo-eval-table.png", full_page=True)
    except Exception:
        page.screenshot(path=out_dir / "failure.png", full_page=True)
        raise
    finally:
        page.close()
    print(f"screenshots: {out_dir}")


def test_no_page_or_artifact_of_the_demo_loads_a_remote_image(
    shared_stack, demo_run, demo_training
):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    pages = [
        p for p in shared_stack.root.rglob("*") if p.suffix in (".html", ".md") and p.is_file()
    ]
    assert {p.name for p in pages} >= {"gallery.html", "gallery.md"}
    embedded = 0
    for p in pages:
        text = p.read_text()
        sources = html_sources(text) if p.suffix == ".html" else markdown_sources(text)
        assert not_embedded(sources) == [], p
        embedded += len(sources)
    with shared_stack.client() as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[demo_run.id, demo_training.id])
            )
        )
    markdown = {a.key: a.data for a in artifacts if a.type == "markdown"}
    assert {"demo-filter-gallery", "demo-train-pictures", "demo-train-summary"} <= set(markdown)
    assert "demo-eval-grid" in markdown
    for key, text in markdown.items():
        sources = markdown_sources(text)
        assert not_embedded(sources) == [], key
        assert len(text.encode()) < 1_000_000, key  # the artifact budget
        embedded += len(sources)
    assert embedded >= 8  # thumbnails, curves and grids: the check saw pictures


def test_the_curriculum_demo_ends_with_an_eval_table(shared_stack, demo_training):
    """After training, the demo phase is evaluated: a table of its nine categories (and all)
    with CLIP score, aesthetic and memorisation, and FID and losses by band over the set."""
    import json

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    assert demo_training.state.is_completed(), demo_training.state.message
    with shared_stack.client() as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[demo_training.id])
            )
        )
    (table,) = [a for a in artifacts if a.key == "demo-eval-table"]
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [r["category"] for r in rows] == [
        "forest", "landscape", "cyberpunk-city", "vehicles", "portrait", "architecture",
        "full-body", "animals", "food", "all",
    ]  # fmt: skip
    assert rows[-1]["fid"] not in ("", "n/a") and rows[-1]["val_loss_mid"] not in ("", "n/a")
    summary = json.loads(
        (shared_stack.root / "runs" / "demo" / "eval" / "summary.json").read_text()
    )
    assert summary["num_images"] == 9 and summary["metrics"]["all"]["clip_score"] >= 0
