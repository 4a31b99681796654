"""prefect.yaml declares one deployment per catalog source, phase (curriculum and eval) and
fine-tune, and
generate/default, for the sdpipe pool."""

from __future__ import annotations

from pathlib import Path

import yaml

from catalog import load_catalog
from flows.local import WORK_POOL

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
        }
        assert d["parameters"] == names.get(flow, {})
    assert by_flow["build-latents"] == set(catalog.sources)
    assert by_flow["curriculum"] == set(catalog.phases)
    assert {f"phase-{i}" for i in range(1, 8)} | {"demo"} == by_flow["curriculum"]
    assert by_flow["generate"] == {"default"}
    assert by_flow["finetune"] == set(catalog.finetunes)
    assert by_flow["eval"] == set(catalog.phases)
