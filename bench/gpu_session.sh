#!/bin/bash
# One GPU session in one command: `partc calibrate --device cuda`, then bench/gpu_truth.py on
# GPT-2-medium (whole model) and BERT-large (whole model, a 4-stage plan's stages, two end-to-end
# launches), each priced with the calibrated and the shipped config. Run from the repo root:
#
#     OUT=DIR BUDGET=530 bash bench/gpu_session.sh     # DIR: log.txt, *_truth.md, results.tgz
#
# BUDGET (seconds) bounds the whole run; each part has its own timeout, and gpu_truth writes its
# report after every row. Where the machine lacks partc's dependencies (ortools, jsonschema),
# put their wheels for its Python in .whl/ first (../shared/notes/gpu-machine.md says which);
# they are installed into /tmp/site. partc itself is not installed: it runs from this checkout.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( ${BUDGET:-540} - $(el) )); }
cd "$(dirname "$0")/.."
mkdir -p "$OUT"; L=$OUT/log.txt
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> $L 2>&1 || { echo "pip failed" >> $L; exit 3; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PARTC_CACHE_DIR=/tmp/pcache
python3 -c "import partc.cli" 2> /dev/null || ln -sfn ../cli partc/cli  # python -m partc without an install
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv; nproc;
  python3 -c "import torch,transformers,ortools;print(torch.__version__, torch.version.cuda, transformers.__version__, ortools.__version__)"; } >> $L 2>&1
echo "[$(el)] calibrate" >> $L
timeout 150 python3 -m partc calibrate --device cuda --seconds 20 -o /tmp/cal >> $L 2>&1; echo "[$(el)] calibrate rc=$?" >> $L
CAL=$(ls /tmp/cal/devices/*.yaml 2>/dev/null | head -1)
CFG="--device-config h100-80gb"; [ -n "$CAL" ] && CFG="--device-config $CAL --device-config h100-80gb"
echo "[$(el)] gpt2-medium (CFG=$CFG)" >> $L
timeout 100 python3 bench/gpu_truth.py --out /tmp/t2 --models gpt2-medium --batch-size 8 --precisions bf16-mixed,fp32 --stages 0 --launch none $CFG >> $L 2>&1; echo "[$(el)] gpt2 rc=$?" >> $L
echo "[$(el)] bert-large" >> $L
timeout $(left) python3 bench/gpu_truth.py --out /tmp/t1 --models bert-large --batch-size 16 --precisions bf16-mixed,fp32 --stages 4 --launch first:bf16-mixed --launch-costs analytic,measured $CFG >> $L 2>&1; echo "[$(el)] bert rc=$?" >> $L
cp /tmp/t1/gpu_truth.md $OUT/bert_truth.md 2>/dev/null; cp /tmp/t2/gpu_truth.md $OUT/gpt2_truth.md 2>/dev/null
mkdir -p /tmp/pack && cp -r /tmp/cal /tmp/pack/ 2>/dev/null
for d in t1 t2; do mkdir -p /tmp/pack/$d; cp /tmp/$d/*.json /tmp/$d/*.jsonl /tmp/pack/$d/ 2>/dev/null; cp -r /tmp/$d/clusters /tmp/pack/$d/ 2>/dev/null
  for p in /tmp/$d/plans/*; do [ -d "$p" ] && mkdir -p /tmp/pack/$d/plans/$(basename $p) && cp $p/*.yaml /tmp/pack/$d/plans/$(basename $p)/ 2>/dev/null; done; done
tar czf $OUT/results.tgz -C /tmp pack; echo "[$(el)] packed" >> $L
