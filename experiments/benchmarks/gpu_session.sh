#!/usr/bin/env bash
# One prepared call on a lent GPU: decode against the bandwidth bound under several XLA flag
# sets (0.5B), 1.5B decode, prefill at 1024-token prompts and the 0.5B preset's update (tokens/s,
# MFU, a traced step). Each part runs under its own time limit, in priority order, and leaves
# its report under $OUT even when a later part fails or is cut; the whole call ends within
# TOTAL_S seconds (default 530: a device call of 540).
#
#   OUT=/tmp/gpu bash experiments/benchmarks/gpu_session.sh          # on the device machine ($OUT set there)
#   OUT=/tmp/gpu bash experiments/benchmarks/gpu_session.sh smoke    # the same parts at toy sizes (CPU)
#   OUT=/tmp/gpu bash experiments/benchmarks/gpu_session.sh attention        # only the update, attention
#       xla against cudnn in one process (~150 s; TOTAL_S default 225: a device call of 240)
#   OUT=/tmp/gpu bash experiments/benchmarks/gpu_session.sh attention-smoke  # the same at toy sizes (CPU:
#       the cudnn row fails there, by design)
#
# Files under $OUT (at most 8 come back from the device tool): log (the caller tees it),
# env.txt, bench_decode.md, bench_decode_1.5b.md, bench_accelerator.md, decode_files.tar.gz
# (children's JSON, logs and optimized HLO), update_trace.json.gz (the traced update, if small).
set -u -o pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/gpu_session}
case $MODE in attention*) TOTAL_S=${TOTAL_S:-225} ;; *) TOTAL_S=${TOTAL_S:-530} ;; esac
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_session.XXXXXX)
START=$(date +%s)

elapsed() { echo $(( $(date +%s) - START )); }

# part NAME LIMIT_S CMD...: runs CMD under `timeout`, never past TOTAL_S less a reserve.
part() {
    local name=$1 limit=$2; shift 2
    local left=$(( TOTAL_S - 15 - $(elapsed) ))
    (( limit > left )) && limit=$left
    if (( limit < 20 )); then
        echo "=== [$name] skipped: ${left}s of ${TOTAL_S}s left"
        return
    fi
    echo "=== [$name] start at $(elapsed)s, limit ${limit}s: $*"
    timeout -k 10 "$limit" "$@"
    echo "=== [$name] exit $? at $(elapsed)s"
}

if [[ $MODE == smoke ]]; then
    DEC=(--sizes smoke --batches 1,2 --other-batches 2 --prompt 32 --new 8 --bandwidth-gib 0.25
         --budget-s 120 --worker-timeout-s 60 --min-worker-s 5)
    DEC15=(--sizes smoke --batches 2 --prompt 32 --new 8 --bandwidth-gib 0.25)
    ACC=(--sizes smoke --batches 2 --prompt 64 --new 4 --train-rows 4 --train-length 64
         --micro-batches 2 --repeats 1 --matmul-n 256 --bandwidth-gib 0.05)
    L1=150 L2=60 L3=90
else
    # 0.5B, batch 1/32/128 in the default set, 32/128 in the others (compilation, ~15-25 s a
    # batch on an H200, is most of a set's ~60-80 s); sets in order of the profile's suspects
    # (split-K, then fewer kernels); what the budget leaves out is a row saying skipped.
    DEC=(--sizes 0.5b --batches 1,32,128 --other-batches 32,128 --budget-s 300
         --worker-timeout-s 110 --min-worker-s 35)
    DEC15=(--sizes 1.5b --batches 32)
    # The 0.5B preset's longest mini-batch (32 rows x 2624 tokens in 8 passes) and prefill of
    # 32 x 1024-token prompts (decode cut to 8 steps: its ms come from bench_decode above).
    ACC=(--sizes 0.5b --batches 32 --prompt 1024 --new 8 --train-rows 32 --train-length 2624
         --micro-batches 8 --repeats 2)
    L1=315 L2=75 L3=130
fi
FLAGSETS=${FLAGSETS:-default,no_split_k,triton_multi_output,triton_heroless,autotune_0}
# The attention plan: the 0.5B preset's update (as ACC above, no sampling) with the
# materialised scores (xla) and cuDNN's flash attention (cudnn) on the same weights and batch,
# up to 64 padding tokens mid-row; cudnn first, so the process's peak memory after it is its
# own; its step traced.
ATT=(--batches '' --attention-impls cudnn,xla --pad-middle 64 --trace-impl cudnn)
if [[ $MODE == attention-smoke ]]; then
    ATT+=(--sizes smoke --train-rows 4 --train-length 64 --micro-batches 2 --repeats 1
          --matmul-n 256 --bandwidth-gib 0.05)
else
    ATT+=(--sizes 0.5b --train-rows 32 --train-length 2624 --micro-batches 8 --repeats 2)
fi

{
    echo "mode $MODE, work $WORK, $(date -u)"
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
        --format=csv 2>&1 || true
    $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1
} | tee "$OUT/env.txt"

if [[ $MODE == attention* ]]; then
    part update_attention $(( TOTAL_S - 20 )) $PY -m experiments.benchmarks.bench_accelerator "${ATT[@]}" \
        --trace-update "$WORK/update_trace" --out "$OUT/bench_attention.md"
    trace=$(find "$WORK/update_trace" -name perfetto_trace.json.gz 2>/dev/null | head -1)
    if [[ -n $trace ]] && (( $(stat -c %s "$trace") < 15 * 2**20 )); then
        cp "$trace" "$OUT/update_trace.json.gz"
    fi
    ls -la "$OUT"
    echo "=== done at $(elapsed)s"
    exit 0
fi

part decode_0.5b "$L1" $PY -m experiments.benchmarks.bench_decode "${DEC[@]}" --flagsets "$FLAGSETS" \
    --trace-flagsets '' --work-dir "$WORK/decode" --out "$WORK/decode/report/bench_decode.md"
cp "$WORK/decode/report/bench_decode.md" "$OUT/bench_decode.md" 2>/dev/null

part decode_1.5b "$L2" $PY -m experiments.benchmarks.bench_decode "${DEC15[@]}" --flagsets default \
    --trace-flagsets '' --budget-s $(( L2 - 5 )) --worker-timeout-s $(( L2 - 5 )) \
    --min-worker-s 5 --work-dir "$WORK/decode15" --out "$WORK/decode15/report/bench_decode.md"
cp "$WORK/decode15/report/bench_decode.md" "$OUT/bench_decode_1.5b.md" 2>/dev/null

part prefill_update "$L3" $PY -m experiments.benchmarks.bench_accelerator "${ACC[@]}" \
    --trace-update "$WORK/update_trace" --out "$OUT/bench_accelerator.md"

echo "=== packing at $(elapsed)s"
tar czf "$OUT/decode_files.tar.gz" -C "$WORK" \
    $(cd "$WORK" && ls -d decode/report/bench_decode_files decode15/report/bench_decode_files \
      2>/dev/null) 2>&1 | tail -3
trace=$(find "$WORK/update_trace" -name perfetto_trace.json.gz 2>/dev/null | head -1)
if [[ -n $trace ]] && (( $(stat -c %s "$trace") < 15 * 2**20 )); then
    cp "$trace" "$OUT/update_trace.json.gz"
fi
ls -la "$OUT"
echo "=== done at $(elapsed)s"
