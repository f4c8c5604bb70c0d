#!/usr/bin/env bash
# The one prepared check for a lent GPU (the device tool lends one to some tasks, ~15 minutes in all):
#   1. hardware and versions                      -> $OUT/hardware.txt
#   2. tests/test_cuda.py on the GPU               -> $OUT/tests.log
#   3. attention speed on CUDA vs torch.nn         -> $OUT/attention.txt
#   4. the three full configs trained at once on the GPU, decoded and scored (scripts/benchmark.sh
#      --jobs 3 --no-speed --runs runs/gpu --out gpu; a safety stop of TRAIN_MINUTES)
#                                                  -> $OUT/bench.log, $OUT/gpu.tgz, $OUT/runs.tgz
# It ends within 9.5 minutes even when every phase runs into its timeout (one device call may run 10).
# The Multi30k files travel as real files, since data/multi30k here is a link; before the call, here:
#   mkdir -p .gpu_data && cp -L data/multi30k/*.gz .gpu_data/
# then: device run, command "bash scripts/gpu_check.sh", carry [".gpu_data"], timeout_s 600.
# Afterwards, here: `tar xzf runs.tgz` (runs/gpu/*/bench/result.json etc.; runs/ is git-ignored) and
# `tar xzf gpu.tgz` (the GPU runs' curves and heatmap; move them to docs/gpu/), then add the GPU rows
# (hardware "gpu: NAME") to docs/results.json beside the CPU rows and regenerate the report:
#   python scripts/benchmark.py report --results docs/results.json --doc docs/benchmarks.md --readme README.md \
#     --figure docs/training_multi30k_de_en.png ... --figure docs/gpu/training_multi30k_de_en.png ... \
#     runs/gpu/multi30k_de_en runs/gpu/multi30k_en_de runs/gpu/multi30k_en_fr
# Phases can be picked: scripts/gpu_check.sh tests speed train (default: all three). BENCH_ARGS adds
# options to benchmark.sh (BENCH_ARGS=--quick tries the whole script in a minute, on a CPU too).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
TRAIN_MINUTES="${TRAIN_MINUTES:-4}"
PHASES="${*:-tests speed train}"
mkdir -p "$OUT"
start=$SECONDS
log() { echo "gpu_check [$((SECONDS - start))s]: $*" >&2; }

# The device image has torch, sentencepiece, sacrebleu, typer, ... but no `python` name and no network:
# run from the source tree instead of pip-installing (datasets, not there, is only imported for hub data).
shim=$(mktemp -d)
ln -s "$(command -v python3)" "$shim/python"
export PATH="$shim:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ ! -e data/multi30k/train.de.gz && -d .gpu_data ]]; then
  rm -rf data/multi30k && mkdir -p data && ln -s "$PWD/.gpu_data" data/multi30k
fi

{ nvidia-smi; python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")'; nproc; } > "$OUT/hardware.txt" 2>&1
log "$(tail -2 "$OUT/hardware.txt" | head -1)"

if [[ $PHASES == *tests* ]]; then
  log "tests/test_cuda.py"
  timeout 120 python -m pytest tests/test_cuda.py -v -p no:cacheprovider > "$OUT/tests.log" 2>&1
  log "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
fi
if [[ $PHASES == *speed* ]]; then
  log "attention speed"
  for mask in padding causal; do
    timeout 30 python scripts/bench_attention.py --device cuda --mask "$mask" --repeats 50 >> "$OUT/attention.txt" 2>&1
    log "attention, $mask mask: exit $?"
  done
fi
if [[ $PHASES == *train* ]]; then
  log "full configs, three at once, at most $TRAIN_MINUTES minutes of training each"
  # its own --out, --doc and --readme: the CPU figures and report here stay as they are
  timeout $(( TRAIN_MINUTES * 60 + 150 )) scripts/benchmark.sh --jobs 3 --no-speed --runs runs/gpu --out gpu \
    --doc gpu/benchmarks.md --readme gpu/README.md --set train.max_minutes="$TRAIN_MINUTES" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  log "benchmark: exit $?"
  tail -n 3 runs/gpu/*/bench/log >> "$OUT/bench.log" 2>/dev/null
  tar czf "$OUT/gpu.tgz" gpu 2>/dev/null
  tar czf "$OUT/runs.tgz" runs/gpu/*/bench runs/gpu/*/metrics.jsonl runs/gpu/*/hyps runs/gpu/*/config.yaml \
    runs/gpu/*/scores.json 2>/dev/null
fi
log "done"
