#!/usr/bin/env bash
# The GPU check: on a CUDA machine with the project installed, in under 10 minutes, each stage's peak GPU memory
# and speed on a Llama-2-7B-shaped model (random weights, 4-bit nf4) at 2048 tokens (bench/gpu_memory.py), and
# PRESET=7b's 4-bit loop on a few tasks (REHEARSAL=1, the default model) with its minutes per stage. Writes
# OUT/table.md (OUT: $OUT, else runs/gpu_check), the table docs/scale.md and README show.
#   bash bench/gpu_check.sh           # on a GPU
#   CPU=1 bash bench/gpu_check.sh     # the same steps on a CPU with tiny shapes, in minutes (what the tests run)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
export HF_HUB_OFFLINE=1
device=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
if [ "${CPU:-0}" = 1 ]; then
  memory=(--shape tiny --tokens 512 --num-envs 2 --max-steps 2) loop=(MODEL=tiny)
elif [ "$device" = CPU ]; then
  echo "no CUDA device here: CPU=1 runs the check's CPU version" >&2; exit 2
else
  memory=(--shape llama2-7b --tokens 2048) loop=(MODEL=smollm2-135m)
fi
start=$SECONDS
python bench/gpu_memory.py "${memory[@]}" --workdir "$out/memory" 2>&1 | tee "$out/memory.log"
rm -rf "$out/memory" "$out/loop"
env "${loop[@]}" REHEARSAL=1 RUN="$out/loop" bash evolve.sh > "$out/loop.log" 2>&1 || { tail -30 "$out/loop.log"; exit 1; }
{
  echo "# GPU check: $device, $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "Each stage on $(grep -m1 '^[a-z0-9-]*, ' "$out/memory.log")"
  echo
  sed -n '/^| stage |/,/^$/p' "$out/memory.log"
  echo
  echo "PRESET=7b's loop in 4-bit (REHEARSAL=1, ${loop[*]}), minutes per stage:"
  echo
  python tools/stage_times.py "$out/loop" | grep '^|'
  echo
  echo "Whole check: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s."
} > "$out/table.md"
cat "$out/table.md"
