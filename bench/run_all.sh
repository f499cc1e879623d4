#!/usr/bin/env bash
# The benchmark suite on this machine: rollouts (rollout.Engine vs ETO's one-episode loop, from a trained BC
# policy), critic training (one forward per trajectory vs per step), BPPO memory (shared base vs three models),
# the per-stage memory table (a 7B shape on a GPU; the tiny model on a CPU), and, given a loop's run folder,
# the minutes each of its stages took (from the .done markers).
#   POLICY=runs/evolve-sciworld/0/bc LOOP=runs/evolve-sciworld bash bench/run_all.sh
# Without POLICY the rollout benchmark trains evolve.sh's BC policy first (~8 min on 2 CPU cores, kept in OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${POLICY:=}" "${LOOP:=}" "${OUT:=runs/bench}"
mkdir -p "$OUT"
if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then shape=(--shape llama2-7b); else
  shape=(--shape tiny --tokens 512 --num-envs 2 --max-steps 2); fi
run() {  # run NAME COMMAND...: its full output to OUT/NAME.log, its summary lines kept for the table
  local name=$1; shift
  echo "[$name] $*" >&2
  SECONDS=0
  "$@" > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log" >&2; exit 1; }
  echo "### $name ($SECONDS s): $*" >> "$OUT/summary.md"
  grep -E '^\||ratio|speed-up|shared /|transitions/s|MB|tokens,|episodes of' "$OUT/$name.log" >> "$OUT/summary.md"
  echo >> "$OUT/summary.md"
}
: > "$OUT/summary.md"
policy=() && [ -n "$POLICY" ] && policy=(--policy "$POLICY")
run rollouts python bench/rollout_speed.py "${policy[@]}" --workdir "$OUT/rollouts"
run critic python bench/critic_speed.py --num-trajs 2
run bppo_memory python bench/bppo_memory.py
run stage_memory python bench/gpu_memory.py "${shape[@]}"
[ -n "$LOOP" ] && run loop_stages python tools/stage_times.py "$LOOP"
cat "$OUT/summary.md"
