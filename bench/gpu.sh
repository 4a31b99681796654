#!/usr/bin/env bash
# Issue 28's GPU benchmarks, each with its baseline measured in the same run, in one go on one
# GPU machine: most important first, each within its cap and what is left of BUDGET_S (default
# 540 s) in all. One JSON line per benchmark in OUT_DIR/results.jsonl (each bench's last line),
# everything else in OUT_DIR/logs.txt. Usage: bench/gpu.sh [OUT_DIR]  (default: gpu-results)
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
budget=${BUDGET_S:-540}
start=$SECONDS
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NO_ALBUMENTATIONS_UPDATE=1 WANDB_MODE=disabled
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {
    local name=$1 cap=$2 left t rc began
    shift 2
    left=$((budget - (SECONDS - start)))
    t=$((cap < left ? cap : left))
    if ((t < 20)); then
        echo "== $name: skipped, ${left} s of the budget left" | tee -a "$out/logs.txt"
        return
    fi
    echo "== $name (cap ${t} s): $*" >>"$out/logs.txt"
    began=$SECONDS
    timeout -k 5 "$t" "$@" >"$out/$name.out" 2>>"$out/logs.txt"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - began)) s" | tee -a "$out/logs.txt"
    cat "$out/$name.out" >>"$out/logs.txt"
    if [[ $rc == 0 && $name != gpu-tests ]]; then tail -n 1 "$out/$name.out" >>"$out/results.jsonl"; fi
    rm -f "$out/$name.out"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, diffusers, open_clip; print('torch', torch.__version__, \
'diffusers', diffusers.__version__, 'open_clip', open_clip.__version__)"
    nproc
} >>"$out/logs.txt" 2>&1

# Caps from the first lease (docs/benchmarks.md, 2026-11-27): cuDNN autotunes each new shape for
# seconds, and compiling SD1.5's training step takes minutes.
step encode 150 python3 bench/encode.py --device cuda --size full --layouts legacy \
    --num-images 1024 --repeats 1 --naive-images 8
step gpu-tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/tasks/latents/test_encode_speed.py \
    tests/sdtrain/test_warm_up.py tests/tasks/curation/test_score_fast.py tests/tasks/curation/test_score_processes.py
step encode-buckets 200 python3 bench/encode.py --device cuda --size full --baseline none \
    --layouts legacy,buckets,flips --num-images 2048 --repeats 1 --naive-images 8
step train-compiled 300 python3 bench/train.py --device cuda --size full --skip-naive --repeats 1 \
    --baseline --baseline-steps 30 --compile --steps 100
step score 80 python3 bench/score.py --device cuda --size full --images 2048 --grain
step train-buckets 200 python3 bench/train.py --device cuda --size full --skip-naive --repeats 1 \
    --buckets --steps 220 --first-steps 200
step generate 120 python3 bench/generate.py --size full --device cuda --images 32 --steps 50
echo "== done in $((SECONDS - start)) s" >>"$out/logs.txt"
