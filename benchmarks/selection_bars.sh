#!/usr/bin/env bash
# The selection kernels' bars, measured on an idle machine (nothing else running: no training, no other
# sessions; 2 cores).
# Every figure is a median of interleaved rounds with its spread; the JSONs land in $OUT.
#   bash benchmarks/selection_bars.sh            # ~25-35 min on 2 idle cores
#   OUT=/tmp/i33 PY=.venv/bin/python bash benchmarks/selection_bars.sh
set -euo pipefail
OUT=${OUT:-runs/selection-bars}
PY=${PY:-.venv/bin/python}
TRIMVLM=${TRIMVLM:-.venv/bin/trimvlm}
mkdir -p "$OUT"
$PY -c "import numba; print('numba', numba.__version__)"  # the compiled loops (TRIMVLM_JIT=0 switches them off)

# 1. Farthest point against the pairwise references (>= 5x the naive loop at N = 576, >= 10x at N >= 1024) and
#    its roofline (<= 2.5x at N = 1024, <= 2x at N >= 2304), d = 1024 and 2048, N = 576, 1024, 2304, 4096:
#    table "density farthest-point loop vs references", columns "x vs naive" and "x roofline" (median (min-max)
#    of 7 paired rounds). The method table beside it: the selections at d = 1024, batch 1 and 4.
for t in 1 2; do
  $PY benchmarks/token_selection.py --threads $t --ref-rounds 7 --repeats 5 \
    --methods density density:merge=false divprune cdpruner dart --json "$OUT/selection_${t}t.json"
done

# 2. Prefill at hidden 1024, batch 4, L = 0, prune 80 / 90%: "reduce %" <= 5% and efficiency >= 0.92 / 0.88,
#    on 1 and 2 threads, median of 7 interleaved rounds ("paired eff." gives the per-round median and spread).
$PY benchmarks/prefill_speed.py --threads 1 2 --prunes 0.8 0.9 --layers 0 --repeats 7 --json "$OUT/prefill.json"
#    the same with the samples kept on one thread (kernels/threads.py off), and with the numpy / torch loops
TRIMVLM_UNIT_THREADS=0 $PY benchmarks/prefill_speed.py --threads 2 --prunes 0.8 0.9 --layers 0 --repeats 7 \
  --json "$OUT/prefill_units_serial.json"
TRIMVLM_JIT=0 $PY benchmarks/prefill_speed.py --threads 1 2 --prunes 0.8 0.9 --layers 0 --repeats 7 \
  --json "$OUT/prefill_fallback.json"
#    the same width at a real model's depth (24 layers): the step's share where the prefill is a real one's
$PY benchmarks/prefill_speed.py --threads 1 2 --prunes 0.8 0.9 --layers 0 --repeats 7 --num-layers 24 \
  --json "$OUT/prefill_depth24.json"

# 3. Every token reducer at keep 25%, L = 0 and L = 2 where the method allows it, one thread, one interleaved
#    eval of 120 items: latency ratio minus total-FLOP ratio per recipe (target on demo-scenes: <= 0.08).
recipes=()
for r in cdpruner dart density divprune pool random tome; do
  for l in 0 2; do recipes+=(--recipe "tokens=$r:keep=0.25:layer=$l"); done
done
for r in downsample holov prumerge visionzip; do recipes+=(--recipe "tokens=$r:keep=0.25:layer=0"); done
for r in fastv sparsevlm; do recipes+=(--recipe "tokens=$r:keep=0.25:layer=2"); done
for model in demo demo-scenes; do
  $TRIMVLM eval --model "$model" --threads 1 --limit 120 "${recipes[@]}" --json "$OUT/eval_${model}.json" \
    --markdown "$OUT/eval_${model}.md" || echo "eval on $model: not run (not shipped here?)"
done

# 4. With an accelerator: python benchmarks/gpu_check.py --json "$OUT/gpu_check.json"
echo "results in $OUT"
