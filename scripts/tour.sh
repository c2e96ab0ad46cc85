#!/usr/bin/env bash
# The tour: every chapter's script, 00 to 07, on the CPU at its smallest world size, each
# checking itself against the single-device reference (--check). About 3 minutes on 2 idle
# cores (10 steps each).
#
#   scripts/tour.sh                 # every chapter, 10 steps each
#   STEPS=30 scripts/tour.sh 03 07  # some chapters, more steps
#
# Each run writes runs/tour_<chapter>/ (config.yaml, metrics.jsonl); the end prints one line
# per run and exits 1 if any failed. Overlay the curves with
#   python scripts/plot.py loss runs/tour_*/metrics.jsonl
set -uo pipefail
cd "$(dirname "$0")/.."

steps="${STEPS:-10}"
# chapter | processes | arguments (after the chapter's YAML config)
runs=(
  "00|1|"
  "01|2|"
  "02|2|--zero-stage 3"
  "03|2|"
  "04|2|"
  "05|2|"
  "06|2|"
  "07|4|--tp 2 --pp 2"
  "07|4|--tp 2 --cp 2 --sequence-parallel --activation-checkpointing"
  "07|4|--tp 2 --zero-stage 3"
  "07|4|--tp 2 --ep 2 --model.num_experts 4 --micro-batches 1"
)
selected=("$@")

results=()
failed=0
for run in "${runs[@]}"; do
  IFS="|" read -r chapter nproc args <<< "$run"
  if [[ ${#selected[@]} -gt 0 && ! " ${selected[*]} " =~ " ${chapter} " ]]; then
    continue
  fi
  script=$(ls examples/"${chapter}"_*.py 2>/dev/null | head -n 1)
  if [[ -z "$script" ]]; then
    results+=("MISSING $chapter (no examples/${chapter}_*.py)")
    failed=1
    continue
  fi
  name="tour_${chapter}$(echo "$args" | tr -cd '[:alnum:] ' | tr ' ' '_')"
  echo "=== $script on $nproc process(es): $args"
  # shellcheck disable=SC2086  # $args is a list of flags
  if scripts/launch.sh "$script" --nproc-per-node "$nproc" -- --steps "$steps" --check \
      --name "$name" $args; then
    results+=("ok      $chapter x$nproc $args")
  else
    results+=("FAILED  $chapter x$nproc $args")
    failed=1
  fi
done

echo
echo "=== tour summary (--steps $steps, --check: loss and weights within 1e-5 of one device)"
printf '%s\n' "${results[@]}"
exit "$failed"
