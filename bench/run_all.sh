#!/usr/bin/env bash
# The benchmark suite on this machine: rollouts (batched + KV cache vs one env with re-prefill), critic
# training (one forward per trajectory vs per step), BPPO memory (shared base vs three models) and the
# per-stage memory table (a 7B shape on a GPU; the tiny model on a CPU). 11 minutes on 2 CPU cores.
#   bash bench/run_all.sh                 # POLICY=runs/evolve-sciworld/0/bc to time a trained policy
set -euo pipefail
cd "$(dirname "$0")/.."
: "${POLICY:=untrained}" "${OUT:=runs/bench}"
mkdir -p "$OUT"
if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then shape=(--shape llama2-7b); else
  shape=(--shape tiny --tokens 512 --num-envs 2 --max-steps 2); fi
run() {  # run NAME COMMAND...: its full output to OUT/NAME.log, its summary lines kept for the table
  local name=$1; shift
  echo "[$name] $*" >&2
  SECONDS=0
  "$@" > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log" >&2; exit 1; }
  echo "### $name ($SECONDS s): $*" >> "$OUT/summary.md"
  grep -E '^\||ratio|speed-up|shared /|transitions/s|MB|tokens,' "$OUT/$name.log" >> "$OUT/summary.md"
  echo >> "$OUT/summary.md"
}
: > "$OUT/summary.md"
run rollouts python bench/rollout_speed.py --policy "$POLICY" --num-envs 8 --num-tasks 8 --max-steps 6 --max-new-tokens 32
run critic python bench/critic_speed.py --num-trajs 2
run bppo_memory python bench/bppo_memory.py
run stage_memory python bench/gpu_memory.py "${shape[@]}"
cat "$OUT/summary.md"
