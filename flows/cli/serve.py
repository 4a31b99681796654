"""Serve every deployment from this process, for development (no work pool or worker needed).

`python -m flows.cli.serve` registers `build-latents/<source>` for every catalog source,
`curriculum/<phase>` and `eval/<phase>` for every phase, `finetune/<name>` for every fine-tune
and `generate/default`, then runs what is scheduled until interrupted. Production uses the same
names through prefect.yaml and a process work pool.
"""

from __future__ import annotations

from prefect import serve

from catalog import load_catalog
from flows.build_latents import build_latents
from flows.curriculum import curriculum
from flows.evaluate import evaluate_phase
from flows.finetune import finetune
from flows.generate import generate


def deployments() -> list:
    catalog = load_catalog()
    return [
        *(build_latents.to_deployment(name=s, parameters={"source": s}) for s in catalog.sources),
        *(curriculum.to_deployment(name=p, parameters={"phase": p}) for p in catalog.phases),
        *(finetune.to_deployment(name=f, parameters={"name": f}) for f in catalog.finetunes),
        *(evaluate_phase.to_deployment(name=p, parameters={"phase": p}) for p in catalog.phases),
        generate.to_deployment(name="default"),
    ]


if __name__ == "__main__":
    serve(*deployments())
