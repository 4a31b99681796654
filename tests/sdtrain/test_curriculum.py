"""The curriculum flow's hold on the machine: two trainings never run on it at once."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from prefect import flow
from prefect.settings import get_current_settings

from flows.curriculum import training_slot, training_slot_name


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
def test_two_trainings_never_hold_the_machine_at_once(prefect_server):
    events: list[tuple[str, str]] = []

    @flow
    def hold(name: str) -> None:
        with training_slot():
            events.append((name, "start"))
            time.sleep(1.0)
            events.append((name, "end"))

    threads = [threading.Thread(target=hold, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = events[0][0], events[2][0]
    assert events == [(first, "start"), (first, "end"), (second, "start"), (second, "end")]

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # created on first use, with one slot
        assert client.read_global_concurrency_limit_by_name(training_slot_name()).limit == 1


@pytest.mark.slow
def test_a_phase_on_more_nodes_trains_through_the_ray_cluster(
    prefect_server, monkeypatch, tmp_path
):
    """The phase's `nodes`, else the flow's, picks the launch: on one node here (holding the
    GPU pool), on more (or with a cluster named) through Ray, its lines watched as a rank's."""
    from catalog import load_catalog
    from flows import curriculum
    from tasks.phases import train_nodes

    launches: list[tuple] = []
    summary = {"steps": 1}

    def on_nodes(config, *, nodes, cluster, on_line, env):
        on_line("[node 0 10.0.0.1] sample grid step 1: grid.png")  # redraws the pictures
        launches.append(("ray", nodes, cluster))
        # The ranks report to this flow's Prefect API, whether from the environment or a profile.
        assert env["PREFECT_API_URL"] == get_current_settings().api.url
        return summary

    def here(config, *, on_line):
        launches.append(("here",))
        return summary

    monkeypatch.setattr(train_nodes, "launch_training_on_nodes", on_nodes)
    monkeypatch.setattr(curriculum, "launch_training", here)
    refreshed = []
    monkeypatch.setattr(
        curriculum.train_pictures.LivePictures, "refresh", lambda self: refreshed.append(1)
    )
    demo = load_catalog().phase("demo")

    @flow
    def train(phase, nodes: int, cluster: str) -> dict:
        return curriculum.train_task(tmp_path, phase, "", "", nodes, cluster)

    assert train(demo, 0, "") == summary
    assert train(dataclasses.replace(demo, nodes=2), 0, "") == summary
    assert train(demo, 3, "head:6379") == summary
    assert train(dataclasses.replace(demo, nodes=2), 1, "head:6379") == summary
    assert launches == [("here",), ("ray", 2, ""), ("ray", 3, "head:6379"), ("ray", 1, "head:6379")]
    assert len(refreshed) == 4 + 3  # each at the end, and the node's grid line
