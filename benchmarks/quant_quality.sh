#!/usr/bin/env bash
# Quality of each quantization of a model against its float32 self, as llama.cpp users
# compare them: `infer quantize` to each format, then `infer eval --ref` on WikiText-2
# (40 windows of 512 tokens). The formats in `calibrated` are quantized a second time by
# GPTQ on tinyshakespeare (never the evaluation text), those in `tuned` a third time,
# by GPTQ and then $TUNE steps of end-to-end scale tuning (`--tune`) on the same text, and
# those in `trained` by Block-AP (`--train-blocks $EPOCHS`, on $BLOCK_TOKENS tokens of it).
# One JSON file per run in OUT (NAME.json; NAME.gptq.json, NAME.tuned.json,
# NAME.trained.json); tables at the end.
#
#   benchmarks/quant_quality.sh [MODEL] [OUT]     (defaults: smollm2-135m, ./quant-quality)
set -euo pipefail
model=${1:-smollm2-135m}
out=${2:-quant-quality}
data=$(dirname "$0")/../../shared/data
text=$data/wikitext-2-test.txt
calib=$data/tinyshakespeare.txt
chunks=${CHUNKS:-40}
tune=${TUNE:-100}
epochs=${EPOCHS:-4}
block_tokens=${BLOCK_TOKENS:-16384}
mkdir -p "$out"

formats=("int8" "int8 -g 0" "int4 --symmetric" "int4 --asymmetric" "mixed" "q4_k_m" "lut4"
         "lut3_m" "lut3" "lut2_m" "lut2")
calibrated=("int4 --symmetric" "lut4" "lut3_m" "lut3" "lut2_m" "lut2")
tuned=("lut3_m" "lut2_m")
trained=("lut3_m" "lut2_m" "lut2_m -g 32")

run() {  # run NAME FORMAT... : quantize (with any extra options) and evaluate, once
  local name=$1; shift
  [ -f "$out/$name.json" ] && return
  # Results land under their final names only when complete, so a rerun resumes.
  infer quantize "$model" -o "$out/$name" --to "$@" --force --json > "$out/$name.quantize.json.tmp"
  mv "$out/$name.quantize.json.tmp" "$out/$name.quantize.json"
  infer eval "$out/$name" --ref "$model" --text "$text" --chunks "$chunks" --json > "$out/$name.json.tmp"
  mv "$out/$name.json.tmp" "$out/$name.json"
}
for f in "${formats[@]}"; do
  run "$(echo "$f" | tr -d ' -')" $f
done
for f in "${calibrated[@]}"; do
  run "$(echo "$f" | tr -d ' -').gptq" $f --calibrate "$calib"
done
for f in "${tuned[@]}"; do
  run "$(echo "$f" | tr -d ' -').tuned" $f --calibrate "$calib" --tune "$tune"
done
for f in "${trained[@]}"; do
  run "$(echo "$f" | tr -d ' -').trained" $f --calibrate "$calib" --calib-tokens "$block_tokens" \
    --train-blocks "$epochs"
done

python3 - "$out" "$tune" "$epochs" "${#formats[@]}" "${#calibrated[@]}" "${#tuned[@]}" \
  "${formats[@]}" "${calibrated[@]}" "${tuned[@]}" "${trained[@]}" <<'PY'
import json, os, sys
out, tune, epochs = sys.argv[1:4]
n, m, k = (int(a) for a in sys.argv[4:7])
rest = sys.argv[7:]
formats, calibrated, tuned, trained = rest[:n], rest[n : n + m], rest[n + m : n + m + k], rest[n + m + k :]

def table(title, names):
    print(title)
    print(f"{'format':<20} {'bpw':>5} {'size MB':>8} {'PPL':>8} {'KL mean':>9} {'KL p99':>8} {'top-1 %':>8}")
    for f, name in names:
        q = json.load(open(f"{out}/{name}.quantize.json"))
        e = json.load(open(f"{out}/{name}.json"))
        n = sum(t["shape"][0] * t["shape"][1] for t in q["tensors"])
        bpw = 8 * q["bytes_after"] / n
        size = os.path.getsize(f"{out}/{name}/model.safetensors") / 1e6
        d = e["divergence"]
        print(f"{f:<20} {bpw:5.2f} {size:8.1f} {e['model']['ppl']:8.3f} {d['kl_mean']:9.5f} "
              f"{d['kl_p99']:8.4f} {d['top1_agreement']:8.2f}")
    return e

key = lambda f: f.replace(" ", "").replace("-", "")
table("round to nearest", [(f, key(f)) for f in formats])
e = table("\nGPTQ (--calibrate tinyshakespeare.txt)", [(f, key(f) + ".gptq") for f in calibrated])
table(f"\nGPTQ, then --tune {tune}", [(f, key(f) + ".tuned") for f in tuned])
table(f"\nBlock-AP (--train-blocks {epochs})", [(f, key(f) + ".trained") for f in trained])
print(f"reference (float32): PPL {e['ref']['ppl']:.3f}")
PY
