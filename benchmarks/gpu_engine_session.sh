#!/usr/bin/env bash
# One GPU session for the engine-shaped work: GPU tests beside the corpus, then the capture-cost
# benchmark alone on the GPU (ratios), then the scenario matrices. Everything lands in OUTDIR.
#   benchmarks/gpu_engine_session.sh OUTDIR
set -u
out=${1:?usage: benchmarks/gpu_engine_session.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The GPU tests alone first (a capture that fails leaves torch's generator mid-capture for
# every later test in that process; nothing else on the GPU meanwhile).
timeout ${TESTS_S:-280} python3 -m pytest -q -m "gpu or multi_gpu" -p no:cacheprovider \
  --deselect tests/test_engine_corpus_gpu.py::test_engine_corpus_correct_twins_clean_buggy_twins_exact \
  > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"; grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -20
CORPUS_S=${CORPUS_S:-240} JOBS=${JOBS:-6} benchmarks/watch_engine.sh "$out" corpus > /dev/null 2>&1
tail -26 "$out/corpus.log"
SCALE_S=${SCALE_S:-240} REPEATS=${REPEATS:-2} benchmarks/watch_engine.sh "$out" scale ${PROFILE:+profile} > /dev/null 2>&1
cat "$out/scale/table.md" 2>/dev/null || tail -5 "$out/scale.log"
for m in gpu-1 gpu-1-shared; do
  timeout 90 python3 -m repro matrix --config $m --jobs ${MATRIX_JOBS:-4} --json "$out/$m.json" > "$out/$m.txt" 2>&1
  echo "$m exit $?: $(grep -c '✓' "$out/$m.txt") met lines"; tail -3 "$out/$m.txt"
done
cd "$out" && tar czf results.tgz --exclude=results.tgz --exclude='*.prof' --exclude='watch-*' --exclude='prof-*' . 2>/dev/null
