#!/usr/bin/env bash
# The GPU checks, as one prepared run on a machine with an NVIDIA GPU (PyTorch with CUDA and an NCCL wheel
# installed; nothing to build).  Prints one line per check (pytest -rA) and the allreduce bandwidth table.
#   bash tests/gpu/device_check.sh            # logs and the benchmark's JSON under $OUT (default /tmp/hvd-gpu)
#   SKIP_BENCH=1 bash tests/gpu/device_check.sh   # the checks only
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hvd-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torch nccl', torch.cuda.nccl.version())"
"$PY" -c "import horovod.torch as hvd; print('nccl_built', hvd.nccl_built(), 'cuda_built', hvd.cuda_built())"
"$PY" -m pytest -q -p no:cacheprovider --timeout=300 -rA tests/gpu 2>&1 | tee "$OUT/tests.log" \
    | grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|Error|error" | cut -c1-400
status=${PIPESTATUS[0]}
# The conformance suite's every collective x dtype on CUDA tensors (np = 1 on NCCL; np = 2, 3 on the one GPU).
"$PY" -m pytest -q -p no:cacheprovider --timeout=600 tests/conformance -k torch-cuda 2>&1 \
    | tee "$OUT/conformance.log" | grep -E "^(FAILED|ERROR)|passed|failed" | cut -c1-300
[ "${PIPESTATUS[0]}" = 0 ] || status=1
[ "${SKIP_BENCH:-0}" = 1 ] || timeout "${BENCH_TIMEOUT:-240}" "$PY" benchmarks/gpu.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
exit "$status"
