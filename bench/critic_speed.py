"""Critic training throughput: one forward pass per trajectory (critic.py) versus one per step (the state-action
prefix of each transition encoded on its own), same model, same data, same loss and optimizer.

    python bench/critic_speed.py                      # expert ScienceWorld trajectories, default model
    python bench/critic_speed.py --data runs/evolve-sciworld/1/relabel/hybrid.jsonl --num-trajs 8
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import critic  # noqa: E402
import relabel  # noqa: E402


@dataclass
class Args:
    data: str | None = None
    """relabelled JSONL; default: expert trajectories of --num-trajs ScienceWorld train tasks, relabelled here"""
    model: str = common.DEFAULT_MODEL
    num_trajs: int = 6
    threads: int | None = None
    seed: int = 1


def per_step_values(model, heads, ids, v_pos, q_pos):
    """V_t, Q_t, Q̄_t with one forward per step over that step's prefix (u, h_t, o_t, a_t)."""
    parts = [critic.values(model, heads, ids[:, :q_pos[t] + 1], v_pos[t:t + 1], q_pos[t:t + 1])
             for t in range(len(v_pos))]
    return tuple(torch.cat(xs) for xs in zip(*parts))


def train(values_fn, trajs, encoded, cargs, model_name: str, seed: int) -> tuple[float, int, float]:
    """(seconds, transitions, first loss) of one optimizer step per trajectory on a fresh critic."""
    from peft import get_peft_model
    common.seed_everything(seed)
    base, _ = common.load_base(model_name, None, grad_ckpt=True)
    model = get_peft_model(base, common.lora_config(16, 32, 0.0), adapter_name="critic")
    model.train()  # as critic.py: gradient checkpointing is only active in train mode
    heads = critic.Heads(base.config.hidden_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad] + list(heads.parameters()))
    first, transitions, t0 = None, 0, time.time()
    for traj, enc in zip(trajs, encoded):
        V, Q, Q_target = values_fn(model, heads, *enc)
        loss, _ = critic.iql_loss(traj, V, Q, Q_target, cargs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
        transitions += len(traj["steps"])
    return time.time() - t0, transitions, first


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            path = str(Path(tmp) / "expert.jsonl")
            subprocess.run([sys.executable, "collect.py", "--env", "sciworld", "--split", "train", "--num-tasks",
                            str(args.num_trajs), "--out", path], cwd=ROOT, check=True, capture_output=True)
        trajs = [relabel.label_trajectory(t) if "aux_reward" not in t["steps"][0] else t
                 for t in common.read_jsonl(path)[:args.num_trajs]]
    cargs = critic.Args(data="-", policy="-")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(common.resolve_model(args.model))  # the tokenizer alone, not a model
    encoded = [critic.encode(tok, t) for t in trajs]
    tokens = sum(e[0].shape[1] for e in encoded)
    print(f"{len(trajs)} trajectories, {sum(len(t['steps']) for t in trajs)} transitions, {tokens} tokens, "
          f"model {args.model}, {torch.get_num_threads()} threads")
    one = train(critic.values, trajs, encoded, cargs, args.model, args.seed)
    per = train(per_step_values, trajs, encoded, cargs, args.model, args.seed)
    assert abs(one[2] - per[2]) <= 1e-3 * max(1.0, abs(one[2])), f"the two ways disagree: {one[2]} vs {per[2]}"
    rate_one, rate_per = one[1] / one[0], per[1] / per[0]
    print(f"{'one forward per step':<30} {rate_per:8.2f} transitions/s")
    print(f"{'one forward per trajectory':<30} {rate_one:8.2f} transitions/s")
    print(f"speed-up: {rate_one / rate_per:.2f}x (same first loss {one[2]:.4f})")


if __name__ == "__main__":
    main()
