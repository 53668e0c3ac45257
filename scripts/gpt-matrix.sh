#!/usr/bin/env bash
# The GPT example at data 2 x stages 2 x tensor 2 under every schedule, with and without ZeRO-3 and sequence
# parallelism (3 AdamW steps each), against one device: one table row per run.
#   bash scripts/gpt-matrix.sh [python]
set -u
PY=${1:-.venv/bin/python}
printf '| schedule | ZeRO | sequence parallel | params + Adam (rel.) | loss | state per device / bound | result |\n'
printf '|---|---|---|---:|---:|---|---|\n'
for schedule in gpipe 1f1b 1f1b-fused; do
  for zero in 0 3; do
    for sp in "" --sequence-parallel; do
      out=$("$PY" examples/gpt_tensor.py --steps 3 --log-every 3 --schedule "$schedule" --zero "$zero" $sp 2>&1)
      params=$(grep -oP "over parameters and Adam's state, relative: \K\S+" <<<"$out")
      loss=$(grep -oP "loss over 3 steps: \K\S+" <<<"$out")
      held=$(grep -oP "held per device: \K\d+ bytes of its \d+ whole \(\S+; bound \d+" <<<"$out")
      printf '| %s | %s | %s | %s | %s | %s) | %s |\n' "$schedule" "$zero" "${sp:+yes}" "$params" "$loss" "$held" \
        "$(tail -n1 <<<"$out")"
    done
  done
done
