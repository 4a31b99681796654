"""The dashboard in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
logs in with the auth string, finds the build-latents/demo run, sees its progress and counts
artifacts, and saves screenshots in the test's output folder."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow


def test_dashboard_shows_the_demo_run(shared_stack, demo_run, out_dir, browser):
    out = out_dir
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    try:
        # The dashboard asks for the auth string first.
        page.goto(f"{shared_stack.ui_url}/runs", wait_until="networkidle")
        page.get_by_placeholder("admin:pass").fill(shared_stack.auth)
        page.get_by_role("button", name="Login").click()

        # The runs list names the run, its flow and its deployment.
        page.get_by_text(demo_run.name).first.wait_for()
        page.screenshot(path=out / "runs.png")

        # The run's page: completed, from build-latents/demo, with its task runs.
        page.get_by_text(demo_run.name).first.click()
        page.wait_for_url(f"**/runs/flow-run/{demo_run.id}**")
        page.get_by_text("Task runs").first.wait_for()
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
