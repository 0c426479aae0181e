#!/usr/bin/env bash
# The GPU benchmarks sized for one 15-minute device lease: two calls on one warm machine (DEVELOPERS.md).
# On the device machine, from the repository root, with .whl/ carried (bench/gpu_wheels.txt says how to fetch it):
#   bash bench/gpu_lease.sh 1   # per-layer accumulation, both paths, 32K and 128K; every shape at 32K, 3 documents (~5 min)
#   bash bench/gpu_lease.sh 2   # every shape but gemma3-4b at 128K, the 8B shapes first (~6 min)
# Results go to $OUT (or bench/results/gpu/); each step has its own timeout, so a slow step leaves the others'
# results, and gpu_capture.py rewrites its .json/.md after every case.
set -u
phase=${1:?phase 1 or 2}
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
case "$phase" in
  1)
    timeout 120 python3 bench/gpu_accumulate.py --lengths 32768,131072 --repeats 10 --out "$out" | cut -c1-300
    # three documents per capture: the steady-state cost of a document (its commit beside the next forward) and
    # finalize apart, what a capture of many documents pays
    timeout 330 python3 bench/gpu_capture.py --lengths 32768 --backends sdpa --repeats 1 --docs 3 --threads 16 \
      --shapes qwen3-8b,smollm3-3b,llama-3.2-1b,ministral-3-8b,gemma3-4b --name gpu_capture_32k --out "$out"
    ;;
  2)
    timeout 450 python3 bench/gpu_capture.py --lengths 131072 --backends sdpa --repeats 1 --threads 16 \
      --shapes qwen3-8b,ministral-3-8b,smollm3-3b,llama-3.2-1b --name gpu_capture_128k --out "$out"
    ;;
  *) echo "phase 1 or 2" >&2; exit 2 ;;
esac
