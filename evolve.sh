#!/usr/bin/env bash
# Q-Evolve's self-evolution loop (paper §1.1, Algorithm 1): BC on expert data, then ITERS iterations of
# collect -> relabel -> critic -> bppo; the BC policy and every iteration's are evaluated on seen and unseen tasks.
# Settings are environment variables, printed at start. Each stage writes RUN/<iter>/<stage>/ and a .done
# marker last, so running the same command again after a crash or Ctrl-C skips what is finished.
#   bash evolve.sh                         # default model, short ScienceWorld tasks, 2 iterations, CPU
#   SMOKE=1 bash evolve.sh                 # the whole loop on the tiny model and two tasks, in minutes
#   PRESET=7b ENV=alfworld bash evolve.sh  # Llama-2-7B-Chat, 4-bit QLoRA, all tasks, ETO's prompt: one 24 GB GPU
#   PROMPT=eto bash evolve.sh              # ETO's instruction and one-shot example (the paper's protocol), ETO's step caps
#   VARIANT=rft SEED=2 bash evolve.sh      # a baseline or ablation instead of Q-Evolve, another seed
#   NPROC=4 bash evolve.sh                 # every training stage and rollout as 4 processes (docs/scale.md)
#   REHEARSAL=1 bash evolve.sh             # PRESET=7b's 4-bit path on the tiny model and a few tasks, on a CPU
#   DRY_RUN=1 bash evolve.sh               # print the settings and every stage's command, run nothing
set -euo pipefail
cd "$(dirname "$0")"

if [ "${SMOKE:-0}" = 1 ]; then
  : "${MODEL:=tiny}" "${RUN:=runs/smoke}" "${NUM_DEMOS:=2}" "${NUM_TASKS:=2}" "${NUM_EVAL:=1}" "${SAMPLES:=2}" "${MAX_STEPS:=3}"
  : "${BC_EPOCHS:=1}" "${CRITIC_EPOCHS:=1}" "${TASKS:=find-non-living-thing lifespan-longest-lived}"
fi
# REHEARSAL=1: PRESET=7b's path (its flags, DEPARTURES=none, ETO's prompt, a 4-bit nf4 base with the policy's and
# the critic's LoRA adapters on it) on the tiny model and a few tasks, in minutes on a CPU (docs/scale.md)
if [ "${REHEARSAL:-0}" = 1 ]; then
  : "${PRESET:=7b}" "${MODEL:=tiny}" "${LOAD_IN_4BIT:=1}" "${RUN:=runs/rehearsal}" "${TASKS=lifespan-longest-lived}"
  : "${NUM_DEMOS:=2}" "${NUM_TASKS:=2}" "${NUM_EVAL:=1}" "${MAX_STEPS:=6}" "${MAX_NEW_TOKENS:=24}"  # short, for time
fi
# FULL_FINETUNE=1: the policy trains every weight, as the paper does (bc.py --full-finetune; bppo.py and the
# baselines go on with the checkpoint as it is), at full fine-tuning's rates: BC at ETO's 2e-5, BPPO at 2e-6. fp32
# weights and AdamW state, ~16 bytes a parameter: a 7B policy wants several GPUs, NPROC=N FSDP=1 (docs/scale.md).
# The critic stays a LoRA adapter on the base model.
case "${FULL_FINETUNE:=0}" in 0) ;; 1) : "${BPPO_LR:=2e-6}" ;;
  *) echo "FULL_FINETUNE=$FULL_FINETUNE: 0 (LoRA) or 1 (every weight)" >&2; exit 2 ;; esac
: "${ENV:=sciworld}"
# PRESET=7b: one 24 GB GPU, paper scale: every task of the env, 3 rollouts of each (the paper's stated protocol:
# ~100K env steps an ALFWorld iteration, where its Table 5 reports 13K; NUM_TASKS=N plays fewer, docs/scale.md),
# the paper's step caps (ALFWorld 30, ScienceWorld 24, WebShop 10; ETO's come with PROMPT=eto alone), the
# environment's real data or a clear refusal (STANDIN=1 accepts our generated games or mini shop).
if [ "${PRESET:-}" = 7b ]; then
  case "$ENV" in alfworld) cap=30 ;; webshop) cap=10 ;; *) cap=24 ;; esac
  : "${MODEL:=meta-llama/Llama-2-7b-chat-hf}" "${TASKS=}" "${NUM_DEMOS:=0}" "${NUM_TASKS:=0}" "${NUM_EVAL:=0}" "${MAX_STEPS=$cap}"
  : "${BC_EPOCHS:=3}" "${CRITIC_EPOCHS:=2}" "${BPPO_LR:=1e-5}" "${GRAD_ACCUM:=16}" "${BC_ACCUM:=16}" "${CRITIC_ACCUM:=16}"
  : "${MAX_NEW_TOKENS:=128}" "${SAMPLES:=3}" "${CRITIC_TAU:=0.005}" "${PROMPT:=eto}" "${DEPARTURES:=none}"
elif [ -n "${PRESET:-}" ]; then
  echo "PRESET=$PRESET: the only preset is 7b" >&2; exit 2
fi
# the paper's iterations: 3 on WebShop, 2 on ScienceWorld and ALFWorld
[ "$ENV" = webshop ] && : "${ITERS:=3}"
: "${MODEL:=smollm2-135m}" "${ITERS:=2}" "${RUN:=runs/evolve-$ENV}"
# PROMPT=eto: ETO's prompt (data/eto/) in expert data and rollouts, and ETO's step caps unless MAX_STEPS is set.
: "${PROMPT:=short}"
case "$PROMPT" in short) ;; eto) : "${MAX_STEPS=}" ;; *) echo "PROMPT=$PROMPT: use short or eto" >&2; exit 2 ;; esac
# The default: ScienceWorld's three lifespan families (walk outside, look, focus on the right animal: expert
# 2-12 steps; a wrong `focus on` ends the episode), sized so that the whole loop fits in 90 minutes on 2 CPU
# cores. Demonstrations come from the first NUM_DEMOS training variations, rollouts from the first NUM_TASKS of
# them. The critic takes a few dozen optimizer steps, so its target Q head tracks Q at CRITIC_TAU=0.1 (IQL's
# 0.005 assumes ~10^6 steps: it would leave Q̄ near its random init). An answer is cut at MAX_NEW_TOKENS: the
# expert's are at most 29 tokens, and a batched turn decodes as long as its longest answer, so rambling answers
# (a third of the BC policy's hit 128) set the pace. BC runs 8 epochs: after 3 the policy won 1 of 24 sampled
# rollouts, after 8 it wins about a third, at rates that differ by task, which the critic needs. See docs/loop.md.
: "${TASKS=lifespan-longest-lived lifespan-shortest-lived lifespan-longest-lived-then-shortest-lived}"
: "${NUM_DEMOS:=18}" "${NUM_TASKS:=12}" "${NUM_EVAL:=8}" "${SAMPLES:=2}" "${TEMPERATURE:=0.7}" "${MAX_STEPS=12}"
: "${BC_EPOCHS:=8}" "${CRITIC_EPOCHS:=1}" "${BPPO_EPOCHS:=1}" "${BPPO_LR:=1e-4}" "${NUM_ENVS:=8}" "${GRAD_ACCUM:=4}"
: "${BC_ACCUM:=2}" "${CRITIC_ACCUM:=1}" "${CRITIC_TAU:=0.1}" "${MAX_NEW_TOKENS:=48}"
: "${VARIANT:=qevolve}" "${PROCESS_REWARD:=gae}" "${GAE_LAMBDA:=0.95}" "${KEEP_SELF:=0}" "${CANDIDATES:=5}" "${SEED:=1}"
: "${EVAL:=every}"
# Task lists (data/tasks/: one family/variation a line) in place of ETO's splits, each empty by default: DEMO_TASKS
# the expert's tasks (its first NUM_DEMOS); TRAIN_TASKS the rollout pool, of which iteration k plays the k-th draw
# of NUM_TASKS fresh tasks (families in equal shares, the order seeded by SEED); EVAL_TASKS "NAME=FILE ..." the
# evaluation sets in place of seen and unseen, each into RUN/<iter>/eval/NAME.jsonl. The study's (docs/results.md):
#   DEMO_TASKS=data/tasks/lifespan-demos.txt TRAIN_TASKS=data/tasks/lifespan-pool.txt \
#   EVAL_TASKS=dev=data/tasks/lifespan-dev.txt NUM_DEMOS=30 NUM_TASKS=36 NUM_EVAL=0 bash evolve.sh
: "${DEMO_TASKS=}" "${TRAIN_TASKS=}" "${EVAL_TASKS=}"
# EXPERT="FILE ...": released expert trajectories (ETO's *_sft.json, AgentGym's, AgentTuning's: tools/import_expert.py)
# as the expert data, in place of the environment's planner, whose thoughts are templates ("I should X next.");
# the paper trains on ETO's GPT-4 ReAct trajectories. ENV_DATA: what the environment runs on here (python -m envs).
: "${EXPERT=}"
ENV_DATA=$(python -m envs data "$ENV") || exit 2
if [ "${PRESET:-}" = 7b ] && [[ "$ENV_DATA" =~ ^(generated|mini)$ ]] && [ "${STANDIN:-0}" != 1 ]; then
  echo "PRESET=7b ENV=$ENV: $(python -m envs data "$ENV" --why); STANDIN=1 runs on our $ENV_DATA stand-in instead" >&2
  exit 2
fi
if [ "${PRESET:-}" = 7b ] && [ -z "$EXPERT" ]; then
  echo "note: expert data from the $ENV planner with template thoughts, a departure (the paper: ETO's GPT-4 ReAct"\
       "trajectories); EXPERT=FILE takes released ones (docs/real-data.md)" >&2
fi
case "$EVAL" in every|last) ;; *) echo "EVAL=$EVAL: use every (BC and each iteration) or last (BC and the last)" >&2; exit 2 ;; esac
bc_extra=() critic_extra=() bppo_extra=()
bc_start=()  # BC from the base model (the baselines' continued BC takes its checkpoint as it is)
[ "$FULL_FINETUNE" = 1 ] && bc_start=(--full-finetune --lr 2e-5)
# BF16=1: the training stages' forward and backward passes in bfloat16 autocast, weights and optimizer state in
# fp32 (--bf16; 1.4x faster LoRA training on a CPU with AVX512-BF16; a 7B base is bf16 on CUDA anyway).
# Rollouts stay in the model's own dtype, so that greedy episodes do not depend on how rows are batched.
: "${BF16:=1}"
[ "$BF16" = 1 ] && { bc_extra+=(--bf16); critic_extra+=(--bf16); bppo_extra+=(--bf16); }
# LOAD_IN_4BIT=1: the base model in 4-bit nf4 with double quantization (QLoRA) in every stage, also on a CPU
# (bitsandbytes' CPU backend): PRESET=7b's path rehearsed on a small model (docs/scale.md). 0: never; empty: on
# CUDA only (each stage's default).
: "${LOAD_IN_4BIT=}"
quant=()
case "$LOAD_IN_4BIT" in "") ;; 1) quant=(--load-in-4bit True) ;; 0) quant=(--load-in-4bit False) ;;
  *) echo "LOAD_IN_4BIT=$LOAD_IN_4BIT: 1 (nf4), 0 (never) or empty (on CUDA)" >&2; exit 2 ;; esac
bc_extra+=("${quant[@]}") critic_extra+=("${quant[@]}") bppo_extra+=("${quant[@]}")
# What we add to the paper's algorithm for small data on a CPU, each a flag (docs/departures.md); PRESET=7b runs
# none of them (DEPARTURES=none). exact_fit: the critic's heads re-solved by least squares after training; heldout:
# 10% of the demonstrations kept out of BC and of the hybrid data kept out of critic training, for their
# diagnostics; adv_norm: advantages standardised per optimizer batch; adv_center: advantages less their mean over
# the whole dataset (BPPO then raises the better-than-average actions, lowers the rest); grad_clip: gradient norms
# clipped at 1 in the critic and BPPO; value_clip: V and Q kept within the data's returns where the critic
# bootstraps from them and where the process rewards read them.
: "${DEPARTURES=exact_fit heldout grad_clip value_clip}"
for departure in $DEPARTURES; do
  case "$departure" in
    none) ;;
    exact_fit) critic_extra+=(--refit-rounds 20) ;;
    heldout) bc_extra+=(--eval-frac 0.1) critic_extra+=(--heldout-frac 0.1) ;;
    adv_norm) bppo_extra+=(--normalize-adv) ;;
    adv_center) bppo_extra+=(--center-adv) ;;
    grad_clip) critic_extra+=(--max-grad-norm 1.0) bppo_extra+=(--max-grad-norm 1.0) ;;
    value_clip) critic_extra+=(--clip-values) ;;
    *) echo "DEPARTURES: $departure is none of exact_fit heldout adv_norm adv_center grad_clip value_clip (or none)" >&2; exit 2 ;;
  esac
done

relabel_flags=()
case "$VARIANT" in
  qevolve) ;;
  sft|rft) ;;  # baselines, each iteration BC continued for BPPO's number of steps: sft on the expert data alone,
               # rft (rejection-sampling fine-tuning) on it and the iteration's successful rollouts
  no_rr) relabel_flags=(--off) ;;  # the rest are the rows of the paper's Table 3
  no_wiql) critic_extra+=(--no-weights) ;;
  no_gae) PROCESS_REWARD=q_minus_v ;;
  no_pi) ;;  # no policy update: the BC policy, with the critic choosing among CANDIDATES sampled answers per step
  awr) bppo_extra+=(--objective awr) ;;
  *) echo "VARIANT=$VARIANT: use qevolve, sft, rft, no_pi, no_rr, no_wiql, no_gae or awr" >&2; exit 2 ;;
esac
critic_flags=(--process-reward "$PROCESS_REWARD" --gae-lambda "$GAE_LAMBDA" --epochs "$CRITIC_EPOCHS" --grad-accum "$CRITIC_ACCUM" --tau "$CRITIC_TAU"
              "${critic_extra[@]}")
bppo_flags=(--epochs "$BPPO_EPOCHS" --lr "$BPPO_LR" --grad-accum "$GRAD_ACCUM" "${bppo_extra[@]}")
settings=$(for v in ENV MODEL ITERS TASKS NUM_DEMOS NUM_TASKS NUM_EVAL SAMPLES TEMPERATURE MAX_STEPS BC_EPOCHS \
                    CRITIC_EPOCHS BPPO_EPOCHS BPPO_LR NUM_ENVS GRAD_ACCUM BC_ACCUM CRITIC_ACCUM CRITIC_TAU MAX_NEW_TOKENS VARIANT PROCESS_REWARD \
                    GAE_LAMBDA KEEP_SELF PROMPT DEMO_TASKS TRAIN_TASKS EVAL_TASKS EXPERT ENV_DATA DEPARTURES CANDIDATES BF16 LOAD_IN_4BIT FULL_FINETUNE SEED EVAL; do
  printf '%-15s %s\n' "$v" "${!v}"; done)
printf 'RUN            %s\n%s\n' "$RUN" "$settings"
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "DRY_RUN=1: the stages' commands, none run"
else
  mkdir -p "$RUN"
  if [ -f "$RUN/settings.txt" ] && [ "$(cat "$RUN/settings.txt")" != "$settings" ]; then
    echo "$RUN holds a run with other settings (see $RUN/settings.txt): choose another RUN, or delete it" >&2
    diff <(echo "$settings") "$RUN/settings.txt" >&2 || true
    exit 2
  fi
  echo "$settings" > "$RUN/settings.txt"
fi
select=(--env "$ENV" --prompt "$PROMPT")
[ -n "$MAX_STEPS" ] && select+=(--max-steps "$MAX_STEPS")
[ -n "$TASKS" ] && select+=(--task-names $TASKS)
[ "$NUM_DEMOS" != 0 ] && demo_tasks=(--num-tasks "$NUM_DEMOS") || demo_tasks=()
[ "$NUM_TASKS" != 0 ] && train_tasks=(--num-tasks "$NUM_TASKS") || train_tasks=()
[ "$NUM_EVAL" != 0 ] && eval_tasks=(--num-tasks "$NUM_EVAL") || eval_tasks=()
demo_sets=(--split train) train_sets=(--split train) eval_sets=(--split seen unseen)
[ -n "$DEMO_TASKS" ] && demo_sets=(--task-file "train=$DEMO_TASKS")
[ -n "$TRAIN_TASKS" ] && train_sets=(--task-file "train=$TRAIN_TASKS")
[ -n "$EVAL_TASKS" ] && eval_sets=(--task-file $EVAL_TASKS)

stage() {  # stage DIR COMMAND...: run COMMAND unless DIR/.done says it already finished; the marker holds its time
  local dir=$1 start=$SECONDS; shift
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "[dry]  $dir: $*"; return; fi
  if [ -f "$dir/.done" ]; then echo "[done] $dir"; return; fi
  mkdir -p "$dir" && echo "[run]  $dir: $*"
  "$@"
  echo "seconds $((SECONDS - start))" > "$dir/.done"
}
# evaluate ITER POLICY [CRITIC]: greedy episodes on seen and unseen tasks (or EVAL_TASKS' sets) in one process (the
# sets share its slots), into RUN/ITER/eval/<set>.jsonl; with a critic, its pick of CANDIDATES answers sampled at
# TEMPERATURE
evaluate() {
  local decode=(--temperature 0)
  [ -n "${3:-}" ] && decode=(--temperature "$TEMPERATURE" --rerank-with "$3" --candidates "$CANDIDATES")
  stage "$RUN/$1/eval" "${run[@]}" collect.py "${select[@]}" --policy "$2" "${eval_sets[@]}" "${eval_tasks[@]}" \
    --num-envs "$NUM_ENVS" --max-new-tokens "$MAX_NEW_TOKENS" "${decode[@]}" "${quant[@]}" --iteration "$1" \
    --out "$RUN/$1/eval/{split}.jsonl"
}

expert=$RUN/0/expert/train.jsonl
select+=(--seed "$SEED") bc_extra+=(--seed "$SEED") critic_flags+=(--seed "$SEED") bppo_flags+=(--seed "$SEED")
# Every stage writes metrics.jsonl and TensorBoard events (`tensorboard --logdir RUN` shows the whole loop);
# TRACK=1 also logs them to Weights & Biases (pip install wandb; WANDB_MODE=offline needs no account), one W&B
# run per stage, grouped by RUN. Tracking changes no result, so it is no setting.
if [ "${TRACK:-0}" = 1 ]; then
  select+=(--track) bc_extra+=(--track) critic_flags+=(--track) bppo_flags+=(--track)
  export WANDB_RUN_GROUP=${WANDB_RUN_GROUP:-$(basename "$RUN")}
fi
# NPROC=N: the training stages and the policy's rollouts as N data-parallel processes (accelerate launch; torchrun
# underneath, gloo on a CPU, NCCL on GPUs): the same optimizer steps as one process, each rollout run playing a
# shard of the episodes (docs/scale.md). Like TRACK it is no setting: it changes how the work is spread, not what
# is computed (up to float rounding, and which random numbers each sampled episode draws). FSDP=1 launches them
# with FSDP instead: a full fine-tuning's weights, gradients and optimizer state sharded over the processes.
: "${NPROC:=1}" "${FSDP:=0}"
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "NPROC=$NPROC: the number of processes, 1 or more" >&2; exit 2; }
[[ "$FSDP" =~ ^[01]$ ]] || { echo "FSDP=$FSDP: 0 (each process holds the whole model) or 1 (sharded)" >&2; exit 2; }
parallel=(--multi_gpu)
[ "$FSDP" = 1 ] && parallel=(--use_fsdp --fsdp_version 2)
run=(python)
[ "$NPROC" -gt 1 ] && run=(accelerate launch "${parallel[@]}" --num_processes "$NPROC" --num_machines 1
                           --mixed_precision no --dynamo_backend no)
if [ -n "$EXPERT" ]; then
  stage "$RUN/0/expert" python tools/import_expert.py $EXPERT --env "$ENV" "${demo_tasks[@]}" --out "$expert"
else
  stage "$RUN/0/expert" python collect.py "${select[@]}" --policy expert "${demo_sets[@]}" "${demo_tasks[@]}" --out "$expert"
fi
stage "$RUN/0/bc" "${run[@]}" bc.py --data "$expert" --model "$MODEL" --epochs "$BC_EPOCHS" --grad-accum "$BC_ACCUM" --out "$RUN/0/bc" \
  "${bc_start[@]}" "${bc_extra[@]}"
evaluate 0 "$RUN/0/bc"
# sft and rft take as many optimizer steps per iteration as BPPO does on a hybrid dataset of the demonstrations
# and SAMPLES rollouts of each training task, at BPPO's learning rate and batch: only the objective and data differ.
bppo_steps() {
  local n_demo=$NUM_DEMOS
  [ -f "$expert" ] && n_demo=$(wc -l < "$expert")
  local n_self=$(( (NUM_TASKS != 0 ? NUM_TASKS : n_demo) * SAMPLES ))
  echo $(( (n_demo + n_self + GRAD_ACCUM - 1) / GRAD_ACCUM * BPPO_EPOCHS ))
}
continue_bc() {  # continue_bc DIR DATA... [--successes-only]: the policy's BC continued, into DIR
  local dir=$1; shift
  stage "$dir" "${run[@]}" bc.py --init "$policy" --data "$@" --steps "$(bppo_steps)" --lr "$BPPO_LR" --schedule constant \
    --grad-accum "$GRAD_ACCUM" --out "$dir" "${bc_extra[@]}"
}
policy=$RUN/0/bc selves=() rerank=()
for it in $(seq 1 "$ITERS"); do
  d=$RUN/$it
  [ "$EVAL" = every ] || [ "$it" = "$ITERS" ] && eval_it=1 || eval_it=0
  if [ "$VARIANT" = sft ]; then  # more BC on the expert data: no rollouts
    continue_bc "$d/sft" "$expert"
    policy=$d/sft
    [ "$eval_it" = 1 ] && evaluate "$it" "$policy"
    continue
  fi
  draw=()  # from a pool: this iteration's own draw of fresh tasks
  [ -n "$TRAIN_TASKS" ] && [ "$NUM_TASKS" != 0 ] && draw=(--round "$it")
  stage "$d/collect" "${run[@]}" collect.py "${select[@]}" --policy "$policy" "${train_sets[@]}" "${train_tasks[@]}" "${draw[@]}" "${rerank[@]}" \
    --samples-per-task "$SAMPLES" --num-envs "$NUM_ENVS" --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" \
    "${quant[@]}" --iteration "$it" --out "$d/collect/self.jsonl"
  # paper §1.1: this iteration's self-generated data replaces the last one's; expert data stays
  [ "$KEEP_SELF" = 1 ] && selves+=("$d/collect/self.jsonl") || selves=("$d/collect/self.jsonl")
  if [ "$VARIANT" = rft ]; then  # BC on the expert data and the policy's own successful rollouts
    continue_bc "$d/rft" "$expert" "${selves[@]}" --successes-only
    policy=$d/rft
    [ "$eval_it" = 1 ] && evaluate "$it" "$policy"
    continue
  fi
  stage "$d/relabel" python relabel.py "$expert" "${selves[@]}" --out "$d/relabel/hybrid.jsonl" "${relabel_flags[@]}"
  stage "$d/critic" "${run[@]}" critic.py --data "$d/relabel/hybrid.jsonl" --policy "$policy" --out "$d/critic" \
    "${critic_flags[@]}"  # re-trained from scratch every iteration, on this iteration's data only
  if [ "$VARIANT" = no_pi ]; then  # the agent is the BC policy with this critic's pick; it collects the next data
    rerank=(--rerank-with "$d/critic" --candidates "$CANDIDATES")
    [ "$eval_it" = 1 ] && evaluate "$it" "$policy" "$d/critic"
    continue
  fi
  stage "$d/bppo" "${run[@]}" bppo.py --data "$d/critic/scored.jsonl" --policy "$policy" --reference "$RUN/0/bc" \
    --out "$d/bppo" "${bppo_flags[@]}"
  policy=$d/bppo  # the policy continues from the last iteration's
  [ "$eval_it" = 1 ] && evaluate "$it" "$policy"
done
# the results table and plot, where the time went, and RUN/report.html: the page to look inside the run
[ "${DRY_RUN:-0}" = 1 ] || { python tools/results.py "$RUN" "$ITERS" && python tools/stage_times.py "$RUN" &&
                             python tools/report.py "$RUN"; }
