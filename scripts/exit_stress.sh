#!/usr/bin/env bash
# Run N two-rank tiny training jobs and count the ones that abort at exit
# ("terminate called without an active exception": a gloo worker taking the GIL during
# interpreter finalization; see deepshard/runtime/teardown.py). One CI run cannot show a
# 1-in-20 race; this loop can. Usage: scripts/exit_stress.sh [N=30] [ds_config.json]
# (default: stage 0 AdamW)
set -u
n=${1:-30}
root=$(cd "$(dirname "$0")/.." && pwd)
run=${DS_RUN:-$root/.venv/bin/ds-run}
cfg=$(mktemp --suffix=.json)
trap 'rm -f "$cfg"' EXIT
if [ $# -ge 2 ]; then
  cp "$2" "$cfg"
else
  echo '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}' > "$cfg"
fi
aborts=0 fails=0
for _ in $(seq "$n"); do
  out=$("$run" --num_gpus 2 "$root/examples/train_gpt.py" --deepspeed_config "$cfg" \
        --n_layer 1 --d_model 32 --n_head 2 --vocab_size 256 --seq_len 16 --steps 3 2>&1)
  rc=$?
  if grep -q "terminate called" <<<"$out"; then
    aborts=$((aborts + 1))
  elif [ "$rc" -ne 0 ]; then
    fails=$((fails + 1))
    tail -3 <<<"$out"
  fi
done
echo "exit_stress: $aborts aborted at exit, $fails failed otherwise, of $n jobs"
[ "$aborts" -eq 0 ] && [ "$fails" -eq 0 ]
