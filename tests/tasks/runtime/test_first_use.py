"""Process-wide objects built lazily (tokenizer, VAE, encoder, scorers, text encoder, noise
schedules) are built safely when several task threads use them first, at once, in a fresh
process: what build-latents does when two tokenize (or score, encode) shards start together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[3]

# Each job is the first use of one lazily built object, started by several threads at once
# (a barrier lines them up); the main thread has imported nothing heavy beforehand.
SCRIPT = r"""
import json, sys, threading
from catalog import load_catalog
from catalog.loader import PACKAGED_DIR

catalog = load_catalog(PACKAGED_DIR)
tiny, scoring = catalog.model("tiny"), catalog.scorer("tiny-scoring")

def tokens():
    from sdtrain.models import encode_captions
    return encode_captions(["a cat on a mat", "été à Paris"])[0].tolist()

def reference_tokenizer():
    from sdtrain.models import build_tokenizer
    return id(build_tokenizer())

def vae():
    import torch
    from tasks.latents.encode import vae_for
    return id(vae_for(tiny, torch.device("cpu")))

def encoder():
    import torch
    from tasks.latents.encode import encoder_for
    return id(encoder_for(tiny, torch.device("cpu")))

def scorer():
    import torch
    from tasks.curation.score import load_scorer
    return id(load_scorer(scoring, torch.device("cpu")))

def text_encoder():
    from sdtrain.models import build_text_encoder
    return sum(p.numel() for p in build_text_encoder(tiny).parameters())

def schedules():
    from sdtrain.objective import alphas_cumprod
    from sdtrain.sampling import ddim_scheduler
    return [float(alphas_cumprod()[-1]), ddim_scheduler().config.num_train_timesteps]

jobs = [tokens, reference_tokenizer, vae, encoder, scorer, text_encoder, schedules]
per_job = int(sys.argv[1])
barrier = threading.Barrier(len(jobs) * per_job)
results, errors = {}, []

def run(job):
    barrier.wait()
    try:
        results.setdefault(job.__name__, []).append(job())
    except BaseException as e:
        errors.append(f"{job.__name__}: {type(e).__name__}: {e}")

threads = [threading.Thread(target=run, args=(j,)) for j in jobs for _ in range(per_job)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"errors": errors, "results": results}))
"""


def test_lazy_objects_built_from_many_threads_at_first_use():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "3"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    results = report["results"]
    assert all(len(values) == 3 for values in results.values()), results
    # One object per process, whichever thread built it; every thread got the same answer.
    for name in ("reference_tokenizer", "vae", "encoder", "scorer"):
        assert len(set(results[name])) == 1, name
    for name in ("tokens", "text_encoder", "schedules"):
        assert all(v == results[name][0] for v in results[name]), name
    bos, eos = 49406, 49407
    assert results["tokens"][0][0][:2] == [bos, 320] and results["tokens"][0][0][-1] == eos
