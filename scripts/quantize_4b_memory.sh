#!/usr/bin/env bash
# Memory benchmark (issue 12): peak RSS of quantizing a Qwen3-4B-shaped synthetic model against the
# size of its bf16 source. Not a test: it builds an 8 GB source, needs ~14 GiB of free memory and
# ~11 GB of disk, and takes tens of minutes on 2 cores.
#
#   scripts/quantize_4b_memory.sh [RESULTS_DIR]     (default docs/results/DATE-quantize-4b)
#
# WORK (default /work/m4b) holds the source and the artifact and is deleted at the end unless
# KEEP=1; an existing WORK/source is reused, STAGES picks the stages to run. Both stages run
# under /usr/bin/time -v with the BLAS the pipeline uses (vqpipe.blas --env); a sampler records
# RSS, load average and MemAvailable every 2 s, and output lines carry a timestamp, so a peak can
# be placed in the run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-/work/main/.venv/bin/python}
WORK=${WORK:-/work/m4b}
OUT=${1:-docs/results/$(date -u +%F)-quantize-4b}
PRESET=${PRESET:-qwen3-4b-shapes}  # another preset only to try the script out
NEED_KIB=$((14 << 20))
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)

avail_kib() { awk '/MemAvailable/ {print $2}' /proc/meminfo; }
for try in 1 2 3 4 5 6; do
    [ "$(avail_kib)" -ge "$NEED_KIB" ] && break
    [ "$try" = 6 ] && { echo "only $(( $(avail_kib) >> 20 )) GiB available, need 14: giving up" >&2; exit 1; }
    echo "only $(( $(avail_kib) >> 20 )) GiB available, need 14: waiting 2 min ($try/5)"
    sleep 120
done
df -h "$WORK" | tee "$OUT/df.txt"

tree() {  # pid $1 and all its descendants
    echo "$1"
    local c
    for c in $(pgrep -P "$1" || true); do tree "$c"; done
}
rss_kib() {  # the largest VmRSS in the tree of pid $1: the python (under time and env; the
    # output timestamper is its child too, being forked before the exec)
    local p m=0 r
    for p in $(tree "$1"); do
        r=$(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
        [ "${r:-0}" -gt "$m" ] && m=$r
    done
    echo "$m"
}
sample() {  # pid file: "unix_s rss_kib load1 load5 load15 memavailable_kib" every 2 s
    while kill -0 "$1" 2>/dev/null; do
        echo "$(date +%s) $(rss_kib "$1") $(cut -d' ' -f1-3 /proc/loadavg) $(avail_kib)" >>"$2"
        sleep 2
    done
}
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s)" "$line"; done; }

measure() {  # name, then the vqpipe CLI arguments
    local name=$1; shift
    : >"$OUT/$name.samples"
    # env execs python, so the process time reports on is the interpreter
    /usr/bin/time -v -o "$OUT/$name.time-v.txt" env $("$PY" -m vqpipe.blas --env) PYTHONPATH="$ROOT" \
        PYTHONUNBUFFERED=1 "$PY" -m vqpipe "$@" > >(stamp >"$OUT/$name.log") 2>&1 &
    local pid=$!
    sample "$pid" "$OUT/$name.samples" &
    local sampler=$!
    local rc=0
    wait "$pid" || rc=$?
    wait "$sampler" || true
    echo "$name: exit $rc"
    return "$rc"
}

STAGES=${STAGES:-download quantize}  # e.g. STAGES=download KEEP=1: re-measure synthesis only
if [[ " $STAGES " != *" download "* ]] || [ -f "$WORK/source/manifest.json" ]; then
    echo "reusing $WORK/source"
else
    measure download download --source "synth:$PRESET" --out "$WORK/source"
fi
if [[ " $STAGES " == *" quantize "* ]]; then
    rm -rf "$WORK/q"
    measure quantize quantize --source "$WORK/source" --out "$WORK/q" --bits 4
fi
"$PY" "$ROOT/scripts/quantize_4b_summary.py" "$OUT" "$WORK/source/model.safetensors" "$WORK/q"
[ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"
