#!/bin/bash
# v14 continued 64 steps at 2 draft layers against v14 deepened to 4 (identity blocks added), same data, seed, schedule
set -x
D="training_data/smollm2_regen.jsonl.gz training_data/smollm2_code_regen.jsonl.gz training_data/smollm2_regen_v2.jsonl.gz training_data/smollm2_regen_v3.jsonl.gz training_data/smollm2_regen_v4.jsonl.gz"
for L in 4 2; do
  .venv/bin/python -m modeling_dspark.training.train --data $D --output-dir runs/deepen/l$L --max-steps 64 --save-steps 32 \
    --draft-vocab-size 8192 --markov-rank 256 --num-anchors 256 --lr 3e-4 --seed 50 --no-eval --target-cache none \
    --num-draft-layers $L --init-from checkpoints/dspark-smollm2-135m-instruct-v14 --export runs/deepen/export_l$L
done
for L in 4 2; do
  .venv/bin/python -m modeling_dspark.training.expected_tau --drafter runs/deepen/export_l$L --data $D --held-out \
    --label "v14 + 64 steps, $L layers" --out runs/deepen/eval
done
.venv/bin/python -m modeling_dspark.training.expected_tau --drafter checkpoints/dspark-smollm2-135m-instruct-v14 --data $D --held-out \
    --label "v14" --out runs/deepen/eval
