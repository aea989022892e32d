#!/usr/bin/env bash
# The GPU measurements of the GPU-path issue, in one run on a CUDA machine:
#   tools/gpu_measure.sh [RESULTS_DIR]   (default tools/results/<gpu name>)
# It runs the GPU tests, exports stories260K and the demo model in float32 and bfloat16, benchmarks
# ar vs ParaDecode (each overlap) vs Hugging Face generate with the torch backend on CUDA (CUDA
# graphs on), characterises random Llamas of 0.5B- and 1B-like layer shapes against the bound
# (with ar's memory-bandwidth bound), and records a torch.profiler (CUPTI) trace of two streams.
# Every command is printed before it runs; the results folder gets the JSON, PNG and the log.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
gpu=$($py -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
out=${1:-tools/results/$gpu}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
run() { echo "+ $*"; "$@"; }
stories=${PARADECODE_STORIES260K:-../shared/models/stories260K}/hf
work=$(mktemp -d)

run $py -m pytest -m gpu -q tests/
for dtype in float32 bfloat16; do
  run $py -m paradecode.export.cli "$stories" -o "$work/stories-$dtype" --dtype "$dtype" --force -q
done
run $py -m paradecode.export.cli tools/demo_model -o "$work/demo" --heads tools/demo_model/heads.safetensors \
    --max-seq-len 512 --force -q
for export in stories-float32 stories-bfloat16 demo; do
  run $py -m paradecode.tools.bench "$work/$export" --backend torch --device cuda --repeat 5 \
      --max-new-tokens 128 --json "$out/bench-$export.json" --plot "$out/bench-$export.png"
done
run $py -m paradecode.tools.characterise --device cuda --backend torch --hidden 896 --ffn 4864 --layers 24 \
    --heads 14 --kv-heads 2 --vocab 32000 --repeat 5 --json "$out/char-0.5b.json" --plot "$out/char-0.5b.png"
run $py -m paradecode.tools.characterise --device cuda --backend torch --hidden 2048 --ffn 8192 --layers 16 \
    --heads 32 --kv-heads 8 --vocab 32000 --repeat 5 --json "$out/char-1b.json" --plot "$out/char-1b.png"
run $py -m paradecode.tools.profiler "$work/demo" --backend torch --device cuda --overlap streams \
    --threshold 0 --trace "$out/profile-streams.json" --torch-profiler "$out/cupti-streams.json"
echo "results in $out"
