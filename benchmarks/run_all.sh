#!/usr/bin/env bash
# The GPU evidence in one go, into OUTDIR: doctor, the GPU tests (outcome tables), benchmarks.
# Usage (on a GPU machine, from the checkout): benchmarks/run_all.sh OUTDIR [tests|bench|all]
set -u
out=${1:?usage: benchmarks/run_all.sh OUTDIR [tests|bench|all]}
what=${2:-all}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ "$what" != bench ]; then
  python3 -m repro doctor > "$out/doctor.txt" 2>&1
  python3 -m repro doctor --json "$out/doctor.json" > /dev/null 2>&1
  REPRO_REPORT_DIR=$out python3 -m pytest -m "gpu or multi_gpu" -v -p no:cacheprovider -rA 2>&1 | tee "$out/pytest-gpu.log"
fi
if [ "$what" != tests ]; then
  python3 benchmarks/replay.py --json "$out/replay.json"
  python3 benchmarks/time_to_verdict.py --runs 3 --json "$out/time-to-verdict.json" \
      -- gemma4-mtp --tp 2 -- nvfp4-reload --steps 5
fi
