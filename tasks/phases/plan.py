"""plan: what a phase will do, before anyone trains: per dataset requested vs available, the
optimizer steps, the disk its latents use and an ETA.

The steps are counted as the trainer counts them (`sdtrain.schedules.total_optimizer_steps`
over the per-rank batches that remain after the validation hold-out), for the ranks the
training will start: its nodes x the ranks per node (`training_ranks`: on one node
`launch_training`'s, on more train_nodes' from the Ray cluster, or assumed like this machine).
The ETA divides the samples to train by the samples/s last measured on this data root for the
same model (a run's summary; scaled linearly from that run's ranks where the plan's differ),
so it is "unknown" until one run has finished.

Bucket occupancy: the buckets of the rows the mix would draw (each drawn row's bucket, from the
encoded shards' keys files; a legacy shard is the one square of its latents), less the
validation hold-out, each with its global batches per epoch by the bucketed sampler's rule
(`sdtrain.bucket_batches`); buckets with fewer rows than one global batch are listed as left out
(`small_bucket`). A set of one bucket that the phase does not flip keeps the plain sampler
(every rank's share of one permutation), counted as before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from catalog import Catalog, Phase
from catalog.buckets import parse as bucket_sides
from sdtrain.bucket_batches import (
    SMALL_BUCKET,
    batches_per_bucket,
    leftover_rows,
    small_buckets,
    uses_bucketed_sampler,
)
from sdtrain.config import run_config_for_phase
from sdtrain.schedules import total_optimizer_steps
from tasks.phases import mix
from tasks.phases.train import TrainingFailed, on_nodes

TOKEN_BYTES = 77 * 4  # int32 ids per sample


def default_world_size() -> int:
    """The ranks launch_training starts on this machine: every GPU, or 2 CPU ranks."""
    return _local_gpus() or 2


@dataclass(kw_only=True, slots=True, frozen=True)
class Ranks:
    """The ranks a training starts: `per_node` on each of `nodes`. `through_ray`: launched by
    train_nodes on the Ray cluster; `basis`: where `per_node` comes from, as the plan says it."""

    nodes: int
    per_node: int
    through_ray: bool
    basis: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def training_ranks(
    phase: Phase, *, nodes: int = 0, cluster: str = "", per_node: int | None = None
) -> Ranks:
    """The ranks the curriculum's training of `phase` starts; `nodes` and `cluster` are the
    flow's (0: the phase's nodes), `per_node` a what-if. On one node here: launch_training's
    (every GPU, or 2 CPU ranks). Through the Ray cluster (more nodes, or a cluster named):
    train_nodes' count, the GPUs every one of the nodes has (1 CPU rank without), asked of the
    cluster at `cluster` or RAY_ADDRESS when one answers, else assumed to be this machine's."""
    nodes = nodes or phase.nodes
    through_ray = on_nodes(nodes, cluster)
    if per_node:
        return Ranks(nodes=nodes, per_node=per_node, through_ray=through_ray, basis="given")
    if not through_ray:
        gpus = _local_gpus()
        basis = f"this machine: {gpus} GPUs" if gpus else "this machine: no GPU, 2 CPU ranks"
        return Ranks(nodes=1, per_node=default_world_size(), through_ray=False, basis=basis)
    address = cluster or os.environ.get("RAY_ADDRESS", "")
    unknown = "name the Ray cluster (--cluster or RAY_ADDRESS) to count its GPUs"
    if address:
        try:
            gpus = cluster_gpus_per_node(address, nodes)
        except TrainingFailed as e:
            unknown = f"the cluster did not tell: {e}"
        else:
            basis = f"counted on the Ray cluster at {address}: " + (
                f"{gpus} GPUs on each of {nodes} nodes" if gpus else "no GPU, 1 CPU rank a node"
            )
            return Ranks(nodes=nodes, per_node=gpus or 1, through_ray=True, basis=basis)
    gpus = _local_gpus()  # train_nodes' rule on nodes like this one: every GPU, or 1 CPU rank
    like = f"{gpus} GPUs" if gpus else "no GPU, 1 CPU rank"
    basis = f"assumed like this machine: {like}; {unknown}"
    return Ranks(nodes=nodes, per_node=gpus or 1, through_ray=True, basis=basis)


def cluster_gpus_per_node(address: str, nodes: int) -> int:
    """The GPUs per node train_nodes would reserve on `nodes` nodes of the Ray cluster at
    `address` (0: a CPU cluster), read from its live nodes without reserving them; raises
    TrainingFailed where no cluster answers, or it has fewer live nodes (or fewer with GPUs,
    where it has any: `train_nodes.gpus_per_node`)."""
    from tasks.phases import train_nodes  # imports ray: only for a plan on a cluster

    with train_nodes.connected(address, nodes):
        return train_nodes.gpus_per_node(nodes)


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def measured_samples_per_s(root: Path, model: str) -> tuple[float, str, int | None] | None:
    """(samples/s, run, its ranks: None where its summary predates them) of the newest
    finished run of `model` under this data root."""
    found = []
    for summary in (root / "runs").glob("*/summary.json"):
        config = summary.parent / "config.json"
        if not config.is_file() or json.loads(config.read_text()).get("model") != model:
            continue
        record = json.loads(summary.read_text())
        rate = record.get("samples_per_s") or 0.0
        if rate > 0:
            found.append(
                (summary.stat().st_mtime, rate, summary.parent.name, record.get("world_size"))
            )
    if not found:
        return None
    _, rate, run, world_size = max(found)
    return rate, run, world_size


def plan_phase(
    root: Path,
    catalog: Catalog,
    phase: Phase,
    *,
    nodes: int = 0,
    cluster: str = "",
    ranks_per_node: int | None = None,
) -> dict:
    """The phase's plan for the ranks its training starts (`training_ranks` of these
    arguments); raises MixError as the mix would (a short dataset, nothing encoded)."""
    ranks = training_ranks(phase, nodes=nodes, cluster=cluster, per_node=ranks_per_node)
    world_size = ranks.world_size
    viewed = {e.dataset: mix.dataset_view(root, catalog, e.dataset) for e in phase.mix}
    datasets = mix.draw_counts(phase, {d: v.num_rows for d, v in viewed.items()})
    num_samples = sum(d["taken"] for d in datasets)
    config = run_config_for_phase(phase, phase_dir="", run_dir="")
    num_train = max(0, num_samples - config.num_val_samples)
    resolution = catalog.model(phase.model).resolution
    names, drawn, train, latent_bytes, sampled = drawn_buckets(
        phase, viewed, datasets, config.num_val_samples, config.seed, f"{resolution}x{resolution}"
    )
    bucket_batch = config.batch_size * world_size  # one global batch of the sampler
    per_bucket = batches_per_bucket(train, bucket_batch, world_size)
    leftover = leftover_rows(train, bucket_batch, world_size)
    bucketed = uses_bucketed_sampler(
        int(np.count_nonzero(drawn)),
        flips=phase.flip_p > 0,
        latent_draws=sampled and phase.sample_latents,
        train_time_captions=phase.train_time_captions,
    )
    if bucketed:
        batches_per_rank = int(per_bucket.sum())
    else:  # the plain sampler: each rank's share of one permutation, in whole batches
        batches_per_rank = num_train // world_size // config.batch_size
    steps = total_optimizer_steps(
        batches_per_rank,
        epochs=config.epochs,
        grad_accum=config.grad_accum,
        max_steps=config.max_steps,
    )
    global_batch = config.batch_size * world_size * config.grad_accum
    small = small_buckets(train, bucket_batch) & (train > 0) & bucketed
    columns = [c.tolist() for c in (train, per_bucket, leftover, small, drawn)]
    buckets = [
        {
            "bucket": name,
            "rows": int(n),
            "full_batches": int(n // bucket_batch),
            "last_batch": int(n % bucket_batch) if b and n % bucket_batch >= world_size else 0,
            "batches_per_rank": int(b),
            "leftover_per_epoch": int(rest),
            "left_out": SMALL_BUCKET if left else None,
        }
        for name, n, b, rest, left, all_rows in zip(names, *columns, strict=True)
        if all_rows
    ]
    if not bucketed:  # the plain sampler cuts no batch per bucket
        for b in buckets:
            b["full_batches"] = b["last_batch"] = b["leftover_per_epoch"] = None
            b["batches_per_rank"] = batches_per_rank
    measured = measured_samples_per_s(root, phase.model)
    rate = measured[0] if measured else None
    if measured and measured[2] and measured[2] != world_size:
        # The run's rate was of its ranks (another GPU count here, a what-if --ranks, more
        # nodes): scaled linearly, an assumption the plan states; DDP over nodes is unmeasured.
        rate = measured[0] * world_size / measured[2]
    samples_to_train = steps * global_batch
    return {
        "phase": phase.name,
        "datasets": datasets,
        "num_samples": num_samples,
        "num_val_samples": min(config.num_val_samples, num_samples),
        "world_size": world_size,
        "nodes": ranks.nodes,
        "ranks_per_node": ranks.per_node,
        "through_ray": ranks.through_ray,
        "ranks_basis": ranks.basis,
        "global_batch": global_batch,
        "epochs": config.epochs,
        "steps": steps,
        "bucketed_sampler": bool(bucketed),
        "bucket_batch": bucket_batch,
        "batches_per_rank": batches_per_rank,
        "buckets": buckets,
        "left_out": {
            SMALL_BUCKET: {
                "buckets": [b["bucket"] for b in buckets if b["left_out"]],
                "samples": sum(b["rows"] for b in buckets if b["left_out"]),
            }
        },
        # Rows per epoch that sit it out: each bucket's leftover rows fewer than the ranks.
        "leftover_per_epoch": sum(b["leftover_per_epoch"] or 0 for b in buckets),
        "latents_gb": round(latent_bytes / 1e9, 3),
        "tokens_gb": round(num_samples * TOKEN_BYTES / 1e9, 3),
        "samples_per_s": rate,
        "measured_on": measured[1] if measured else None,
        "measured_samples_per_s": measured[0] if measured else None,
        "measured_world_size": measured[2] if measured else None,
        "eta_s": round(samples_to_train / rate) if measured else None,
    }


def drawn_buckets(
    phase: Phase, viewed: dict, datasets: list[dict], num_val: int, seed: int, square: str
) -> tuple[list[str], np.ndarray, np.ndarray, int, bool]:
    """(bucket names sorted, rows drawn per bucket, training rows per bucket, latent bytes,
    whether any drawn latent holds a log-variance) of
    the rows the mix would draw: each dataset's seeded mask (`mix.draw`), its rows' buckets a
    shard at a time, and the rows `split_rows` holds out for validation taken off by position
    in the phase set (manifest order: datasets in mix order, each in its view's order).

    A view planted as a plain table (tests) is one bucket, `square`, of 1 view x 4 channels.
    """
    from sdtrain.data import split_rows

    num_samples = sum(d["taken"] for d in datasets)
    if num_val >= num_samples:
        val = np.arange(num_samples)  # nothing left to train on
    else:
        val = split_rows(num_samples, num_val, seed)[1]
    code: dict[str, int] = {}
    drawn: list[np.ndarray] = []  # per shard (or planted view), rows drawn per code
    held: list[np.ndarray] = []
    latent_bytes, offset, sampled = 0, 0, False
    for d in datasets:
        view = viewed[d["dataset"]]
        mask = mix.draw(phase, d["dataset"], view.num_rows, d["taken"])
        if isinstance(view, mix.EncodedView):
            pieces = view.drawn_buckets(mask)
            layouts = view.latent_layouts()
        else:
            pieces = iter([([square], np.zeros(d["taken"], np.int32))])
            layouts = {square: (1, 4)}
        for names, codes in pieces:
            lookup = np.array([code.setdefault(n, len(code)) for n in names], np.int64)
            rows = lookup[codes]
            lo, hi = np.searchsorted(val, [offset, offset + len(rows)])
            drawn.append(np.bincount(rows, minlength=len(code)))
            held.append(np.bincount(rows[val[lo:hi] - offset], minlength=len(code)))
            offset += len(rows)
            for n, count in zip(
                names, np.bincount(codes, minlength=len(names)).tolist(), strict=True
            ):
                views, channels = layouts[n]
                width, height = bucket_sides(n)
                sampled |= bool(count) and channels == 8
                latent_bytes += count * views * channels * (width // 8) * (height // 8) * 2
    order = sorted(code, key=_bucket_order)
    total, kept = np.zeros(len(code), np.int64), np.zeros(len(code), np.int64)
    for a, b in zip(drawn, held, strict=True):
        total[: len(a)] += a
        kept[: len(a)] += a - b
    at = np.array([code[n] for n in order], np.int64)
    return order, total[at], kept[at], latent_bytes, sampled


def _bucket_order(name: str) -> tuple[float, str]:
    """Buckets by aspect ratio (width / height), as a plan lists them."""
    width, height = bucket_sides(name)
    return width / height, name


def format_plan(plan: dict) -> str:
    lines = [
        f"plan of {plan['phase']}",
        f"{'dataset':<20}{'requested':>12}{'available':>12}{'taken':>12}",
    ]
    for d in plan["datasets"]:
        mark = "  SHORT" if d["short"] else ""
        lines.append(
            f"{d['dataset']:<20}{d['requested']:>12}{d['available']:>12}{d['taken']:>12}{mark}"
        )
    lines += [
        f"samples: {plan['num_samples']} ({plan['num_val_samples']} held out for validation)",
        f"steps: {plan['steps']} ({plan['epochs']} epochs, global batch {plan['global_batch']} "
        f"on {plan['world_size']} ranks)",
        *(
            [  # one node here: as before nodes existed
                f"ranks: {plan['nodes']} nodes x {plan['ranks_per_node']} per node through "
                f"the Ray cluster; per node {plan['ranks_basis']}"
            ]
            if plan["through_ray"]
            else []
        ),
        *_format_buckets(plan),
        f"disk: {plan['latents_gb']} GB of latents + {plan['tokens_gb']} GB of tokens "
        "(in the sources' folders; the phase set links to them)",
        f"ETA: {_format_eta(plan)}",
    ]
    return "\n".join(lines)


def _format_eta(plan: dict) -> str:
    if plan["eta_s"] is None:
        return "unknown (no finished run of this model on this data root yet)"
    scaled = (
        f" on {plan['measured_world_size']} ranks at {plan['measured_samples_per_s']:.1f} "
        f"samples/s, scaled linearly to {plan['world_size']}"
        if plan["samples_per_s"] != plan["measured_samples_per_s"]
        else ""
    )
    return (
        f"{_duration(plan['eta_s'])} at {plan['samples_per_s']:.1f} samples/s "
        f"(measured by {plan['measured_on']}{scaled})"
    )


def _format_buckets(plan: dict) -> list[str]:
    """The bucket occupancy table, and the buckets left out of the run."""
    if not plan["buckets"]:
        return ["buckets: none (nothing drawn)"]
    if not plan["bucketed_sampler"]:
        names = ", ".join(b["bucket"] for b in plan["buckets"])
        return [
            f"buckets: {names} (one bucket, no flips: {plan['batches_per_rank']} batches of "
            f"{plan['bucket_batch'] // plan['world_size']} per rank per epoch)"
        ]
    lines = [
        f"buckets (training rows; global batches of {plan['bucket_batch']} = "
        f"{plan['bucket_batch'] // plan['world_size']} x {plan['world_size']} ranks):",
        f"  {'bucket':<12}{'rows':>10}{'full':>8}{'last':>8}{'per rank/epoch':>16}",
    ]
    for b in plan["buckets"]:
        mark = f"  left out: {b['left_out']}" if b["left_out"] else ""
        lines.append(
            f"  {b['bucket']:<12}{b['rows']:>10}{b['full_batches']:>8}{b['last_batch']:>8}"
            f"{b['batches_per_rank']:>16}{mark}"
        )
    lines.append(f"  {'all':<12}{'':>10}{'':>8}{'':>8}{plan['batches_per_rank']:>16}")
    small = plan["left_out"][SMALL_BUCKET]
    if small["buckets"]:
        lines.append(
            f"left out ({SMALL_BUCKET}): {len(small['buckets'])} bucket(s), {small['samples']} "
            f"samples, each under one global batch: {', '.join(small['buckets'])}"
        )
    if plan.get("leftover_per_epoch"):
        lines.append(
            f"leftover: {plan['leftover_per_epoch']} rows per epoch sit it out (a bucket's rows "
            "after its batches, fewer than the ranks; other rows each epoch)"
        )
    return lines


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"
