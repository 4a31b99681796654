"""build-latents on a node of two devices (CPU twins `cpu:0`, `cpu:1` standing for two GPUs):
its score and encode shards run on both, and a shard is scored while later shards still
download."""

from __future__ import annotations

import os
import time

import pytest

from tasks.runtime.shards import read_stats, stats_path
from tasks.sources import fetch_images

pytestmark = pytest.mark.slow


def started_and_ended(root, stage: str) -> list[tuple[float, float]]:
    """(start, end) of each shard's work: its record is written when it ends."""
    spans = []
    for s in read_stats(root, "demo", stage):
        end = stats_path(root, "demo", stage, s.shard).stat().st_mtime
        spans.append((end - s.seconds, end))
    return spans


def test_score_and_encode_shards_run_on_two_devices(prefect_stack, tmp_path, monkeypatch):
    from prefect.logging.handlers import APILogWorker

    from flows.build_latents import build_latents
    from flows.execution import devices

    # A lane still claiming its device after STEAL_AFTER_S hands its shards to the other lane
    # (right on a node where a training holds a GPU). On a loaded 2-core machine the second
    # claim (a Prefect slot and a lock) can take longer than 5 s, and both stages would then
    # run on cpu:0: here nothing else holds a device, so a lane waits for its own.
    monkeypatch.setattr(devices, "STEAL_AFTER_S", 300.0)
    monkeypatch.setenv("SDPIPE_DEVICES", "cpu,cpu")
    monkeypatch.setenv("SDPIPE_DEVICE_LOCKS", str(tmp_path / "locks"))
    # A pool of its own: its Prefect limit is created with one slot per device (2).
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"twins-{os.getpid()}")
    monkeypatch.delenv("SDPIPE_GPU_SLOTS", raising=False)
    root = tmp_path / "data"
    # The last shard's download waits until a shard is scored (5 min at most): with stages
    # one after the other it would wait in vain and the overlap check below would fail.
    real_fetch = fetch_images.fetch_images_shard

    def fetch(root, source, shard, **options):
        if shard == "00002":
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(
                (root / source / "scores").glob("*.stats.json")
            ):
                time.sleep(0.2)
        return real_fetch(root, source, shard, **options)

    monkeypatch.setattr(fetch_images, "fetch_images_shard", fetch)
    # 3 workers: tokenize runs in processes (over 2), fetch 2 shards at once.
    state = build_latents(source="demo", data_root=str(root), workers=3, return_state=True)
    APILogWorker.drain_all()
    assert state.is_completed(), state.message

    scores, latents = read_stats(root, "demo", "scores"), read_stats(root, "demo", "latents")
    assert len(scores) == len(latents) == 3
    assert {s.extra["device"] for s in scores} == {"cpu:0", "cpu:1"}
    assert {s.extra["device"] for s in latents} == {"cpu:0", "cpu:1"}
    assert sum(s.num_out for s in latents) > 0
    # Overlap: a shard was scored before the last one was fetched.
    first_scored = min(end for _, end in started_and_ended(root, "scores"))
    last_fetched = max(end for _, end in started_and_ended(root, "shards"))
    assert first_scored < last_fetched
