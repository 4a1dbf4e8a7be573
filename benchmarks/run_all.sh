#!/usr/bin/env bash
# The GPU evidence, part by part, into OUTDIR (one file or two per part, flat).
# Usage (on a GPU machine, from the checkout): benchmarks/run_all.sh OUTDIR [PART ...]
# Parts (default: all, in this order):
#   doctor       repro doctor, text and JSON
#   matrix       repro matrix --config gpu-2 --jobs 8, timed (the <= 90 s target)
#   replay       graph replay vs eager per region, guard overhead (benchmarks/replay.py)
#   verdict      time to verdict per scenario x mode, median of 5, plus one cold run each
#                (benchmarks/time_to_verdict.py; with BEFORE=/path/to/older/checkout the two
#                trees are interleaved and their ratios reported)
#   startup      a rank's start-up, piece by piece (benchmarks/startup.py)
#   specdec      tokens/s of the speculative loop at TP 2 over NCCL (benchmarks/specdec.py)
#   watch        repro watch on the examples + the cross-check (benchmarks/watch_checks.sh)
#   sanitizer    guard vs compute-sanitizer memcheck on unfixed gemma4-mtp TP=2 and nvfp4-reload
#   determinism  N=20 seeds x after-free x unfixed/fixed, both scenarios (benchmarks/determinism.py)
#   tests        the GPU tests (pytest -m "gpu or multi_gpu")
#   unit-gpu     the GPU tests but the matrix tables (when the matrix part ran them)
# Each part gets its own time limit so one stuck part cannot take the others' results with it.
set -u
out=${1:?usage: benchmarks/run_all.sh OUTDIR [PART ...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(doctor matrix replay verdict sanitizer determinism tests)
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log="$out/run_all.log"
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$log"; }

for part in "${parts[@]}"; do
  say "begin $part"
  start=$(date +%s.%N)
  case $part in
    doctor)
      python3 -m repro doctor --json "$out/doctor.json" 2>&1 | tee -a "$log" ;;
    matrix)
      timeout 240 python3 -m repro matrix --config gpu-2 --jobs 8 --json "$out/matrix-gpu-2.json" \
          --artifacts /tmp/repro-matrix 2>&1 | tail -30 | tee -a "$log" ;;
    replay)
      timeout 180 python3 benchmarks/replay.py --json "$out/replay.json" > /dev/null 2>> "$log" ;;
    verdict)
      g="gemma4-mtp --tp 2 --mode"; n="nvfp4-reload --steps 5 --mode"
      trees=(); [ -n "${BEFORE:-}" ] && trees=(--tree "before=$BEFORE" --tree "after=$PWD")
      timeout 540 python3 benchmarks/time_to_verdict.py --runs 5 --cold "${trees[@]}" \
          --json "$out/time-to-verdict.json" \
          -- $g unfixed -- $g fixed -- $g reload-safe -- $n unfixed -- $n kernel-reuse -- $n fixed \
          > /dev/null 2>> "$log" ;;
    startup)
      timeout 180 python3 benchmarks/startup.py --runs 3 --json "$out/startup.json" > /dev/null 2>> "$log" ;;
    specdec)
      timeout 300 python3 benchmarks/specdec.py --tp 2 --rounds 5 --json "$out/specdec.json" > /dev/null 2>> "$log" ;;
    watch)
      timeout 480 bash benchmarks/watch_checks.sh "$out/watch" 2>&1 | tail -5 | tee -a "$log" ;;
    sanitizer)
      timeout 300 python3 benchmarks/sanitizer.py --json "$out/sanitizer-gemma.json" --deadline 120 \
          > /dev/null 2>> "$log"
      timeout 240 python3 benchmarks/sanitizer.py --scenario nvfp4-reload --steps 1 --deadline 100 \
          --json "$out/sanitizer-nvfp4.json" > /dev/null 2>> "$log" ;;
    determinism)
      timeout 540 python3 benchmarks/determinism.py --n 20 --jobs 16 --json "$out/determinism.json" \
          --log "$out/determinism.jsonl" 2>&1 | tail -3 | tee -a "$log" ;;
    tests|unit-gpu)
      # unit-gpu: all but the matrix tables, which the matrix part runs through the CLI
      skip=(); [ "$part" = unit-gpu ] && skip=(--deselect tests/test_gpu_matrix.py)
      REPRO_REPORT_DIR=$out timeout 400 python3 -m pytest -m "gpu or multi_gpu" "${skip[@]}" -v \
          -p no:cacheprovider -rA > "$out/pytest-gpu.log" 2>&1; tail -15 "$out/pytest-gpu.log" | tee -a "$log" ;;
    *)
      echo "unknown part: $part" | tee -a "$log"; exit 2 ;;
  esac
  rc=${PIPESTATUS[0]}
  say "end $part rc=$rc $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$start" "$(date +%s.%N)")"
done
