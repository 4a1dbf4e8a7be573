#!/usr/bin/env bash
# One GPU session for the engine-shaped work, part by part (default: all, in this order; each
# part has its own time limit, and a command on the device may run at most 10 minutes, so run
# the parts in two or three commands). Everything lands in OUTDIR.
#   benchmarks/gpu_engine_session.sh OUTDIR [tests] [corpus] [scale] [overhead] [matrices]
#   tests     the GPU tests alone (a capture that fails leaves torch's generator mid-capture for
#             every later test in that process; nothing else on the GPU meanwhile), ~4 min
#   corpus    the engine-shaped corpus under watch (benchmarks/engine_corpus.py), ~1 min
#   scale     the capture-cost benchmark alone on the GPU, and the step inside one process
#             (engine_capture.py --step-rounds), ~5 min
#   overhead  the replay wrapper's own cost on this host (watch_overhead.py --parts wrapper,storages)
#   matrices  gpu-1 and gpu-1-shared at --jobs N: on CUDA the trials claim GPU memory
#             (repro/run/ledger.py), so workspace-grow runs beside the others without running the
#             GPU out of memory; ~6 min each
set -u
out=${1:?usage: benchmarks/gpu_engine_session.sh OUTDIR [tests] [corpus] [scale] [overhead] [matrices]}; shift
parts=${*:-tests corpus scale overhead matrices}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }
if has tests; then
  timeout ${TESTS_S:-280} python3 -m pytest -q -rs -m "gpu or multi_gpu" -p no:cacheprovider \
    --deselect tests/test_engine_corpus_gpu.py::test_engine_corpus_correct_twins_clean_buggy_twins_exact \
    --deselect tests/test_gpu_matrix.py > "$out/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"; grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -20
fi
if has corpus; then
  CORPUS_S=${CORPUS_S:-240} JOBS=${JOBS:-6} benchmarks/watch_engine.sh "$out" corpus > /dev/null 2>&1
  tail -26 "$out/corpus.log"
fi
if has scale; then
  SCALE_S=${SCALE_S:-300} REPEATS=${REPEATS:-2} STEP_ROUNDS=${STEP_ROUNDS:-10} \
    benchmarks/watch_engine.sh "$out" scale ${PROFILE:+profile} > /dev/null 2>&1
  cat "$out/scale/table.md" 2>/dev/null || tail -5 "$out/scale.log"
fi
if has overhead; then
  timeout 120 python3 benchmarks/watch_overhead.py --parts wrapper,storages --json "$out/watch_overhead.json" > /dev/null 2>&1
  grep -A3 '"ns_per_replay"' "$out/watch_overhead.json" | tr -s ' ' | tr '\n' ' '; echo
fi
if has matrices; then
  for m in gpu-1 gpu-1-shared; do
    timeout ${MATRIX_S:-420} python3 -m repro matrix --config $m --jobs ${MATRIX_JOBS:-4} --json "$out/$m.json" > "$out/$m.txt" 2>&1
    echo "$m exit $?: $(grep -c '✓' "$out/$m.txt") met lines"; tail -3 "$out/$m.txt"
  done
fi
cd "$out" && tar czf results.tgz --exclude=results.tgz --exclude='*.prof' --exclude='watch-*' --exclude='prof-*' . 2>/dev/null
