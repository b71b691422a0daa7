#!/usr/bin/env bash
# One lent GPU's worth of measurements (under 10 minutes of a 15-minute lease). `bash bench/gpu/lease.sh` (part
# "decode", the default), in order of what they settle:
#   1. ChatGLM3-6B bf16 and INT4 decode at batch 1 and 32: the cached loop, the compiled steps (CUDA graphs), transformers;
#   2. ChatGLM3-6B INT8 at batch 1;
#   3. GLM-4-9B bf16 at batch 1;
#   4. the CUDA tests of the weight-only kernels and compiled decoding, if time is left.
# `bash bench/gpu/lease.sh serve` (a lease of its own): serve.py on a random model of ChatGLM3-6B's blocks in bf16,
# 1 / 16 / 64 streaming clients: the batching server, one at a time (--max-batch 1), and --compile; merged into
# gpu.json / gpu.md as "serve" rows (bench/gpu/gpu_report.py --serve).
# Each part starts only inside the run's deadline and saves its rows as it goes (results merged by row into
# bench/results/gpu.{json,md}). Run from the repository root on the GPU machine:
#     OUT=/some/folder bash bench/gpu/lease.sh
# where the machine lacks this project's transformers / peft, put their wheels in .whl/ first (they are installed
# into /tmp/site). The logs and results land in $OUT; copy gpu.json / gpu.md back into bench/results/.
set -u
OUT=${OUT:?set OUT to a folder for the results and logs}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_LOGS=perf_hints,recompiles
start=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - start) )); }  # seconds until $1 seconds into the run
if [ "${1:-decode}" = serve ]; then
  python3 bench/serve/serve.py --version chatglm3 --size 6b --device cuda --compile --max-batch 64 --streams 1,16,64 \
    --requests-per-stream 2 --soak 0 --server-arg=--dtype --server-arg=bfloat16 --out "$OUT/serve-gpu.json" \
    > "$OUT/serve.txt" 2>&1; tail -c 6000 "$OUT/serve.txt"
  cp bench/results/gpu.json "$OUT/" && python3 bench/gpu/gpu_report.py --serve "$OUT/serve-gpu.json" --out "$OUT"
  echo "elapsed $(( $(date +%s) - start )) s"
  exit 0
fi
cp bench/results/gpu.json "$OUT/"
smi() { nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv >> "$OUT/smi.txt"; }
smi
python3 bench/gpu/gpu.py --models chatglm3-6b --precisions bf16,int4 --skip-train --tests none --deadline 200 \
  --out "$OUT" > "$OUT/log1.txt" 2>&1; tail -c 2500 "$OUT/log1.txt"
python3 bench/gpu/gpu.py --models chatglm3-6b --precisions int8 --batches 1 --skip-train --skip-transformers --tests none \
  --deadline "$(left 340)" --out "$OUT" > "$OUT/log2.txt" 2>&1; tail -c 1500 "$OUT/log2.txt"
python3 bench/gpu/gpu.py --models glm4-9b --precisions bf16 --batches 1 --skip-train --tests last \
  --tests-k "weight_only or compiled_decoding" --deadline "$(left 430)" --out "$OUT" > "$OUT/log3.txt" 2>&1
tail -c 2500 "$OUT/log3.txt"
smi
echo "elapsed $(( $(date +%s) - start )) s"
