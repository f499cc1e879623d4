"""Collect trajectories in a real text environment (paper §1.3), and evaluate a policy.

The policy plays each task of a split `--samples-per-task` times (the paper: 3 per training task); every
episode is kept, success or failure:

    python collect.py --env sciworld --policy runs/bc --split train --samples-per-task 3 --temperature 0.7 \
        --out data/iter1_self.jsonl
    python collect.py --env sciworld --policy runs/bc --split seen --temperature 0 --out runs/eval/bc_seen.jsonl

With `--policy expert` the environment's own expert plays instead (ScienceWorld's gold path, ALFWorld's
planner, WebShop's scripted purchase), each step with a short templated thought: ReAct expert data.

Speed: `--num-envs` episodes are in flight on one batch of the model (rollout.Engine): when one ends its slot
takes the next task, the system prompt is prefilled once for all, and each conversation keeps its KV cache
between turns; at temperature 0 it plays the episodes ETO's one-at-a-time loop plays (rollout.play_one), faster
(bench/rollout_speed.py).
An episode whose chat would outgrow `--max-length` ends there, so that every chat written here fits the
training stages (same limit). An episode that the step cap or that limit cut before its task ended is written
with `"truncated": true` and, when it fits, the observation after its last step as a final user turn: the
critic bootstraps from the value of that state, where an ended task bootstraps from 0.
Trajectories are appended one line per episode and flushed; a rerun with the same --out skips the ids
already written, so a killed run loses at most the episodes in flight.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import chat
import common
import models
from envs import ENVS, Task, TextEnv, draw_tasks, make_env, read_task_list
from rollout import Conversation, Engine, Reranker, env_step, for_rollouts, trajectory
from envs.sciworld import eto_task_name


@dataclass
class Args:
    env: Literal[ENVS]
    out: str
    """trajectory JSONL to append to (created if missing); the summary goes next to it. `{split}` in it is
    replaced by each split's name"""
    policy: str = "expert"
    """'expert' (the environment's expert) or a policy checkpoint folder (bc.py / bppo.py output)"""
    split: tuple[Literal["train", "seen", "unseen"], ...] = ("train",)
    """train | seen (dev) | unseen (test); several (`--split seen unseen`) play in one run, sharing the model and
    the slots, each split into its own file: --out then holds `{split}`"""
    task_file: tuple[str, ...] = ()
    """task lists in place of --split: NAME=FILE (or FILE, named by its stem), one `family/variation` a line
    (data/tasks/); each list plays into --out with `{split}` replaced by its NAME, its trajectories labelled NAME"""
    round: int | None = None
    """with --task-file and --num-tasks N: play the R-th draw of N tasks from the list, fresh tasks every round
    and the families in equal shares (envs.draw_tasks, in an order seeded by --seed); evolve.sh's iteration"""
    task_names: tuple[str, ...] = ()
    """keep only these task families (ScienceWorld tasks, ALFWorld task types, WebShop categories)"""
    num_tasks: int | None = None
    """play only the first N tasks of the split (default: all); with the expert, the first N it can finish"""
    samples_per_task: int = 1
    """episodes per task (the paper samples 3 per training task)"""
    max_steps: int | None = None
    """step cap per episode (default: the paper's, ScienceWorld 24 / ALFWorld 30 / WebShop 10; with --prompt eto
    ETO's: ALFWorld 40, WebShop 10, ScienceWorld 10-120 by task)"""
    prompt: Literal[chat.PROMPTS] = "short"
    """short (our system prompt) | eto (ETO's instruction and one-shot example, the paper's protocol); expert
    data and the policy's rollouts must use the same"""
    temperature: float = 0.7
    """sampling temperature; 0 = greedy (evaluation)"""
    max_new_tokens: int = 128
    """longest answer per turn, in tokens"""
    max_length: int = 4096
    """longest chat in tokens (or the model's context if shorter): an episode whose next turn would not fit
    ends there, unfinished, as the training stages refuse longer chats (their --max-length, same default)"""
    num_envs: int = 8
    """episodes in flight (rows of the model's batch), each with its own environment"""
    rerank_with: str | None = None
    """a critic checkpoint (critic.py output): at every step sample --candidates answers and play the one with
    the highest Q; the paper's "w/o PI" row (the critic only at test time) and a Best-of-N baseline"""
    candidates: int = 5
    """answers sampled per step with --rerank-with (at --temperature, which must be > 0)"""
    merge_lora: bool = True
    """play with the LoRA adapter merged into the weights (unquantized models; the same policy up to float
    rounding, ~15% faster); off: the adapter as trained, as under --rerank-with and with a 4-bit base"""
    load_in_4bit: bool | None = None
    """4-bit nf4 base; default: on with CUDA, off on CPU"""
    iteration: int = 0
    """self-evolution iteration written into each trajectory (0 = expert / BC data)"""
    track: bool = False
    """also log to Weights & Biases (<out>.logs/ always holds metrics.jsonl and TensorBoard events)"""
    shard: str | None = None
    """I/N: play every N-th episode from the I-th (0-based) into <out>.shardIofN.jsonl; the last of the N shards
    to finish merges them into --out. Under a data-parallel launch (`accelerate launch`, WORLD_SIZE > 1) each
    process is the shard of its rank"""
    seed: int = 1
    threads: int | None = None
    """CPU threads for torch (default: torch's choice)"""


def step_cap(args: Args, env: TextEnv, task: Task, paper_cap: int) -> int:
    """--max-steps, else ETO's cap under --prompt eto (its task configs and ScienceWorld table), else the paper's."""
    if args.max_steps:
        return args.max_steps
    if args.prompt != "eto":
        return paper_cap
    if env.name == "sciworld":
        return eto_sciworld_caps()[task.name]
    return {"alfworld": 40, "webshop": 10}[env.name]


@functools.cache
def eto_sciworld_caps() -> dict[str, int]:
    table = json.loads((chat.ETO_DIR / "data_sciworld_max_steps.json").read_text())
    return {eto_task_name(name): cap for name, cap in table.items()}


def play_expert(env: TextEnv, task: Task, traj_id: str, iteration: int, prompt: chat.Prompt) -> dict | None:
    """One expert episode as a trajectory; None when the expert's path is longer than the step cap."""
    obs0, info = env.reset(task)
    if (env.expert_steps() or 0) > env.max_steps:
        return None  # no policy could match it within the cap either, so it is no demonstration
    messages = prompt.first(info["instruction"], obs0)
    steps, score, won = [], info.get("score", 0.0), False
    for t in range(env.max_steps):
        action = env.expert_action()
        if action is None:
            break
        text = chat.react(env.think(action), action)
        messages.append({"role": "assistant", "content": text})
        step, step_info = env_step(env, text, t)
        score, won = step_info["score"], step_info["won"]
        steps.append(step)
        if step["done"]:
            break
        messages.append(prompt.observation(step["observation"]))
    if not steps:
        return None
    return trajectory(env, task, traj_id, "expert", iteration, info, obs0, messages, steps, score, won)


def task_sets(env: TextEnv, args: Args) -> dict[str, list[Task]]:
    """{name: tasks}: each --split's tasks, or each --task-file's (its --round draw), of the families in
    --task-names (all when it is empty)."""
    if args.task_file:
        named = [f.split("=", 1) if "=" in f else (Path(f).stem, f) for f in args.task_file]
        sets = {name: read_task_list(path, env, name) for name, path in named}
    else:
        sets = {split: env.tasks(split) for split in args.split}
    for name, tasks in sets.items():
        if args.task_names:
            known = sorted({t.name for t in tasks})
            if unknown := [n for n in args.task_names if n not in known]:
                raise common.UserError(f"--task-names {' '.join(unknown)}: not in {args.env} {name}; "
                                       f"its families are: {' '.join(known)}")
            sets[name] = tasks = [t for t in tasks if t.name in args.task_names]
        if args.round is not None:
            sets[name] = draw_tasks(tasks, args.num_tasks, args.round, args.seed)
    return sets


def summarize(trajs: list[dict], split: str, args: Args) -> dict:
    n = max(len(trajs), 1)
    return {"env": args.env, "split": split, "policy": args.policy, "rerank_with": args.rerank_with,
            "candidates": args.candidates if args.rerank_with else 1, "episodes": len(trajs),
            "reward_x100": 100 * sum(t["reward"] for t in trajs) / n,
            "success_rate": sum(t["success"] for t in trajs) / n,
            "mean_steps": sum(len(t["steps"]) for t in trajs) / n,
            "env_steps": sum(len(t["steps"]) for t in trajs), "cut": sum(t.get("truncated", False) for t in trajs)}


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    shard, shards = which_shard(args)
    common.seed_everything(args.seed + shard)  # shards sample independently of each other
    check_args(args)
    reranker = None
    if args.policy != "expert":
        model, tok, base_model = models.load_policy(args.policy, args.load_in_4bit)
        if args.rerank_with:
            reranker = Reranker(args.rerank_with, model, base_model)
        model.eval()
    envs = [make_env(args.env) for _ in range(1 if args.policy == "expert" else args.num_envs)]
    prompt, paper_cap = chat.Prompt(args.prompt, args.env, envs[0].system_prompt), envs[0].max_steps
    tasks = task_sets(envs[0], args)
    outs = {split: Path(args.out.replace("{split}", split)) for split in tasks}
    mine = {split: shard_file(out, shard, shards) for split, out in outs.items()}  # where this process writes
    done_ids = {t["id"] for out in [*outs.values(), *mine.values()] if out.exists()
                for t in common.read_jsonl(out, allow_empty=True)}
    for out in outs.values():
        out.parent.mkdir(parents=True, exist_ok=True)
        if shard == 0:
            common.write_json(out.with_suffix(".args.json"), vars(args))

    # the first --num-tasks tasks of each split, --samples-per-task times; with the expert, the tasks after them
    # take the place of those whose expert path is longer than the cap
    target = {split: min(args.num_tasks or len(ts), len(ts)) for split, ts in tasks.items()}
    extra = {split: iter(ts[target[split]:]) for split, ts in tasks.items()}
    source = "expert" if args.policy == "expert" else "policy"
    todo = [(task, f"{task.key}/{source}{k}") for split, ts in tasks.items() for task in ts[:target[split]]
            for k in range(args.samples_per_task)]
    ours = todo[shard::shards]
    pending = [(task, i) for task, i in ours if i not in done_ids]
    logs = Path(args.out.replace("{split}", "_".join(tasks))).with_suffix(".logs")
    if shards > 1:
        logs = logs / f"shard{shard}of{shards}"
    tracker = common.Tracker(logs / "metrics.jsonl", logs, args, resumed_step=len(ours) - len(pending), on=True)
    bar = tqdm(total=len(ours), initial=len(ours) - len(pending), desc=f"{args.env} {' '.join(tasks)}",
               unit="episode")
    won, steps, skipped, too_long, t0 = 0, 0, 0, 0, time.time()

    def record(traj: dict) -> None:  # one line per episode, flushed: a killed run loses the episodes in flight
        nonlocal won, steps
        common.append_jsonl(mine[traj["split"]], traj)
        won, steps = won + traj["success"], steps + len(traj["steps"])
        bar.update()
        bar.set_postfix(success=f"{won}/{bar.n}", steps_per_s=f"{steps / (time.time() - t0):.1f}")
        tracker.log(bar.n, charts={"episode_reward": traj["reward"], "episode_success": float(traj["success"]),
                                   "episode_steps": len(traj["steps"]), "env_steps_per_s": steps / (time.time() - t0)})

    if args.policy == "expert":
        skipped = play_experts(envs[0], pending, extra, args, prompt, paper_cap, record, bar)
    else:
        limit = models.length_limit(args.max_length, model)
        model = for_rollouts(model, merge=args.merge_lora and reranker is None)

        def episode(task: Task, traj_id: str, env: TextEnv) -> Conversation:  # on whichever environment is free
            env.max_steps = step_cap(args, env, task, paper_cap)
            return Conversation(env, task, traj_id, tok, limit - args.max_new_tokens, limit, prompt)

        engine = Engine(model, tok, args.max_new_tokens, args.temperature, reranker, args.candidates)
        for conv in engine.play(envs, (functools.partial(episode, task, i) for task, i in pending)):
            record(conv.result(args.iteration))
            too_long += conv.too_long
    bar.close()
    for env in envs:
        env.close()
    notes(args, steps, time.time() - t0, too_long, skipped)
    if shards > 1 and not merge_shards(outs, shard, shards):
        print(f"shard {shard}/{shards} done; the last shard to finish merges the shards into {args.out}")
        tracker.close()
        return
    ids = {i for _, i in todo}
    for split, out in outs.items():
        summary = report(out, [t for t in common.read_jsonl(out, allow_empty=True) if t["id"] in ids or
                               source == "expert"], split, args)
        group = "eval" if args.temperature == 0 and source == "policy" else "charts"  # greedy: an evaluation
        tracker.scalars(args.iteration, **{group: {f"{split}_reward_x100": summary["reward_x100"],
                                                   f"{split}_success_rate": summary["success_rate"]}})
    tracker.close()


def play_experts(env: TextEnv, pending: list, extra: dict, args: Args, prompt: chat.Prompt, paper_cap: int,
                 record, bar) -> int:
    """The expert's episodes, successes recorded; a task whose expert path is longer than the cap is skipped
    (with --num-tasks the split's next task takes its place). Returns the number skipped."""
    skipped = 0
    while pending:
        task, traj_id = pending.pop(0)
        env.max_steps = step_cap(args, env, task, paper_cap)
        traj = play_expert(env, task, traj_id, args.iteration, prompt)
        if traj is not None and traj["success"]:
            record(traj)
            continue
        if traj is None:
            skipped += 1
            if args.num_tasks and (task := next(extra[task.split], None)):
                pending.append((task, f"{task.key}/expert0"))
        else:
            print(f"expert failed: {traj_id} (reward {traj['reward']:.2f})")
        bar.update()
    return skipped


def which_shard(args: Args) -> tuple[int, int]:
    """(I, N) of --shard I/N, else of a data-parallel launch's RANK and WORLD_SIZE; (0, 1) for one process."""
    if args.shard is None:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size > 1 and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per process
        return int(os.environ.get("RANK", "0")), size
    index, _, size = args.shard.partition("/")
    if not (index.isdigit() and size.isdigit() and int(index) < int(size)):
        raise common.UserError(f"--shard {args.shard}: expected I/N with 0 <= I < N, e.g. --shard 0/4")
    return int(index), int(size)


def shard_file(out: Path, shard: int, shards: int) -> Path:
    return out if shards == 1 else out.with_name(f"{out.stem}.shard{shard}of{shards}{out.suffix}")


def merge_shards(outs: dict[str, Path], shard: int, shards: int) -> bool:
    """Mark this shard finished; the shard that finds all N finished merges every shard's episodes into each
    --out (the ids --out already holds are kept once) and removes the shard files. True for that shard."""
    import fcntl
    first = next(iter(outs.values()))
    first.with_name(f"{first.stem}.shard{shard}of{shards}.done").touch()
    with open(first.with_name(f"{first.stem}.shards.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one merger, even when the last two finish together
        markers = [first.with_name(f"{first.stem}.shard{k}of{shards}.done") for k in range(shards)]
        if not all(m.exists() for m in markers):
            return False
        for out in outs.values():
            parts = [shard_file(out, k, shards) for k in range(shards)]
            merged = common.read_jsonl(out, allow_empty=True) if out.exists() else []
            seen = {t["id"] for t in merged}
            for part in parts:
                for t in common.read_jsonl(part, allow_empty=True) if part.exists() else []:
                    if t["id"] not in seen:
                        merged.append(t)
                        seen.add(t["id"])
            common.write_jsonl(out, merged)
            for part in parts:
                part.unlink(missing_ok=True)
        for m in markers:
            m.unlink()
        Path(lock.name).unlink()
    return True


def check_args(args: Args) -> None:
    if (args.shard or int(os.environ.get("WORLD_SIZE", "1")) > 1) and args.policy == "expert":
        raise common.UserError("--shard: the expert's episodes are cheap and its skipped tasks are replaced in "
                               "order; play them in one process")
    sets = args.task_file or args.split
    if len(sets) > 1 and "{split}" not in args.out:
        raise common.UserError(f"{'--task-file' if args.task_file else '--split'} {' '.join(sets)}: --out must "
                               "hold {split}, one file per task set")
    if args.round is not None and not (args.task_file and args.num_tasks and args.round >= 1):
        raise common.UserError("--round R: draws --num-tasks tasks from each --task-file; give both, R >= 1")
    if args.rerank_with and (args.policy == "expert" or args.temperature <= 0 or args.candidates < 2):
        raise common.UserError("--rerank-with: needs a policy checkpoint, --temperature > 0 and --candidates >= 2 "
                               "(greedy decoding would give the critic one candidate to choose from)")


def notes(args: Args, steps: int, elapsed: float, too_long: int, skipped: int) -> None:
    print(f"this run: {steps} env steps at {steps / elapsed:.1f} steps/s")
    if too_long:
        print(f"{too_long} episodes ended early: their chat reached --max-length {args.max_length} "
              "(or the model's context)")
    if skipped:
        print(f"skipped {skipped} tasks whose expert path is longer than the step cap (--max-steps)")


def report(out: Path, trajs: list[dict], split: str, args: Args) -> dict:
    """A split's summary beside its file: <out>.summary.json and the results row <out>.summary.md."""
    summary = summarize(trajs, split, args)
    common.write_json(out.with_suffix(".summary.json"), summary)
    agent = args.policy + (f" + {args.rerank_with}'s pick of {args.candidates}" if args.rerank_with else "")
    row = (f"| {agent} | {args.env} {split} | {summary['reward_x100']:.1f} | "
           f"{100 * summary['success_rate']:.1f} | {summary['mean_steps']:.1f} | {summary['env_steps']} |")
    out.with_suffix(".summary.md").write_text("| policy | env split | reward ×100 | success % | steps | env steps |\n"
                                              "|---|---|---|---|---|---|\n" + row + "\n")
    print(f"{len(trajs)} trajectories in {out}")
    print(row)
    return summary


if __name__ == "__main__":
    common.run_stage(main)
