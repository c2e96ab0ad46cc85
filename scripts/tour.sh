#!/usr/bin/env bash
# The tour: every chapter's script, 00 to 07 and 12, on the CPU at its smallest world size, each
# checking itself against the single-device reference (--check). About 3 minutes on 2 idle
# cores (10 steps each).
#
#   scripts/tour.sh                 # every chapter, 10 steps each
#   STEPS=30 scripts/tour.sh 03 07  # some chapters, more steps
#
# Each run writes runs/tour_<chapter>/ (config.yaml, metrics.jsonl, tour.log); the end prints
# one table (script, ranks, final loss, largest deviation from one device, wire bytes per step,
# seconds) and exits 1 if any run failed. Overlay the curves with
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
  "07|4|--tp 2 --cp 2 --sequence-parallel"
  "07|4|--tp 2 --zero-stage 3"
  "07|4|--tp 2 --ep 2 --model.num_experts 4 --micro-batches 1"
  "12|2|"
)
selected=("$@")

mkdir -p runs
table=runs/tour_runs.tsv  # one line per run; scripts/tour_summary.py makes the table
: > "$table"
for run in "${runs[@]}"; do
  IFS="|" read -r chapter nproc args <<< "$run"
  if [[ ${#selected[@]} -gt 0 && ! " ${selected[*]} " =~ " ${chapter} " ]]; then
    continue
  fi
  script=$(ls examples/"${chapter}"_*.py 2>/dev/null | head -n 1)
  if [[ -z "$script" ]]; then
    printf '%s\t%s\t%s\t%s\t0\t127\n' "$chapter" "$nproc" "$args" "runs/missing" >> "$table"
    continue
  fi
  name="tour_${chapter}$(echo "$args" | tr -cd '[:alnum:] ' | tr ' ' '_')"
  echo "=== $script on $nproc process(es): $args"
  start_ns=$(date +%s%N)
  # --overwrite: a tour run again moves the last tour's run aside (runs/NAME.old-<time>); the
  # log goes beside the run directory while it runs, so that move cannot take it along
  # shellcheck disable=SC2086  # $args is a list of flags
  scripts/launch.sh "$script" --nproc-per-node "$nproc" -- --steps "$steps" --check \
      --name "$name" --overwrite $args 2>&1 | tee "runs/$name.tour.log"
  code=${PIPESTATUS[0]}
  mkdir -p "runs/$name"
  mv "runs/$name.tour.log" "runs/$name/tour.log"
  ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
  seconds=$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(basename "$script" .py)" "$nproc" "$args" \
      "runs/$name" "$seconds" "$code" >> "$table"
done

echo
echo "=== tour summary (--steps $steps; each run --check'ed against one device)"
python scripts/tour_summary.py "$table"
