#!/bin/bash
# One GPU session in one command: `partc calibrate --device cuda`, then bench/gpu_truth.py on
# BERT-large (whole model; an end-to-end launch, traced, after its model is timed and profiled in
# the three forms launch runs it in: eager, exported, stage file; a 4-stage plan's stages), then
# GPT-2-medium (whole model), each priced with the calibrated and the shipped config; with time
# left, a launch priced from a profile measured on the GPU. Run from the repo root:
#
#     OUT=DIR BUDGET=530 bash bench/gpu_session.sh     # DIR: log.txt, *_truth.md, results.tgz,
#                                                     # checked_against.txt (for the config)
#     OUT=DIR SMOKE=1 PYTHON=.venv/bin/python bash bench/gpu_session.sh   # the same on this CPU,
#                                                     # tiny models, no wheels installed
#
# BUDGET (seconds) bounds the whole run; each part has its own timeout, and gpu_truth writes its
# report after every row. Where the machine lacks partc's dependencies (ortools, jsonschema),
# put their wheels for its Python in .whl/ first (../shared/notes/gpu-machine.md says which);
# they are installed into a temporary folder. partc itself is not installed: it runs from this
# checkout.
set -u
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( ${BUDGET:-540} - $(el) )); }
cd "$(dirname "$0")/.."
mkdir -p "$OUT"; L=$OUT/log.txt
W=$(mktemp -d)  # everything this run writes besides $OUT
PY=${PYTHON:-python3}
if [ -z "${SMOKE:-}" ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl >> "$L" 2>&1 || { echo "pip failed" >> "$L"; exit 3; }
fi
export PYTHONPATH=$W/site:$PWD PYTHONUNBUFFERED=1 PARTC_CACHE_DIR=$W/cache
$PY -c "import partc.cli" 2> /dev/null || ln -sfn ../cli partc/cli  # python -m partc without an install
if [ -n "${SMOKE:-}" ]; then
  DEVICE=cpu SHIPPED=cpu SECONDS_=2 QUICK=--quick GPT=gpt2 BERT=bert GPT_B=2 BERT_B=2 STAGES=2
else
  DEVICE=cuda SHIPPED=h100-80gb SECONDS_=20 QUICK= GPT=gpt2-medium BERT=bert-large GPT_B=8 BERT_B=16 STAGES=4
fi
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv 2>&1; nproc;
  $PY -c "import torch,transformers,ortools;print(torch.__version__, torch.version.cuda, transformers.__version__, ortools.__version__)"; } >> "$L" 2>&1
echo "[$(el)] calibrate" >> "$L"
timeout 150 $PY -m partc calibrate --device $DEVICE --seconds $SECONDS_ -o "$W/cal" >> "$L" 2>&1; echo "[$(el)] calibrate rc=$?" >> "$L"
CAL=$(ls "$W"/cal/devices/*.yaml 2>/dev/null | head -1)
CFG="--device-config $SHIPPED"; [ -n "$CAL" ] && CFG="--device-config $CAL --device-config $SHIPPED"
echo "[$(el)] $BERT (CFG=$CFG)" >> "$L"
timeout $(( $(left) - 110 )) $PY bench/gpu_truth.py --device $DEVICE $QUICK --out "$W/bert" --models $BERT --batch-size $BERT_B --precisions bf16-mixed,fp32 --stages $STAGES --launch first:bf16-mixed --launch-costs analytic $CFG >> "$L" 2>&1; echo "[$(el)] $BERT rc=$?" >> "$L"
echo "[$(el)] attention masks A/B" >> "$L"
BM=$W/bert/models/${BERT//-/_}.py  # the model file gpu_truth wrote
[ -f "$BM" ] && timeout 90 $PY bench/attention_masks.py "$BM" --device $DEVICE --batch-sizes $(( BERT_B / 2 )) --iterations 10 > "$OUT/attention_masks.md" 2>> "$L"; echo "[$(el)] attention masks rc=$?" >> "$L"
echo "[$(el)] $GPT" >> "$L"
timeout 100 $PY bench/gpu_truth.py --device $DEVICE $QUICK --out "$W/gpt" --models $GPT --batch-size $GPT_B --precisions bf16-mixed,fp32 --stages 0 --launch none $CFG >> "$L" 2>&1; echo "[$(el)] $GPT rc=$?" >> "$L"
if [ "$(left)" -gt 240 ]; then
  echo "[$(el)] $BERT launch from a measured profile" >> "$L"
  timeout "$(left)" $PY bench/gpu_truth.py --device $DEVICE $QUICK --out "$W/bert-measured" --models $BERT --batch-size $BERT_B --precisions bf16-mixed --stages 0 --launch first:bf16-mixed --launch-costs measured --no-forms $CFG >> "$L" 2>&1; echo "[$(el)] measured launch rc=$?" >> "$L"
fi
# the shipped config's `checked_against` line, from what both reports measured
$PY bench/gpu_truth.py --checked-against $(ls "$W"/bert/gpu_truth.json "$W"/gpt/gpu_truth.json 2>/dev/null) --config-name $SHIPPED > "$OUT/checked_against.txt" 2>> "$L"; echo "[$(el)] checked_against rc=$?" >> "$L"
cp "$W/bert/gpu_truth.md" "$OUT/bert_truth.md" 2>/dev/null; cp "$W/gpt/gpu_truth.md" "$OUT/gpt2_truth.md" 2>/dev/null
cp "$W/bert-measured/gpu_truth.md" "$OUT/bert_measured_truth.md" 2>/dev/null
# the reports, the calibrated configs, the metrics, every plan.yaml (not the stage files), the
# profiler tables of the runtime forms and of the launch's traced step (not the Chrome traces)
(cd "$W" && find cal bert bert-measured gpt \( -name '*.json' -o -name '*.jsonl' -o -name '*.yaml' -o -name '*.txt' \) \
  ! -name 'rank*.json' -print0 2>/dev/null | tar czf "$OUT/results.tgz" --null -T -)
echo "[$(el)] packed" >> "$L"
rm -rf "$W"
