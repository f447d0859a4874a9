#!/usr/bin/env bash
# One call on a GPU machine (PyTorch, Triton, pytest there; no install, no vLLM):
#   1. the losses' GPU checks: every path against the float64 oracles and the no-host-sync
#      checks under CUDA's sync check (pytest, the suite's own files);
#   2. the losses' table at V = 248,320, H = 2560, K = 128 against the matmul floor, with a
#      profile of the fused and chunked paths (benchmarks/gpu/bench_losses_gpu.py).
# Results go to $OUT (default benchmarks/gpu/out): pytest.txt, results.json, results.md,
# profile_*.txt. Extra arguments go to the benchmark (e.g. --positions 4096).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/gpu/out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# --noconftest: the suite's conftest starts vLLM fixtures, which this machine lacks; these
# two files need none of them.
timeout 240 python3 -m pytest -q -rA -p no:cacheprovider --noconftest \
    tests/student_client/losses/test_losses_cuda.py \
    tests/student_client/losses/test_losses_nosync.py 2>&1 | tee "$OUT/pytest.txt" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.txt"
python3 -m benchmarks.gpu.bench_losses_gpu --out "$OUT" "$@"
