#!/usr/bin/env bash
# repro watch on engine-shaped programs, on one GPU: the corpus (every shape, correct and buggy
# twin, under watch: findings per twin), the capture-cost benchmark at engine scale, the
# allocator costs the census rests on, and what --stacks adds to each allocation.
#   benchmarks/watch_engine.sh OUTDIR [corpus] [costs] [stacks] [scale] [profile]
set -u
out=${1:?usage: benchmarks/watch_engine.sh OUTDIR [corpus] [costs] [stacks] [scale] [profile]}; shift
parts=${*:-corpus costs stacks scale}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }
if has costs; then
  timeout ${COSTS_S:-60} python3 benchmarks/allocator_costs.py --part snapshots --json "$out/allocator_costs.json" > /dev/null 2> "$out/allocator_costs.log"
fi
if has stacks; then
  timeout ${STACKS_S:-120} python3 benchmarks/allocator_costs.py --part stacks --json "$out/allocator_stacks.json" > /dev/null 2> "$out/allocator_stacks.log"
  tail -8 "$out/allocator_stacks.log"
fi
if has corpus; then
  timeout ${CORPUS_S:-400} python3 benchmarks/engine_corpus.py --out "$out/corpus" --jobs ${JOBS:-4} > "$out/corpus.json" 2> "$out/corpus.log"
  tail -40 "$out/corpus.log"
fi
if has scale; then
  prof=""; has profile && prof="--profile --profile-cases ${PROFILE_CASES:-full,piecewise}"
  steps=""; [ -n "${STEP_ROUNDS:-}" ] && steps="--step-rounds $STEP_ROUNDS"
  timeout ${SCALE_S:-500} python3 benchmarks/engine_capture.py --repeats "${REPEATS:-2}" --out "$out/scale" $prof $steps > /dev/null 2> "$out/scale.log"
  tail -8 "$out/scale.log"
fi
cd "$out" && tar czf results.tgz --exclude=results.tgz --exclude='*.prof' --exclude='watch-*' --exclude='prof-*' . 2>/dev/null; ls -la "$out"
