#!/usr/bin/env bash
# The reproducible Multi30k report (issue 7): for each config prepare, train, average, decode the
# test set with beam 5 (best, averaged and, with train.ema_decay, ema checkpoints), score, measure
# time and peak memory; then the speed scripts; then docs/results.json, the `## Quality` section of
# docs/benchmarks.md, the `## Results` block of README.md, the training curves and one
# cross-attention heatmap. Resumable: a run whose bench/result.json exists is skipped, an
# interrupted training continues with --resume. A training stopped by train.max_minutes counts as
# finished; to take it further, move its RUNS/<run name>/bench folder aside and run the same command
# with a larger --set train.max_minutes: it continues with --resume. Progress goes to stderr.
#
#   scripts/benchmark.sh                       # de-en, en-de, en-fr with the shipped configs -> docs/
#   scripts/benchmark.sh --jobs 3 --no-speed   # the same, three trainings at once
#   scripts/benchmark.sh --seeds 2 --jobs 3    # also seed 2 of each config, and the 2-model ensembles
#   scripts/benchmark.sh --configs configs/multi30k_de_en_cpu60.yaml
#   scripts/benchmark.sh --quick               # smoke test: configs/smoke.yaml, 60 updates, output in /tmp
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/benchmark.sh [options]
  --configs "A.yaml B.yaml"  configs to run (default: configs/multi30k_{de_en,en_de,en_fr}.yaml;
                             --quick: configs/smoke.yaml)
  --quick                    smoke mode: tiny limits (train.max_steps=60), output under
                             ${TMPDIR:-/tmp}/tcli-bench-quick unless --out/--runs are given
  --set KEY=VALUE            config override passed to tcli train (repeatable), e.g. train.device=cuda
  --runs DIR                 where the run dirs go (default: runs/bench)
  --out DIR                  where results.json, speed.json and the PNGs go (default: docs)
  --doc FILE                 the Markdown file whose "## Quality" section is regenerated
                             (default: docs/benchmarks.md; --quick: OUT/benchmarks.md)
  --readme FILE              the README whose "## Results" block is regenerated
                             (default: README.md; --quick: OUT/README.md)
  --average N                average the last N periodic checkpoints (default: 5)
  --beam N                   beam size for the test set (default: 5)
  --no-speed                 skip scripts/bench_train.py and scripts/bench_decode.py
  --jobs N                   run up to N trainings at once (default: 1); each one's progress then
                             goes to RUNS/<run name>/bench/log. Give each run its own core
                             (train.threads: 1 in the config, or --set train.threads=1)
  --seeds N                  also train each config with train.seed=2..N (RUNS/<config name>_seedK)
                             and decode the test set with the ensemble of the N runs (default: 1)
  --force                    redo finished runs (tcli train --overwrite) and the speed runs
EOF
}

cd "$(dirname "$0")/.."
QUICK=0 FORCE=0 SPEED=1 AVERAGE=5 BEAM=5 JOBS=1 SEEDS=1 CONFIGS="" RUNS="" OUT="" DOC="" README=""
SETS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --configs) CONFIGS="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --set) SETS+=("$2"); shift 2 ;;
    --runs) RUNS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --doc) DOC="$2"; shift 2 ;;
    --readme) README="$2"; shift 2 ;;
    --average) AVERAGE="$2"; shift 2 ;;
    --beam) BEAM="$2"; shift 2 ;;
    --no-speed) SPEED=0; shift ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --seeds) SEEDS="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "benchmark: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

MODE=full
if [[ $QUICK == 1 ]]; then
  MODE=quick
  QROOT="${TMPDIR:-/tmp}/tcli-bench-quick"
  CONFIGS="${CONFIGS:-configs/smoke.yaml}"
  RUNS="${RUNS:-$QROOT/runs}"
  OUT="${OUT:-$QROOT/docs}"
  AVERAGE=2
  # tiny limits: the point is that every step runs, not the scores
  SETS=(train.max_steps=60 train.valid_every=30 train.log_every=10 train.keep_last=3 ${SETS[@]+"${SETS[@]}"})
fi
CONFIGS="${CONFIGS:-configs/multi30k_de_en.yaml configs/multi30k_en_de.yaml configs/multi30k_en_fr.yaml}"
RUNS="${RUNS:-runs/bench}"
OUT="${OUT:-docs}"
DOC="${DOC:-$([[ $QUICK == 1 ]] && echo "$OUT/benchmarks.md" || echo docs/benchmarks.md)}"
mkdir -p "$RUNS" "$OUT"
if [[ $QUICK == 1 && ! -f $DOC ]]; then cp docs/benchmarks.md "$DOC"; fi
README="${README:-$([[ $QUICK == 1 ]] && echo "$OUT/README.md" || echo README.md)}"
if [[ $QUICK == 1 && ! -f $README ]]; then cp README.md "$README"; fi

log() { echo "benchmark: $*" >&2; }

# `tcli` from PATH only when it runs this checkout's code: an install from another clone would be
# measured (and recorded) instead. `python -m` from here imports ./transformer_cli.
TCLI=(python -m transformer_cli)
if command -v tcli >/dev/null 2>&1; then
  if [[ "$(tcli info 2>/dev/null | sed -n 's/^package //p')" == "$(pwd -P)/transformer_cli" ]]; then
    TCLI=(tcli)
  else
    log "the tcli on PATH runs another copy of the code; using python -m transformer_cli from $(pwd -P)"
  fi
fi
PY=(python scripts/benchmark.py)
SET_ARGS=()
for s in ${SETS[@]+"${SETS[@]}"}; do SET_ARGS+=(--set "$s"); done

step_start=$SECONDS
elapsed() { echo "$((SECONDS - step_start))s"; }

# run_name CONFIG SEED: the config's name, with _seedK for an extra seed (--seeds)
run_name() {
  local stem
  stem=$(basename "$1" .yaml)
  if (( $2 > 1 )); then echo "${stem}_seed$2"; else echo "$stem"; fi
}

# run_config CONFIG SEED: train (seed 1 = the config's own seed), average, decode (best, averaged, ema), record
run_config() {
  local config=$1 seed=$2 stem run bench n ck
  stem=$(run_name "$config" "$seed")
  run="$RUNS/$stem"
  bench="$run/bench"
  local plot=1 seed_args=()
  if (( seed > 1 )); then plot=0; seed_args=(--set "train.seed=$seed"); fi  # curves of the config's run only
  if [[ -f $bench/result.json && $FORCE == 0 ]]; then
    log "$stem: skipped, $bench/result.json exists (--force to redo)"
    # the curves may have gone to another --out in the run that measured it
    if [[ $plot == 1 && ! -f $OUT/training_$stem.png ]]; then
      "${TCLI[@]}" plot --run-dir "$run" -o "$OUT/training_$stem.png" >&2
    fi
    return
  fi
  mkdir -p "$bench"
  local train=("${TCLI[@]}" train --config "$config" --run-dir "$run" ${SET_ARGS[@]+"${SET_ARGS[@]}"}
               ${seed_args[@]+"${seed_args[@]}"})
  if [[ $FORCE == 1 ]]; then
    rm -f "$bench"/*.json "$bench"/*.tmp "$bench"/train.stdout
    train+=(--overwrite)
  elif [[ -f $bench/train.stdout ]]; then
    log "$stem: training already finished ($bench/train.stdout)"
    train=()
  elif [[ -d $run/checkpoints/last ]]; then
    log "$stem: continuing the interrupted training"
    train+=(--resume)
  fi
  if [[ ${#train[@]} -gt 0 ]]; then
    log "$stem: ${train[*]}"
    "${PY[@]}" measure --json "$bench/train.measure.json" -- "${train[@]}" > "$bench/train.stdout.tmp"
    mv "$bench/train.stdout.tmp" "$bench/train.stdout"
    log "$stem: trained ($(elapsed)): $(cat "$bench/train.stdout")"
  fi

  n=$("${PY[@]}" steps "$run")
  (( n > AVERAGE )) && n=$AVERAGE
  local checkpoints=(best)
  if (( n > 0 )); then
    "${TCLI[@]}" average --run-dir "$run" --last "$n" >&2
    checkpoints+=(averaged)
  fi
  if [[ -d $run/checkpoints/ema ]]; then checkpoints+=(ema); fi  # train.ema_decay > 0
  for ck in "${checkpoints[@]}"; do
    log "$stem: decoding the test set with the $ck checkpoint, beam $BEAM"
    "${PY[@]}" measure --json "$bench/eval.$ck.measure.json" -- \
      "${TCLI[@]}" eval --run-dir "$run" --split test --checkpoint "$ck" --beam "$BEAM" --json --quiet \
      > "$bench/eval.$ck.json.tmp"
    mv "$bench/eval.$ck.json.tmp" "$bench/eval.$ck.json"
  done
  # train.cycles > 1: the cycle snapshots decode together, an ensemble from this one run
  local snapshots=() cycles=() last_cycle k name
  for ((k = 1; k < 100; k++)); do
    [[ -d $run/checkpoints/cycle_$k ]] || break
    cycles+=("cycle_$k")
  done
  if (( ${#cycles[@]} > 1 )); then
    last_cycle=${cycles[${#cycles[@]} - 1]}  # decoded as --checkpoint, the others as --ensemble
    for ck in "${cycles[@]:0:${#cycles[@]} - 1}"; do snapshots+=(--ensemble "$run/checkpoints/$ck"); done
    name="$last_cycle.ensemble${#cycles[@]}"
    log "$stem: decoding the test set with the ensemble of its ${#cycles[@]} cycle snapshots, beam $BEAM"
    "${PY[@]}" measure --json "$bench/eval.$name.measure.json" -- \
      "${TCLI[@]}" eval --run-dir "$run" --split test --checkpoint "$last_cycle" "${snapshots[@]}" --beam "$BEAM" \
      --json --quiet > "$bench/eval.$name.json.tmp"
    mv "$bench/eval.$name.json.tmp" "$bench/eval.$name.json"
  fi
  if [[ $plot == 1 ]]; then "${TCLI[@]}" plot --run-dir "$run" -o "$OUT/training_$stem.png" >&2; fi
  "${PY[@]}" record --run-dir "$run" --config "$config" --mode "$MODE"
  log "$stem: done ($(elapsed))"
}

# ensemble_config CONFIG: decode the test set with the ensemble of the config's SEEDS runs
ensemble_config() {
  local config=$1 stem run bench ck name k member stale=0 members=()
  stem=$(basename "$config" .yaml)
  run="$RUNS/$stem"
  bench="$run/bench"
  ck=best; [[ -d $run/checkpoints/averaged ]] && ck=averaged
  name="$ck.ensemble$SEEDS"
  for ((k = 1; k <= SEEDS; k++)); do
    member="$RUNS/$(run_name "$config" "$k")"
    (( k > 1 )) && members+=(--ensemble "$member")
    # a member trained further (--resume) since the ensemble was decoded makes that decode stale
    [[ $member/checkpoints/$ck/model.safetensors -nt $bench/eval.$name.json ]] && stale=1
  done
  if [[ ! -f $bench/eval.$name.json || $stale == 1 || $FORCE == 1 ]]; then
    log "$stem: decoding the test set with the ensemble of $SEEDS seeds ($ck checkpoints), beam $BEAM"
    "${PY[@]}" measure --json "$bench/eval.$name.measure.json" -- \
      "${TCLI[@]}" eval --run-dir "$run" --split test --checkpoint "$ck" "${members[@]}" --beam "$BEAM" --json \
      --quiet > "$bench/eval.$name.json.tmp"
    mv "$bench/eval.$name.json.tmp" "$bench/eval.$name.json"
  fi
  "${PY[@]}" record --run-dir "$run" --config "$config" --mode "$MODE"
}

[[ $JOBS =~ ^[1-9][0-9]*$ ]] || { log "--jobs must be a positive integer, got '$JOBS'"; exit 2; }
[[ $SEEDS =~ ^[1-9][0-9]*$ ]] || { log "--seeds must be a positive integer, got '$SEEDS'"; exit 2; }
for config in $CONFIGS; do
  [[ -f $config ]] || { log "config $config not found"; exit 2; }
done
TASKS=()  # CONFIG:SEED, every seed of a config next to each other
for config in $CONFIGS; do
  for ((k = 1; k <= SEEDS; k++)); do TASKS+=("$config:$k"); done
done
if (( JOBS == 1 )); then
  for task in "${TASKS[@]}"; do run_config "${task%:*}" "${task##*:}"; done
else
  # Each training in a background subshell that leaves its exit status in bench/exit; at most JOBS
  # run at once. Every run finishes (or fails) before the report, which needs them all.
  for task in "${TASKS[@]}"; do
    while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
    stem=$(run_name "${task%:*}" "${task##*:}")
    mkdir -p "$RUNS/$stem/bench"
    rm -f "$RUNS/$stem/bench/exit"
    log "$stem: started, progress in $RUNS/$stem/bench/log"
    # appended, not truncated: a rerun that skips a finished run keeps the log of its training
    (set +e; (set -e; run_config "${task%:*}" "${task##*:}") 2>> "$RUNS/$stem/bench/log"
     echo $? > "$RUNS/$stem/bench/exit") &
  done
  wait
  failed=0
  for task in "${TASKS[@]}"; do
    stem=$(run_name "${task%:*}" "${task##*:}")
    status=$(cat "$RUNS/$stem/bench/exit" 2>/dev/null || echo "?")
    if [[ $status != 0 ]]; then
      log "$stem: failed (exit $status); the end of $RUNS/$stem/bench/log:"
      tail -n 5 "$RUNS/$stem/bench/log" >&2 || true
      failed=1
    else
      log "$stem: done"
    fi
  done
  (( failed == 0 )) || exit 1
fi
if (( SEEDS > 1 )); then
  for config in $CONFIGS; do ensemble_config "$config"; done
fi

# One cross-attention heatmap: the first config's run, the averaged checkpoint when there is one.
first=$(basename "${CONFIGS%% *}" .yaml)
ck=best; [[ -d $RUNS/$first/checkpoints/averaged ]] && ck=averaged
text=$("${PY[@]}" sample-source "$RUNS/$first")
"${TCLI[@]}" attention --run-dir "$RUNS/$first" --checkpoint "$ck" --text "$text" -o "$OUT/attention_$first.png" >&2
FIGURES=()
for config in $CONFIGS; do FIGURES+=(--figure "$OUT/training_$(basename "$config" .yaml).png"); done
FIGURES+=(--figure "$OUT/attention_$first.png")

SPEED_ARGS=()
if [[ $SPEED == 1 ]]; then
  mkdir -p "$RUNS/speed"
  if [[ -f scripts/bench_train.py ]]; then
    if [[ $QUICK == 1 ]]; then targs=(--steps 2 --rounds 1 --no-rss); else targs=(--steps 40 --rounds 4); fi
    tcmd=(python scripts/bench_train.py "${targs[@]}" --run-dir "$RUNS/speed/bench_train")
    if [[ ! -f $RUNS/speed/train.log || $FORCE == 1 ]]; then
      log "training speed: ${tcmd[*]}"
      "${tcmd[@]}" > "$RUNS/speed/train.log.tmp"
      mv "$RUNS/speed/train.log.tmp" "$RUNS/speed/train.log"
    fi
    SPEED_ARGS+=(--train-log "$RUNS/speed/train.log" --train-cmd "${tcmd[*]}")
  fi
  if [[ -f scripts/bench_decode.py ]]; then
    # decoding speed of the model just trained (the first config's averaged or best checkpoint)
    if [[ $QUICK == 1 ]]; then dargs=(--limit 10 --repeats 1 --per-token-sentences 1); else dargs=(--repeats 3); fi
    dcmd=(python scripts/bench_decode.py --run-dir "$RUNS/$first" --checkpoint "$ck" "${dargs[@]}")
    if [[ ! -f $RUNS/speed/decode.log || $FORCE == 1 ]]; then
      log "decoding speed: ${dcmd[*]}"
      "${dcmd[@]}" > "$RUNS/speed/decode.log.tmp"
      mv "$RUNS/speed/decode.log.tmp" "$RUNS/speed/decode.log"
    fi
    SPEED_ARGS+=(--decode-log "$RUNS/speed/decode.log" --decode-cmd "${dcmd[*]}")
  else
    log "scripts/bench_decode.py not found: no decoding-speed table"
  fi
  "${PY[@]}" speed --out "$OUT/speed.json" ${SPEED_ARGS[@]+"${SPEED_ARGS[@]}"}
  SPEED_ARGS=(--speed "$OUT/speed.json")
fi

RUN_DIRS=()
for task in "${TASKS[@]}"; do RUN_DIRS+=("$RUNS/$(run_name "${task%:*}" "${task##*:}")"); done
"${PY[@]}" report --results "$OUT/results.json" --doc "$DOC" --readme "$README" ${SPEED_ARGS[@]+"${SPEED_ARGS[@]}"} \
  "${FIGURES[@]}" "${RUN_DIRS[@]}"
log "finished in $(elapsed) ($MODE mode): $OUT/results.json, $DOC, $README"
