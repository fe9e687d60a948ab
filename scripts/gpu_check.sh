#!/usr/bin/env bash
# The GPU check, for the lent GPU machine (the device tool; at most about 6 minutes there):
#   make gpu-check             # there: its python3 (3.12) already has torch, triton, cupy, grpcio...
#   make gpu-check DRY_RUN=1   # anywhere: the script parses and every file it names exists
# It installs no torch: it builds the C extension with that python, installs only the wheels
# in .whl/ (git-ignored: cp312 wheels the machine lacks, e.g. grpcio-health-checking and
# grpcio-reflection; the device README shows the pip download line), then runs the CUDA
# tests, benchmarks/transfer.py --device cuda for every host layout (and page 16 for
# layer_first), and the two-process CUDA
# IPC round trip with a layer-wise reload (scripts/gpu_ipc_check.py). Results: one JSON,
# $OUT/gpu-check.json ($OUT is set there; else ./gpu-check-out/), and the logs of the build
# and of every step beside it (steps.log). Exits non-zero if a step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$PWD/gpu-check-out}
WHEELS=.whl
LAYOUTS=(layer_first page_first page_first_direct)
TESTS=(tests/gpu tests/data_plane/test_triton_ptx.py tests/data_plane/test_native_layers.py tests/data_plane/test_transfer.py)
FILES=(setup.py hicache/transfer/_native.c hicache/transfer/_native_plan.c hicache/transfer/_native.h benchmarks/transfer.py scripts/gpu_ipc_check.py scripts/gpu_check_report.py "${TESTS[@]}")

if [ "${DRY_RUN:-0}" = 1 ]; then
  for f in "${FILES[@]}"; do
    [ -e "$f" ] || { echo "gpu-check: $f is missing" >&2; exit 1; }
  done
  "$PY" -m py_compile scripts/gpu_ipc_check.py scripts/gpu_check_report.py benchmarks/transfer.py
  echo "gpu-check dry run: wheels, build, tests (${TESTS[*]}), transfer --device cuda x ${#LAYOUTS[@]} layouts + page 16, ipc, report: every file present"
  exit 0
fi

mkdir -p "$OUT_DIR"
work=$(mktemp -d)
failed=0
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" "$WHEELS"/*.whl
  export PYTHONPATH="$work/site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT_DIR/steps.log"
step() { echo "== $*" | tee -a "$log"; }
step "machine: $("$PY" --version 2>&1); $(nvidia-smi -L 2>&1 | head -1)"
"$PY" -c 'import torch, triton, cupy, grpc, google.protobuf as pb; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "cupy", cupy.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__)' >>"$log" 2>&1 || failed=1
step "build the C extension"
"$PY" setup.py -q build_ext --inplace >"$OUT_DIR/build.log" 2>&1 || { failed=1; echo "build failed" >>"$log"; }
step "CUDA tests"
timeout 150 "$PY" -m pytest -p no:cacheprovider -rfE --tb=short "${TESTS[@]}" >"$OUT_DIR/tests.log" 2>&1 || failed=1
# every host layout at page 64 (96/64 KiB chunks), and layer_first at page 16 (24/16 KiB)
RUNS=()
for layout in "${LAYOUTS[@]}"; do RUNS+=("$layout|--layout $layout"); done
RUNS+=("layer_first-p16|--layout layer_first --page-size 16 --pages 1024")
for run in "${RUNS[@]}"; do
  name=${run%%|*}
  step "transfer --device cuda ${run#*|}"
  # shellcheck disable=SC2086  # the run's arguments split on spaces
  timeout 60 "$PY" benchmarks/transfer.py --device cuda ${run#*|} --no-naive --repeat 5 --json \
    >"$work/transfer-$name.json" 2>"$work/transfer-$name.err" || failed=1
  tail -5 "$work/transfer-$name.err" >>"$log"
done
step "CUDA IPC round trip through the sidecar"
timeout 90 "$PY" scripts/gpu_ipc_check.py "$work/ipc.json" >"$work/ipc.err" 2>&1 || failed=1
tail -30 "$work/ipc.err" >>"$log"
"$PY" scripts/gpu_check_report.py "$work" "$OUT_DIR/tests.log" >"$OUT_DIR/gpu-check.json"
cat "$OUT_DIR/gpu-check.json"
exit "$failed"
