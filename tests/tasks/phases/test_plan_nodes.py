"""`sdpipe plan` for a training on several nodes: it counts the ranks the training starts, nodes x
ranks per node (the phase's `nodes`, or `--nodes`; per node the cluster's GPUs, or this
machine's), so its steps, buckets and ETA are the trainer's at that world size."""

from __future__ import annotations

import json

import numpy as np
import pytest
from torch.utils.data import DataLoader

from catalog import MixEntry
from flows.cli import commands as cli
from sdtrain.data import BucketBatchSampler, EpochSampler
from sdtrain.schedules import total_optimizer_steps
from tasks.phases import plan
from tests.tasks.phases.test_mix import catalog, encoded_source, phase
from tests.tasks.phases.test_mix_buckets import bucketed_source, every_key, plant_views

# 16x32's 9 rows fill a global batch of 2 x 2 ranks, not one of 2 x 6.
BUCKETS = ["16x16"] * 40 + ["16x24"] * 23 + ["24x16"] * 13 + ["16x32"] * 9


@pytest.fixture
def bucketed(tmp_path, monkeypatch):
    """A data root with one source in four buckets, and a phase of all its rows."""
    keys = bucketed_source(tmp_path, "a", {"00000": BUCKETS[:50], "00001": BUCKETS[50:]})
    plant_views(monkeypatch, {"a": every_key(keys)})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def trainer_batches_per_rank(report: dict, batch_size: int, seed: int) -> int:
    """The batches per rank per epoch that sdtrain's bucketed sampler gives these bucket rows."""
    counts = [b["rows"] for b in report["buckets"]]
    codes = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    rows = np.arange(len(codes), dtype=np.int32)
    sampler = BucketBatchSampler(
        rows, codes, [b["bucket"] for b in report["buckets"]], batch_size=batch_size,
        seed=seed, world_size=report["world_size"],
    )  # fmt: skip
    return len(sampler)


def test_three_nodes_plan_three_times_the_ranks_as_the_trainer_counts_them(bucketed):
    settings = dict(num_val_samples=0, epochs=3, batch_size=2)
    p = phase(MixEntry(dataset="a", count=85), **settings)
    on_three = phase(MixEntry(dataset="a", count=85), **settings, nodes=3)
    one = plan.plan_phase(bucketed, catalog(bucketed, p1=p), p, ranks_per_node=2)
    three = plan.plan_phase(bucketed, catalog(bucketed, p1=on_three), on_three, ranks_per_node=2)
    assert (one["world_size"], three["world_size"]) == (2, 6)
    assert (three["nodes"], three["ranks_per_node"], three["through_ray"]) == (3, 2, True)
    assert three["global_batch"] == 3 * one["global_batch"] == 2 * 6
    for report in (one, three):
        batches = trainer_batches_per_rank(report, 2, p.seed)
        assert report["batches_per_rank"] == batches
        assert report["steps"] == total_optimizer_steps(
            batches, epochs=3, grad_accum=1, max_steps=None
        )
    assert three["steps"] < one["steps"]
    # A bucket that fills a global batch of 2 ranks is left out of one of 6.
    assert one["left_out"]["small_bucket"]["buckets"] == []
    assert three["left_out"]["small_bucket"]["buckets"] == ["16x32"]
    # 3 nodes x 2 ranks train as 1 node x 6 ranks would: the same counts.
    six = plan.plan_phase(bucketed, catalog(bucketed, p1=p), p, ranks_per_node=6)
    same = ("steps", "global_batch", "batches_per_rank", "buckets", "left_out", "world_size")
    assert {k: six[k] for k in same} == {k: three[k] for k in same}


def test_the_flows_nodes_override_the_phases_and_the_plain_sampler_counts_them(
    tmp_path, monkeypatch
):
    keys = encoded_source(tmp_path, "b", {"00000": 60, "00001": 45})  # one square bucket
    plant_views(monkeypatch, {"b": every_key(keys)})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    p = phase(MixEntry(dataset="b", count=100), nodes=2)  # 100 - 10 held out = 90 rows
    cat = catalog(tmp_path, p1=p)
    for nodes, world_size in ((0, 2 * 3), (1, 3), (5, 5 * 3)):
        report = plan.plan_phase(tmp_path, cat, p, nodes=nodes, ranks_per_node=3)
        assert report["world_size"] == world_size and not report["bucketed_sampler"]
        sampler = EpochSampler(90, seed=p.seed, rank=0, world_size=world_size)
        loader = DataLoader(range(90), batch_size=4, sampler=sampler, drop_last=True)
        assert report["batches_per_rank"] == len(loader)
        assert report["steps"] == total_optimizer_steps(
            len(loader), epochs=2, grad_accum=1, max_steps=None
        )


def test_per_node_ranks_are_this_machines_unless_the_cluster_says(monkeypatch):
    """Without a cluster: every node assumed like this one (train_nodes' rule: its GPUs, or one
    CPU rank); with one, the GPUs each of the N nodes has; one node here: launch_training's."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    p = phase(MixEntry(dataset="a", count=1), nodes=4)
    monkeypatch.setattr(plan, "_local_gpus", lambda: 8)
    ranks = plan.training_ranks(p)
    assert (ranks.nodes, ranks.per_node, ranks.world_size, ranks.through_ray) == (4, 8, 32, True)
    assert ranks.basis.startswith("assumed like this machine: 8 GPUs; name the Ray cluster")
    assert plan.training_ranks(p, nodes=1).world_size == 8  # the flow's nodes override
    monkeypatch.setattr(plan, "_local_gpus", lambda: 0)
    assert plan.training_ranks(p).per_node == 1  # train_nodes: 1 CPU rank a node
    assert plan.training_ranks(p, nodes=1).per_node == 2  # launch_training: 2 CPU ranks

    import contextlib

    import ray

    from tasks.phases import train_nodes

    alive = [8, 8, 4, 8, 8]
    nodes = [{"Alive": True, "Resources": {"GPU": float(g), "CPU": 16.0}} for g in alive]
    nodes.append({"Alive": False, "Resources": {"GPU": 16.0}})
    monkeypatch.setattr(train_nodes, "connected", lambda cluster, nodes: contextlib.nullcontext())
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    ranks = plan.training_ranks(p, cluster="head:6379")
    assert (ranks.per_node, ranks.world_size) == (8, 32)
    assert ranks.basis == "counted on the Ray cluster at head:6379: 8 GPUs on each of 4 nodes"
    assert plan.training_ranks(p, nodes=5, cluster="head:6379").per_node == 4
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # as train_nodes, RAY_ADDRESS is the cluster
    assert plan.training_ranks(p, nodes=5).per_node == 4
    fewer = plan.training_ranks(p, nodes=6)
    assert fewer.per_node == 1 and "has 5 live nodes, not 6" in fewer.basis
    nodes[0]["Resources"]["GPU"] = 0.0  # a CPU head among 4 GPU nodes: 5 GPU nodes asked
    short = plan.training_ranks(p, nodes=5)
    assert "has 4 nodes with GPUs, not 5" in short.basis and short.per_node == 1


def test_a_cluster_that_does_not_answer_leaves_the_assumption_said(monkeypatch):
    from tasks.runtime.net import free_port

    monkeypatch.setattr(plan, "_local_gpus", lambda: 4)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    ranks = plan.training_ranks(phase(MixEntry(dataset="a", count=1)), nodes=2, cluster=address)
    assert (ranks.nodes, ranks.per_node) == (2, 4)
    assert ranks.basis.startswith("assumed like this machine: 4 GPUs; the cluster did not")
    assert f"no Ray cluster answers at {address!r}" in ranks.basis


def test_sdpipe_plan_plans_for_the_catalogs_nodes_or_nodes_given(bucketed, monkeypatch, capsys):
    p = phase(MixEntry(dataset="a", count=85), num_val_samples=0, epochs=1, batch_size=2, nodes=3)
    monkeypatch.setattr(cli, "load_catalog", lambda: catalog(bucketed, p1=p))

    def sdpipe_plan(*args: str) -> str:
        assert cli.main(["--data-root", str(bucketed), "plan", "p1", *args]) == 0
        return capsys.readouterr().out

    text = sdpipe_plan("--ranks", "2")  # the phase's 3 nodes
    assert "global batch 12 on 6 ranks" in text
    assert "ranks: 3 nodes x 2 per node through the Ray cluster; per node given" in text
    assert "global batches of 12 = 2 x 6 ranks" in text
    report = json.loads(sdpipe_plan("--ranks", "2", "--nodes", "4", "--json"))
    assert (report["nodes"], report["ranks_per_node"], report["world_size"]) == (4, 2, 8)
    assert report["batches_per_rank"] == trainer_batches_per_rank(report, 2, p.seed)
    one = sdpipe_plan("--ranks", "2", "--nodes", "1")  # one node here: the plan as it was
    assert "global batch 4 on 2 ranks" in one and "ranks:" not in one
    monkeypatch.setattr(plan, "_local_gpus", lambda: 0)
    report = json.loads(sdpipe_plan("--json"))
    assert (report["nodes"], report["ranks_per_node"]) == (3, 1)  # 1 CPU rank on each node
    assert report["ranks_basis"].startswith("assumed like this machine: no GPU, 1 CPU rank")


def test_the_eta_on_nodes_scales_the_measured_rate_to_the_planned_ranks(bucketed):
    """The measured run's samples/s were of its ranks: on 4x the ranks, a quarter of the time
    (linear scaling assumed, as docs/scale-out.md does), on one node as on several; on the
    measured run's ranks, the rate as measured."""
    p = phase(MixEntry(dataset="a", count=85), num_val_samples=0, epochs=2, batch_size=2)
    run = bucketed / "runs" / "p0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "m"}))
    (run / "summary.json").write_text(json.dumps({"samples_per_s": 10.0, "world_size": 2}))
    cat = catalog(bucketed, p1=p)
    here = plan.plan_phase(bucketed, cat, p, ranks_per_node=2)
    assert here["eta_s"] == round(here["steps"] * here["global_batch"] / 10.0)
    assert "at 10.0 samples/s (measured by p0)" in plan.format_plan(here)
    wider = plan.plan_phase(bucketed, cat, p, ranks_per_node=4)  # a what-if on this node
    assert wider["eta_s"] == round(wider["steps"] * wider["global_batch"] / 20.0)
    assert "scaled linearly to 4)" in plan.format_plan(wider)
    nodes = plan.plan_phase(bucketed, cat, p, nodes=4, ranks_per_node=2)
    assert nodes["samples_per_s"] == 40.0 and nodes["measured_samples_per_s"] == 10.0
    assert nodes["eta_s"] == round(nodes["steps"] * nodes["global_batch"] / 40.0)
    assert "(measured by p0 on 2 ranks at 10.0 samples/s, scaled linearly to 8)" in (
        plan.format_plan(nodes)
    )


def test_the_curriculum_plans_on_the_nodes_it_trains_on(bucketed, monkeypatch):
    """The flow's `nodes` (0: the phase's) reach its plan task as they reach its train task,
    and the plan counts that many nodes. The flow's and tasks' functions, without a Prefect
    server: their Prefect calls stood in for, the training stopped before it starts."""
    import logging

    from flows import curriculum
    from tasks.phases.train import TrainingFailed

    p = phase(MixEntry(dataset="a", count=85), num_val_samples=0, batch_size=2, nodes=3)
    cat = catalog(bucketed, p1=p)
    monkeypatch.setattr(plan, "_local_gpus", lambda: 2)
    monkeypatch.setattr(curriculum, "get_run_logger", lambda: logging.getLogger("curriculum"))
    monkeypatch.setattr(curriculum, "create_markdown_artifact", lambda *a, **k: None)
    monkeypatch.setattr(curriculum, "export_secrets", lambda: None)
    monkeypatch.setattr(curriculum, "preflight", lambda name, root: (cat, p, ""))
    monkeypatch.setattr(curriculum, "mix_task", lambda root, catalog, phase: {})
    planned, trained = [], []
    real_plan_task = curriculum.plan_task.fn
    monkeypatch.setattr(
        curriculum, "plan_task", lambda *args: planned.append(real_plan_task(*args))
    )

    def train_task(root, phase, init_from, wandb_project, nodes, cluster, remixed=False):
        trained.append((nodes, cluster))
        raise TrainingFailed("stopped before it starts")

    monkeypatch.setattr(curriculum, "train_task", train_task)
    for nodes in (0, 5, 1):
        state = curriculum.curriculum.fn(phase="p1", data_root=str(bucketed), nodes=nodes)
        assert state.message == "stopped before it starts"
    assert trained == [(0, ""), (5, ""), (1, "")]  # the train task: 0 = the phase's 3
    assert [(r["nodes"], r["world_size"], r["through_ray"]) for r in planned] == [
        (3, 3 * 2, True),
        (5, 5 * 2, True),
        (1, 2, False),
    ]
