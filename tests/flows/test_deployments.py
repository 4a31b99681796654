"""prefect.yaml declares one deployment per catalog source (build-latents and remove), phase
(curriculum and eval) and fine-tune, and generate/default, for the sdpipe pool; only the
demo's run offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from catalog import load_catalog
from flows.cli.local import WORK_POOL

PREFECT_YAML = Path(__file__).resolve().parents[2] / "prefect.yaml"


def test_every_source_and_phase_is_deployed():
    catalog = load_catalog()
    deployments = yaml.safe_load(PREFECT_YAML.read_text())["deployments"]
    by_flow: dict[str, set[str]] = {}
    for d in deployments:
        flow = {
            "flows/build_latents.py:build_latents": "build-latents",
            "flows/curriculum.py:curriculum": "curriculum",
            "flows/generate.py:generate": "generate",
            "flows/finetune.py:finetune": "finetune",
            "flows/evaluate.py:evaluate_phase": "eval",
            "flows/remove.py:remove": "remove",
        }[d["entrypoint"]]
        by_flow.setdefault(flow, set()).add(d["name"])
        assert d["work_pool"]["name"] == WORK_POOL
        # The deployment's parameter names the catalog entry it is named after; a generate run
        # names its prompts, weights and folder.
        names = {
            "build-latents": {"source": d["name"]},
            "curriculum": {"phase": d["name"]},
            "finetune": {"name": d["name"]},
            "eval": {"phase": d["name"]},
            "remove": {"source": d["name"]},
        }
        assert d["parameters"] == names.get(flow, {})
    assert by_flow["build-latents"] == set(catalog.sources)
    assert by_flow["curriculum"] == set(catalog.phases)
    assert {f"phase-{i}" for i in range(1, 8)} | {"demo"} == by_flow["curriculum"]
    assert by_flow["generate"] == {"default"}
    assert by_flow["finetune"] == set(catalog.finetunes)
    assert by_flow["eval"] == set(catalog.phases)
    assert by_flow["remove"] == set(catalog.sources)


def _is_demo(d: dict) -> bool:
    return d["name"] == "demo" or d["name"].startswith("demo-")


def test_only_the_demos_deployments_run_offline():
    """`make demo` runs offline, but the worker it leaves running takes every run of the pool:
    the demo's deployments say so in their own job variables, no other deployment does."""
    for d in yaml.safe_load(PREFECT_YAML.read_text())["deployments"]:
        env = d["work_pool"].get("job_variables", {}).get("env", {})
        assert env.get("HF_HUB_OFFLINE") == ("1" if _is_demo(d) else None), d["name"]


def _run_env(worker_env: dict[str, str], name: str) -> dict[str, str]:
    """The environment the process worker gives a run of deployment `name`: the worker's own,
    under the deployment's job variables over the pool's template (ProcessJobConfiguration)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.workers.process import ProcessJobConfiguration

    async def read():
        async with get_client() as client:
            deployment = await client.read_deployment_by_name(name)
            pool = await client.read_work_pool(WORK_POOL)
            return await ProcessJobConfiguration.from_template_and_values(
                pool.base_job_template, deployment.job_variables or {}, client=client
            )

    config = asyncio.run(read())
    return {**worker_env, **{k: v for k, v in config.env.items() if v is not None}}


@pytest.mark.slow
def test_the_demos_worker_runs_other_deployments_online(prefect_stack):
    """Issue 33, item 12: after the demo's setup (server, deploy, worker, started from a shell
    with HF_HUB_OFFLINE=1 as `make demo` has it), a run of build-latents/laion on that worker
    has no HF_HUB_OFFLINE; the demo's own runs still have it."""
    import psutil

    from flows.cli import local

    root, _ = prefect_stack
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the caller's, as under `make demo`
    worker = psutil.Process(local._recorded(local.prefect_dir(root) / "worker.pid")[0])
    worker_env = worker.environ()
    for name in ("build-latents/laion", "curriculum/phase-1", "generate/default"):
        assert "HF_HUB_OFFLINE" not in _run_env(worker_env, name), name
    for name in ("build-latents/demo", "curriculum/demo", "eval/demo"):
        assert _run_env(worker_env, name)["HF_HUB_OFFLINE"] == "1", name
