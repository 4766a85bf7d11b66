#!/usr/bin/env bash
# demo-scenes from training to its tables, in order; each step resumable or quick to rerun. Run from the repo
# root with nothing else on the machine (the timings in the tables are interleaved ratios, but a loaded machine
# still slows every step). STEP=N runs from step N on. Times are for the 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
CKPT=src/trimvlm/demo/checkpoints/scenes
WORK=${WORK:-runs/train-scenes}   # train_state.pt (resumable) and train_log.jsonl
THREADS=${THREADS:-2}
STEP=${STEP:-1}
R=docs/results
step() { [ "$1" -ge "$STEP" ]; }

# 1. train (11,000 steps of 16 scenes, 2.1 s a step on 2 idle cores: about 6.5 hours; the shipped model is the
#    best by validation, step 9,800): the best model is written into $CKPT whenever it improves, with its test
#    accuracy per kind in trimvlm.json
step 1 && $BIN/trimvlm train-demo --task scenes --out $CKPT --steps 11000 --threads "$THREADS" 2>&1 | tail -5
# (the same, resumable from $WORK: trimvlm train-demo --task scenes --out $CKPT --work $WORK --steps 11000)

# 2. reference accuracy by transformers' own generate (the suite checks the runner lands within 2 points)
step 2 && $BIN/python -m trimvlm.demo.reference --model demo-scenes --items 240

# 3. decision head (System One, candidate scoring's head readout): a few minutes
step 3 && $BIN/trimvlm train-head --model demo-scenes --task scenes --out $CKPT --overwrite

# 4. token table: every registered token method at keep 50 / 25 / 12.5 %, L = 0 and L = 2 (about 1 hour)
step 4 && $BIN/trimvlm eval --model demo-scenes --task scenes --recipes benchmarks/recipes/tokens.yaml \
    --limit 600 --batch-size 50 --json $R/tokens-scenes.json --markdown $R/tokens-scenes.md --plot $R/tokens-scenes.png
step 4 && $BIN/python benchmarks/token_similarity.py --model demo-scenes --task scenes --json $R/token-similarity-scenes.json

# 5. KV table: every KV policy at drop 50 / 75 / 87.5 % (keep 0.5 / 0.25 / 0.125)
step 5 && $BIN/trimvlm eval --model demo-scenes --task scenes --recipes benchmarks/recipes/kv.yaml \
    --limit 600 --batch-size 50 --json $R/kv-scenes.json --markdown $R/kv-scenes.md --plot $R/kv-scenes.png

# 5b. the field's baselines beside their papers' comparisons (PyramidDrop, VisPruner, FasterVLM, G-Prune and
#     FitPrune beside FastV and VisionZip; PyramidKV beside SnapKV at the same KV entries): FitPrune's attention
#     statistics first (a minute), then one interleaved eval per table
step 5 && $BIN/trimvlm calibrate --model demo-scenes --task scenes --method fitprune --n 32 --json $R/fitprune-scenes.json
step 5 && $BIN/trimvlm eval --model demo-scenes --task scenes --recipes benchmarks/recipes/field-tokens.yaml \
    --limit 600 --batch-size 50 --json $R/field-tokens-scenes.json --markdown $R/field-tokens-scenes.md \
    --plot $R/field-tokens-scenes.png
step 5 && $BIN/trimvlm eval --model demo-scenes --task scenes --recipes benchmarks/recipes/field-kv.yaml \
    --limit 600 --batch-size 50 --json $R/field-kv-scenes.json --markdown $R/field-kv-scenes.md --plot $R/field-kv-scenes.png

# 6. depth rankers, then tune at total FLOPs 0.75 / 0.6 / 0.45 / 0.3 / 0.2 / 0.12 (the vision tower is about 30%
#    of the prefill and only downsampling reduces it, so below about 0.35x only downsampling recipes fit)
step 6 && for m in block-influence sensitivity greedy-kl; do
    $BIN/trimvlm calibrate --model demo-scenes --task scenes --method $m --n 32 --json $R/rank-scenes-$m.json; done
step 6 && $BIN/trimvlm tune --model demo-scenes --task scenes --budget total_flops=0.75 --budget total_flops=0.6 \
    --budget total_flops=0.45 --budget total_flops=0.3 --budget total_flops=0.2 --budget total_flops=0.12 \
    --out $R/tune-scenes

# 7. router v2: train, refit on the tuned method's tokens, calibrate on held-out inputs, record the variants.
#    Training runs 5 keeps x 22 layer sets (at most 2 of the 6 candidate layers) x 7 token sets per input, every
#    layout for real, one layout trie per input (docs/depth.md, "Training data at scale"): about 8 s an input on
#    one loaded CPU thread against about 210 s with the layouts run apart; the refit and the calibration run
#    each input's 5 x 22 layouts as one trie per selector too. For thousands of training inputs, in the
#    background, resumable (run it again after an interruption; progress: one line per input in
#    runs/router-scenes-data/log.jsonl):
#      OMP_NUM_THREADS=1 nohup $BIN/trimvlm train-router --model demo-scenes --task scenes --n 4000 --epochs 20 \
#          --layer 2 --keeps 0.2,0.4,0.6,0.8,1 --max-skip 2 --near 0.05 --budgets 0.75,0.6,0.45 \
#          --work runs/router-scenes-data --out runs/router-scenes > runs/router-scenes.log 2>&1 &
step 7 && OMP_NUM_THREADS=1 $BIN/trimvlm train-router --model demo-scenes --task scenes --n 1500 --epochs 20 \
    --layer 2 --keeps 0.2,0.4,0.6,0.8,1 --max-skip 2 --near 0.05 --budgets 0.75,0.6,0.45 \
    --work runs/router-scenes-data --out $CKPT/router --overwrite
step 7 && $BIN/trimvlm refit-router demo-scenes --model demo-scenes --task scenes --n 128 --select density@2 --overwrite
step 7 && $BIN/trimvlm calibrate-router demo-scenes --model demo-scenes --task scenes --n 64 \
    --select router,density@2,fastv@2,density@0 --overwrite
step 7 && $BIN/trimvlm pick-router demo-scenes --model demo-scenes --task scenes --budgets 0.75,0.6,0.45 \
    --select fastv@2,density@2,density@0 --n-val 600 --overwrite
step 7 && $BIN/trimvlm pick-routes demo-scenes --model demo-scenes --task scenes --budget 0.45 \
    --routes density@0,density@2 --n-val 600 --overwrite

# 8. budget table: tuned, FastV alone, the naive FastV + ranker, the plain router v2
step 8 && $BIN/python benchmarks/depth_budget.py --model demo-scenes --task scenes --budgets 0.75:1,0.6:2,0.45:3 \
    --router demo-scenes --rankings "$R/rank-scenes-{method}.json" --out benchmarks/recipes/budget-matched-scenes.yaml
step 8 && $BIN/python benchmarks/budget_table.py --model demo-scenes --task scenes --tuned $R/tune-scenes \
    --matched benchmarks/recipes/budget-matched-scenes.yaml --limit 600 --threads "$THREADS" --json $R/budget-scenes.json \
    --markdown $R/budget-scenes.md
