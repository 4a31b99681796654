"""One training on 2 nodes of a local Ray cluster (tests/ray_cluster.py), 1 gloo rank each:
the steps of 2 ranks on one node through a cancel (both nodes checkpoint) and a resume; a lost
node fails the run naming it, and a rerun resumes."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest
import torch

from sdtrain.checkpoint import read_trainer_state
from sdtrain.monitor import read_log
from tasks.phases.train import TrainingFailed, without_node
from tasks.phases.train_nodes import launch_training_on_nodes

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STARTED = re.compile(r"^\[node (\d+) \S+\] torchrun \(pid (\d+)\) on .* Ray node (\w+)\)")


def per_step(run_dir) -> list[tuple]:
    records = [r for r in read_log(Path(run_dir) / "log.jsonl") if "loss" in r]
    return [(r["step"], r["loss"], r["grad_norm"], r["rows_crc"]) for r in records]


def assert_steps_of(run_dir, reference_dir) -> None:
    """Every step's loss and gradient norm within 1e-5 of the reference's, on the same rows."""
    steps, expected = per_step(run_dir), per_step(reference_dir)
    assert [s[0] for s in steps] == [1, 2, 3, 4, 5, 6]
    for (step, loss, norm, rows), (_, loss_1, norm_1, rows_1) in zip(steps, expected, strict=True):
        assert loss == pytest.approx(loss_1, abs=1e-5), step
        assert norm == pytest.approx(norm_1, rel=1e-5), step
        assert rows == rows_1, step


@pytest.fixture
def node_config(two_rank_run, make_config, tmp_path):
    """The 2-rank run's config (batch 4 a rank), with a run folder of its own."""
    reference, _, _ = two_rank_run
    return make_config(
        tmp_path / "run",
        batch_size=reference.batch_size,
        channels_last=reference.channels_last,
        gradient_checkpointing=reference.gradient_checkpointing,
        deterministic=reference.deterministic,
        sample_every=0,  # grids do not change the training
    )


class _Stop(Exception):
    """The caller's cancel."""


def test_two_nodes_take_the_steps_of_two_local_ranks_through_a_cancel_and_resume(
    two_rank_run, cluster, node_config
):
    """Cancelled at step 3 (every rank checkpoints), resumed on 2 nodes again: each of the 6
    steps as 1 node x 2 ranks took it uninterrupted. (One test, not two: each launch is ~15 s of
    start-up on a 2-core machine; the uninterrupted steps are steps 1-3 here.)"""
    reference, _, _ = two_rank_run
    run_dir = Path(node_config.run_dir)
    lines: list[str] = []

    def stop_at_step_3(line: str) -> None:
        lines.append(line)
        if without_node(line).startswith("step 3/6"):
            raise _Stop

    with pytest.raises(_Stop):
        launch_training_on_nodes(
            node_config, nodes=2, cluster=cluster.address, on_line=stop_at_step_3
        )
    assert len({m[3] for line in lines if (m := STARTED.match(line))}) == 2  # two Ray nodes
    stopped = int(os.readlink(run_dir / "checkpoints" / "latest")[5:])
    assert 3 <= stopped < 6 and not (run_dir / "final").exists()
    state = read_trainer_state(run_dir / "checkpoints" / "latest", torch.device("cpu"))
    assert len(state["rng"]) == 2  # both ranks' random state: the stop was a collective one

    lines.clear()
    summary = launch_training_on_nodes(
        node_config, nodes=2, cluster=cluster.address, on_line=lines.append
    )
    assert summary["world_size"] == 2 and summary["resumed_from_step"] == stopped
    assert summary["steps"] == 6
    assert sum(without_node(line).startswith("step 6/6") for line in lines) == 1  # rank 0's
    assert_steps_of(run_dir, reference.run_dir)


def test_a_lost_node_fails_the_run_naming_it_and_the_rerun_resumes(cluster, node_config):
    run_dir = Path(node_config.run_dir)
    torchruns: dict[int, tuple[int, str]] = {}  # node -> (torchrun pid, Ray node id)
    lost = []

    def lose_node_1_at_step_3(line: str) -> None:
        if m := STARTED.match(line):
            torchruns[int(m[1])] = (int(m[2]), m[3])
        if without_node(line).startswith("step 3/6") and not lost:
            pid, node_id = torchruns[1]
            # The machine goes: its processes (torchrun, its rank) and its Ray node.
            tree = psutil.Process(pid)
            for p in [tree, *tree.children(recursive=True)]:
                p.send_signal(signal.SIGKILL)
            cluster.kill(node_id)
            lost.append(node_id)

    with pytest.raises(TrainingFailed) as failed:
        launch_training_on_nodes(
            node_config, nodes=2, cluster=cluster.address, on_line=lose_node_1_at_step_3
        )
    message = str(failed.value)
    assert "lost 1 of 2 nodes: node 1 " in message and f"Ray node {lost[0]})" in message
    latest = os.readlink(run_dir / "checkpoints" / "latest")
    assert message.endswith(f"a rerun resumes from the last checkpoint ({latest})")

    # The rerun takes the 2 nodes left. Its steps are not compared: the last checkpoint may be
    # the one rank 0 saved alone as it failed, with rank 0's random state only.
    summary = launch_training_on_nodes(node_config, nodes=2, cluster=cluster.address)
    assert summary["resumed_from_step"] == int(latest[5:]) and summary["steps"] == 6
