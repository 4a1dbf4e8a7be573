#!/usr/bin/env bash
# GPU evidence for `repro watch`, into OUTDIR: the examples in warn and raise mode, the clean
# ones plain vs watched (same stdout), torch.compile reduce-overhead, the cross-check against
# the scenarios' built-in guard, then the overhead benchmark (alone, timing-sensitive).
# Usage (GPU machine, from the checkout): benchmarks/watch_checks.sh OUTDIR
set -u
out=${1:?usage: benchmarks/watch_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W="python3 -m repro watch"
ex=examples

# name, then the command: stdout -> NAME.out, stderr -> NAME.err, exit code -> NAME.rc
job() { local name=$1; shift; ( timeout 300 "$@" > "$out/$name.out" 2> "$out/$name.err"; echo $? > "$out/$name.rc" ) & }
watched() { local name=$1 mode=$2; shift 2
  job "$name" $W --on-finding "$mode" --run-dir "$out/run-$name" --json "$out/$name.json" -- "$@"; }

watched kv-warn warn python3 $ex/watch_kv_cache.py
watched kv-raise raise python3 $ex/watch_kv_cache.py
job kv-fixed-plain python3 $ex/watch_kv_cache.py --fixed
watched kv-fixed-warn warn python3 $ex/watch_kv_cache.py --fixed
watched sync-warn warn python3 $ex/watch_weight_sync.py
watched sync-raise raise python3 $ex/watch_weight_sync.py
job sync-inplace-plain python3 $ex/watch_weight_sync.py --in-place
watched sync-inplace-warn warn python3 $ex/watch_weight_sync.py --in-place
job triton-plain python3 $ex/watch_triton_freed.py
watched triton-warn warn python3 $ex/watch_triton_freed.py
job compiled-plain python3 $ex/watch_compiled_clean.py
watched compiled-warn warn python3 $ex/watch_compiled_clean.py
# cross-check: the built-in guard's finding vs watch's with the built-in guard off
# (gemma4-mtp's bug needs TP >= 2: the gathered lm_head does not exist at TP=1)
n="nvfp4-reload --steps 2 --after-free keep --device cuda"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  g="gemma4-mtp --tp 2 --after-free keep --device cuda"
  job gemma-guard python3 -m repro $g --guard warn --artifacts /tmp/wc-1 --json "$out/gemma-guard.json"
  watched gemma-watch warn python3 -m repro $g --guard off --artifacts /tmp/wc-2 --json "$out/gemma-off.json"
fi
job nvfp4-guard python3 -m repro $n --guard warn --artifacts /tmp/wc-3 --json "$out/nvfp4-guard.json"
watched nvfp4-watch warn python3 -m repro $n --guard off --artifacts /tmp/wc-4 --json "$out/nvfp4-off.json"
wait

for f in "$out"/*.rc; do
  name=$(basename "$f" .rc)
  printf '== %-20s rc=%s  %s\n' "$name" "$(cat "$f")" "$(tail -c 300 "$out/$name.out" | tr '\n' ' ')"
  grep -h -m2 -E "StaleCaptureError|finding|Error" "$out/$name.err" | cut -c1-300
done | tee "$out/summary.txt"
for pair in kv-fixed sync-inplace compiled triton; do
  a="$out/$pair-plain.out"; [ -f "$a" ] || continue
  b="$out/$pair-warn.out"
  cmp -s "$a" "$b" && echo "stdout identical plain vs watched: $pair" || echo "stdout DIFFERS plain vs watched: $pair"
done | tee -a "$out/summary.txt"
timeout 240 python3 benchmarks/watch_overhead.py --json "$out/watch_overhead.json" > /dev/null 2> "$out/watch_overhead.err"
echo "benchmark rc=$?" | tee -a "$out/summary.txt"
# one file to carry back (a device run returns few files)
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
