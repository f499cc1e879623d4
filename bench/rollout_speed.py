"""Rollout throughput: one environment at a time with full re-prefill every turn (ETO's evaluation loop)
versus --num-envs environments in lock-step with batched generation and per-conversation KV caches.

Same model, same tasks, greedy decoding, so both ways play the same episodes (the script checks it).

    python bench/rollout_speed.py --policy runs/bc --num-envs 8 --num-tasks 8 --max-steps 12
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import collect  # noqa: E402
import common  # noqa: E402
from envs import make_env  # noqa: E402


@dataclass
class Args:
    policy: str = "runs/bc"
    """policy checkpoint (bc.py output); 'untrained' = a fresh LoRA on the default model"""
    env: str = "sciworld"
    num_envs: int = 8
    num_tasks: int = 8
    max_steps: int = 12
    max_new_tokens: int = 48
    threads: int | None = None


def run(args: Args, model, tok, num_envs: int, kv_cache: bool) -> tuple[float, list[dict]]:
    envs = [make_env(args.env, max_steps=args.max_steps) for _ in range(num_envs)]
    tasks = envs[0].tasks("train")[:args.num_tasks]
    cargs = collect.Args(env=args.env, out="-", policy=args.policy, temperature=0.0, num_envs=num_envs,
                         max_new_tokens=args.max_new_tokens, kv_cache=kv_cache)
    trajs, t0, room = [], time.time(), collect.chat_room(cargs, model)
    limit = common.length_limit(cargs.max_length, model)
    prompt = common.Prompt("short", args.env, envs[0].system_prompt)
    for start in range(0, len(tasks), num_envs):
        wave = zip(envs, tasks[start:start + num_envs])
        convs = [collect.Conversation(env, task, task.key, tok, room, limit, prompt) for env, task in wave]
        trajs += [c.result(0) for c in collect.play_policy(convs, model, tok, cargs)]
    elapsed = time.time() - t0
    for env in envs:
        env.close()
    return sum(len(t["steps"]) for t in trajs) / elapsed, sorted(trajs, key=lambda t: t["id"])


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.policy == "untrained":
        from peft import get_peft_model
        base, tok = common.load_base(common.DEFAULT_MODEL)
        model = get_peft_model(base, common.lora_config(16, 32, 0.0), adapter_name="policy")
    else:
        model, tok, _ = common.load_policy(args.policy)
    model.eval()
    naive, slow = run(args, model, tok, 1, False)
    fast_rate, fast = run(args, model, tok, args.num_envs, True)
    same = [[s["text"] for s in a["steps"]] == [s["text"] for s in b["steps"]] for a, b in zip(slow, fast)]
    steps = sum(len(t["steps"]) for t in fast)
    print(f"| way | env steps/s |\n|---|---|\n| 1 env, full re-prefill | {naive:.2f} |\n"
          f"| {args.num_envs} envs, batched + KV cache | {fast_rate:.2f} |")
    print(f"ratio {fast_rate / naive:.2f}x on {len(fast)} episodes, {steps} env steps "
          f"({steps / len(fast):.1f} per episode); identical episodes: {sum(same)}/{len(same)}")


if __name__ == "__main__":
    main()
