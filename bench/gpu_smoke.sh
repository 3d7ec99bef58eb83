#!/usr/bin/env bash
# The one-GPU smoke run: python -m cpbook.tools.gpu_smoke on cuda:0 (one call, no network,
# about 5 minutes or less on one H200), its JSON lines kept in bench/results/gpu_smoke.jsonl
# with a last line giving the wall time.  Arguments pass through: `--device cpu` is the dry
# run CI does, printed only (never stored: the stored file is a GPU run).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
out=$(mktemp)
python -m cpbook.tools.gpu_smoke "$@" | tee "$out"
status=${PIPESTATUS[0]}
line="{\"name\": \"gpu_smoke_wall\", \"seconds\": $(( $(date +%s) - start )), \"status\": $status}"
echo "$line"
case " $* " in
    *" --device cpu "* | *" --device=cpu "*) ;;
    *) { cat "$out"; echo "$line"; } > bench/results/gpu_smoke.jsonl
       echo "stored in bench/results/gpu_smoke.jsonl" >&2 ;;
esac
rm -f "$out"
exit "$status"
