#!/usr/bin/env bash
# The GPU checks as one prepared run (issue 36's device run, <= 8 minutes on one H200): NCCL between two ranks that
# share the GPU (NCCL 2.30.7 from ../shared/gpu, NCCL_MULTI_RANK_GPU_ENABLE=1), then the training benchmark against
# DDP on the same NCCL.  Prints one line per check and the benchmark's table; logs and JSON go under $OUT.
#
#   bash tests/gpu/device_check.sh                 # everything (checks ~3-4 min, benchmark ~2 min)
#   SKIP_BENCH=1 bash tests/gpu/device_check.sh    # the checks only
#   FULL=1 bash tests/gpu/device_check.sh          # also every other GPU test and the bandwidth table (longer)
#
# The library: $NCCL_XZ, else .gpu/libnccl.so.2.30.7.xz in this checkout (on the device machine: copy
# ../shared/gpu there, ignore it in .git/info/exclude, and name .gpu in the run's carry), else ../shared/gpu.
# Without it the NCCL in the wheel is used and the two-ranks-on-one-GPU checks skip, saying why.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hvd-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$SECONDS
status=0
step() {   # step NAME SECONDS COMMAND...: run with a limit, keep its log, print its verdict lines
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s, at $((SECONDS - START))s)"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR|XFAIL)|^SKIPPED:|[0-9]+ (passed|failed|skipped)|^\|" "$OUT/$name.log" | cut -c1-300
    [ $rc = 124 ] && echo "TIMEOUT: $name ran past ${limit}s (see $OUT/$name.log)"
    [ $rc = 5 ] && { echo "(nothing to run here: every test of $name skipped)"; rc=0; }
    [ $rc = 0 ] || { echo "FAILED: $name (exit $rc)"; tail -n 30 "$OUT/$name.log" | cut -c1-300; status=1; }
}

XZ=${NCCL_XZ:-}
for candidate in .gpu/libnccl.so.2.30.7.xz ../shared/gpu/libnccl.so.2.30.7.xz; do
    [ -z "$XZ" ] && [ -f "$candidate" ] && XZ=$candidate
done
if [ -n "$XZ" ]; then
    "${PYTHON:-python3}" -c "import hashlib, sys; sys.exit(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest() != \
'ad71ea34297e099bb2e597084dc28761ad7808671037170001b64b80e0fc4699')" "$XZ" \
        || echo "WARNING: $XZ is not the NCCL 2.30.7 build ../shared/gpu/README.md describes"
    LIB=/tmp/hvd-nccl/libnccl.so.2
    mkdir -p /tmp/hvd-nccl
    "${PYTHON:-python3}" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
        "$XZ" "$LIB" && chmod +x "$LIB"
    export HOROVOD_NCCL_SO_PATH=$LIB NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_ALGO=Ring,Tree
else
    echo "no NCCL 2.30 build found (NCCL_XZ, .gpu/, ../shared/gpu/): the wheel's NCCL is used"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torch nccl', torch.cuda.nccl.version())"
"$PY" -c "import horovod.torch as hvd; print('nccl_built', hvd.nccl_built(), 'cuda_built', hvd.cuda_built())"

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rA --timeout=240)
# Every collective x dtype at np = 2 on NCCL (and np = 1), DistributedOptimizer at np = 2 against one process on the
# whole batch, process sets on two streams, a killed peer, communicators rebuilt by a new engine, hierarchical
# allreduce over two emulated hosts of two ranks; the ctypes declarations against the wheel's nccl.h.
step nccl-ranks 220 "${PYTEST[@]}" tests/gpu/test_gpu_nccl_ranks.py tests/gpu/test_nccl_library.py
step collectives 120 "${PYTEST[@]}" tests/gpu/test_gpu_collectives.py \
    -k "np2_on_nccl or np1_every or distributed_optimizer_matches or queries_tell"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
    # horovod.torch against DDP on the same NCCL (LD_PRELOAD: torch's own NCCL is this library too).
    step training 170 env ${HOROVOD_NCCL_SO_PATH:+LD_PRELOAD=$HOROVOD_NCCL_SO_PATH} "$PY" benchmarks/gpu_training.py \
        --np 1,2 --models resnet,transformer --blocks 3 --block-steps 10 --calls 300 --timeout 80 \
        --json "$OUT/training.json"
fi
if [ "${FULL:-0}" = 1 ]; then
    step gpu-tests 420 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_nccl_standin.py \
        --ignore=tests/gpu/test_nccl_standin_lifecycle.py --ignore=tests/gpu/test_gpu_training_smoke.py
    step conformance 420 "${PYTEST[@]}" tests/conformance -k torch-cuda
    step bandwidth 240 "$PY" benchmarks/gpu.py --json "$OUT/bench.json" ${BENCH_ARGS:-}
fi
echo "== done in $((SECONDS - START))s, status $status"
exit "$status"
