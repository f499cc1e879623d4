"""Rollout throughput: ETO's evaluation loop (one episode at a time, the whole chat prefilled again every turn with
transformers' generate, the LoRA adapter as trained) against rollout.Engine (slots refilled as episodes end, the
shared prefix prefilled once, KV caches kept between turns, each row's new tokens prefilled without padding), with
the adapter as trained and merged (as collect.py plays); on the same tasks, greedy.

It also times the model's own batched `generate` with as many rows as slots and no environment: the decode
ceiling of this machine, beside the engine's answer tokens per second over the whole run (prefill, environment
and all), so that the remaining gap is visible.

    python bench/rollout_speed.py --policy runs/evolve-sciworld/0/bc     # a trained BC policy
    python bench/rollout_speed.py                                         # trains one first (evolve.sh's BC, ~8 min)

On a deterministic environment (WebShop, ALFWorld) both ways must play identical episodes; ScienceWorld's animals
move from run to run, so there only the task set is the same.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import chat  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
from envs import make_env  # noqa: E402

LIFESPAN = ("lifespan-longest-lived", "lifespan-shortest-lived", "lifespan-longest-lived-then-shortest-lived")


@dataclass
class Args:
    policy: str | None = None
    """policy checkpoint (bc.py output); default: train one on ScienceWorld's lifespan tasks as evolve.sh does,
    in --workdir (kept: a second run reuses it)"""
    env: str = "sciworld"
    task_names: tuple[str, ...] = ()
    """task families; default: the lifespan families on ScienceWorld (evolve.sh's), every task elsewhere"""
    num_envs: int = 8
    """slots of the engine"""
    num_tasks: int = 24
    max_steps: int = 12
    max_new_tokens: int = 48
    skip_naive: bool = False
    """time the engine only (the naive loop is the slow half)"""
    workdir: str = "runs/bench/rollouts"
    threads: int | None = None


def train_policy(args: Args) -> str:
    """evolve.sh's default BC policy, made by the commands evolve.sh itself runs (read from its DRY_RUN listing,
    so that the two never drift apart): its expert export, then BC."""
    work = Path(args.workdir)
    if (work / "0" / "bc" / "qevolve.json").exists():
        return str(work / "0" / "bc")
    listing = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", "RUN": str(work)},
                             capture_output=True, text=True, check=True).stdout
    commands = dict(line.removeprefix("[dry]").strip().split(": ", 1) for line in listing.splitlines()
                    if line.startswith("[dry]"))
    print(f"no --policy: training evolve.sh's BC policy into {work / '0' / 'bc'} (~8 min on 2 CPU cores)", flush=True)
    for stage in ("expert", "bc"):
        _, *argv = shlex.split(commands[f"{work}/0/{stage}"])
        subprocess.run([sys.executable, *argv], cwd=ROOT, check=True)
    return str(work / "0" / "bc")


def tasks_of(args: Args, env):
    names = args.task_names or (LIFESPAN if args.env == "sciworld" else ())
    tasks = [t for t in env.tasks("train") if not names or t.name in names]
    return tasks[:args.num_tasks]


def naive(args: Args, model, tok) -> tuple[float, list[dict]]:
    env = make_env(args.env, max_steps=args.max_steps)
    prompt = chat.Prompt("short", args.env, env.system_prompt)
    t0, trajs = time.time(), []
    for task in tasks_of(args, env):
        trajs.append(rollout.play_one(env, task, task.key, model, tok, prompt, args.max_new_tokens))
        print(f"  naive: {len(trajs)} episodes, {time.time() - t0:.0f} s", flush=True)
    env.close()
    return time.time() - t0, trajs


def engine(args: Args, model, tok) -> tuple[float, list[dict]]:
    envs = [make_env(args.env, max_steps=args.max_steps) for _ in range(args.num_envs)]
    prompt = chat.Prompt("short", args.env, envs[0].system_prompt)
    limit = models.length_limit(4096, model)

    def episode(task, env):
        return rollout.Conversation(env, task, task.key, tok, limit - args.max_new_tokens, limit, prompt)

    t0 = time.time()
    eng = rollout.Engine(model, tok, args.max_new_tokens, 0.0)
    trajs = [c.result(0) for c in eng.play(envs, (partial(episode, t) for t in tasks_of(args, envs[0])))]
    elapsed = time.time() - t0
    st = eng.stats
    print(f"  {elapsed:.0f} s: prefill {st['prefill_s']:.0f} s ({st['prefill_forwards']} forwards, "
          f"{st['prefill_tokens']} tokens), decode {st['decode_s']:.0f} s ({st['decode_forwards']} forwards, "
          f"{st['answer_tokens']} answer tokens), the rest (environments, tokenizing, cache upkeep) "
          f"{elapsed - st['prefill_s'] - st['decode_s']:.0f} s; shared prefix {len(eng.prefix)} tokens", flush=True)
    for env in envs:
        env.close()
    return elapsed, trajs


@torch.no_grad()
def generate_ceiling(args: Args, model, tok) -> float:
    """Decode tokens/s of the model's own batched generate: num_envs first prompts, greedy, every row forced to
    max_new_tokens, less the prefill (timed with one new token)."""
    env = make_env(args.env, max_steps=args.max_steps)
    prompt = chat.Prompt("short", args.env, env.system_prompt)
    rows = []
    for task in tasks_of(args, env)[:args.num_envs]:
        obs, info = env.reset(task)
        rows.append(chat.tokenize_chat(tok, prompt.first(info["instruction"], obs), add_generation_prompt=True)[0])
    env.close()
    ids, mask = rollout.left_pad(rows, tok.pad_token_id)

    def timed(n: int) -> float:
        t0 = time.time()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=tok.pad_token_id)
        return time.time() - t0
    n = args.max_new_tokens
    return len(rows) * (n - 1) / (timed(n) - timed(1))


def answer_tokens(tok, trajs: list[dict]) -> int:
    return sum(len(tok(s["text"], add_special_tokens=False)["input_ids"]) + 1 for t in trajs for s in t["steps"])


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = args.policy or train_policy(args)
    model, tok, _ = models.load_policy(policy)
    model.eval()
    rows = []
    if not args.skip_naive:
        print("ETO's loop (one episode at a time, full prefill each turn, adapter as trained) ...", flush=True)
        slow_s, slow = naive(args, model, tok)
        rows.append(("ETO's loop: 1 episode, full prefill every turn", slow_s, slow))
    for name in ("adapter as trained", "adapter merged (collect.py)"):
        if name.startswith("adapter merged"):
            model = rollout.for_rollouts(model)
        print(f"rollout.Engine, {args.num_envs} slots, {name} ...", flush=True)
        rows.append((f"engine, {args.num_envs} slots, {name}", *engine(args, model, tok)))
    fast_s, fast = rows[-1][1:]
    ceiling = generate_ceiling(args, model, tok)

    steps = sum(len(t["steps"]) for t in fast)
    base = None if args.skip_naive else sum(len(t["steps"]) for t in slow) / slow_s  # ETO's loop's env steps/s
    families = args.task_names or (LIFESPAN if args.env == "sciworld" else ())
    print(f"\n{len(fast)} episodes of {args.env} ({', '.join(families) or 'all tasks'}), step cap "
          f"{args.max_steps}, {steps} env steps ({steps / len(fast):.1f} per episode), greedy, {policy}")
    print("| way | seconds | env steps/s | answer tokens/s | vs ETO's loop |\n|---|---|---|---|---|")
    for name, sec, trajs in rows:
        n = sum(len(t["steps"]) for t in trajs)
        ratio = f"{n / sec / base:.2f}x" if base else "-"
        print(f"| {name} | {sec:.0f} | {n / sec:.2f} | {answer_tokens(tok, trajs) / sec:.1f} | {ratio} |")
    print(f"| generate's decode ceiling: {args.num_envs} rows, no environment, no prefill | | | {ceiling:.1f} | |")
    if not args.skip_naive:
        by_id = {t["id"]: t for t in fast}
        same = sum([s["text"] for s in t["steps"]] == [s["text"] for s in by_id[t["id"]]["steps"]] for t in slow)
        print(f"ratio {steps / fast_s / base:.2f}x "
              f"(env steps/s, engine vs ETO's loop); identical episodes: {same}/{len(slow)}"
              + (" (ScienceWorld's animals move from run to run)" if args.env == "sciworld" else ""))


if __name__ == "__main__":
    main()
