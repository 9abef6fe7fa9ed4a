#!/bin/bash
# candidate.sh CKPT NAME: checkpoint -> target_tuned_hf -> export (step 4) -> shipped MTP block,
# template, generation config -> convert into training/work/cands/NAME/target, shipped drafter beside it.
set -eo pipefail
cd "$(dirname "$0")/.."
CKPT=$(realpath $1); NAME=$2
export TRAIN_THREADS=1
(cd training && ../.venv-train/bin/python -c "
import sys, torch
from export_target import load_dequantized
from data import WORK
m = load_dequantized(); m.load_state_dict(torch.load('$CKPT')['model']); m.eval()
m.save_pretrained(WORK / 'target_tuned_hf')
print('saved')
" 2>&1 | grep -v -i warn)
.venv-train/bin/python training/export_target.py 2>&1 | grep -v -i warn | tail -12
W=training/work/target_nvfp4
cp training/work/target_nvfp4_shipped/model-mtp.safetensors $W/
cp mlx_dspark/demo/target/chat_template.jinja mlx_dspark/demo/target/generation_config.json $W/
.venv/bin/python - <<PY
import json; p='$W/config.json'; c=json.load(open(p)); c['num_nextn_predict_layers']=1; json.dump(c,open(p,'w'),indent=2)
PY
D=training/work/cands/$NAME
rm -rf $D; mkdir -p $D
.venv/bin/mlx-dspark convert $W -o $D/target --no-progress 2>&1 | tail -3
cp -r mlx_dspark/demo/drafter $D/drafter
echo converted $D
