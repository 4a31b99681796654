"""The curriculum flow's hold on the machine: two trainings never run on it at once."""

from __future__ import annotations

import threading
import time

import pytest
from prefect import flow

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
