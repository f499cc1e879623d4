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
import models  # noqa: E402
import critic  # noqa: E402
import relabel  # noqa: E402


@dataclass
class Args:
    data: str | None = None
    """relabelled JSONL; default: expert trajectories of --num-trajs ScienceWorld train tasks, relabelled here"""
    model: str = models.DEFAULT_MODEL
    num_trajs: int = 6
    threads: int | None = None
    seed: int = 1


def per_trajectory_step(model, heads, traj, enc, cargs) -> float:
    """critic.py's way: V_t, Q_t, Q̄_t of all steps from one forward pass, one backward."""
    V, Q, Q_target = critic.values(model, heads, *enc)
    loss, _ = critic.iql_loss(traj, V, Q, Q_target, cargs)
    loss.backward()
    return loss.item()


def per_step_step(model, heads, traj, enc, cargs) -> float:
    """One forward over each step's own prefix (u, h_t, o_t, a_t) and one backward right after it, so only one
    step's graph is alive at a time, as a per-step trainer would hold it. Last step first: step t's Q target
    needs V_{t+1}, which eq. 5 does not differentiate. The summed gradients equal the one-pass gradient."""
    ids, v_pos, q_pos = enc
    known = [torch.zeros(len(v_pos)) for _ in range(3)]  # V, Q, Q̄ of the steps already done (no graph)
    for t in reversed(range(len(v_pos))):
        new = critic.values(model, heads, ids[:, :q_pos[t] + 1], v_pos[t:t + 1], q_pos[t:t + 1])
        V, Q, Q_target = (torch.cat([k[:t].to(x.device), x, k[t + 1:].to(x.device)]) for k, x in zip(known, new))
        loss, _ = critic.iql_loss(traj, V, Q, Q_target, cargs)  # only step t's terms carry a gradient
        loss.backward()
        for k, x in zip(known, new):
            k[t] = x.detach().cpu()[0]
    return loss.item()  # at t = 0 every entry is this trajectory's real value: the full loss


def train(step_fn, trajs, encoded, cargs, model_name: str, seed: int) -> tuple[float, int, list[float]]:
    """(seconds, transitions, loss of each trajectory) of one optimizer step per trajectory on a fresh critic."""
    from peft import get_peft_model
    common.seed_everything(seed)
    base, _ = models.load_base(model_name, None, grad_ckpt=True)
    model = get_peft_model(base, models.lora_config(16, 32, 0.0), adapter_name="critic")
    model.train()  # as critic.py: gradient checkpointing is only active in train mode
    heads = critic.Heads(base.config.hidden_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad] + list(heads.parameters()))
    losses, transitions, t0 = [], 0, time.time()
    for traj, enc in zip(trajs, encoded):
        losses.append(step_fn(model, heads, traj, enc, cargs))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        transitions += len(traj["steps"])
    return time.time() - t0, transitions, losses


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
    tok = AutoTokenizer.from_pretrained(models.resolve_model(args.model))  # the tokenizer alone, not a model
    encoded = [critic.encode(tok, t) for t in trajs]
    tokens = sum(e[0].shape[1] for e in encoded)
    print(f"{len(trajs)} trajectories, {sum(len(t['steps']) for t in trajs)} transitions, {tokens} tokens, "
          f"model {args.model}, {torch.get_num_threads()} threads")
    one = train(per_trajectory_step, trajs, encoded, cargs, args.model, args.seed)
    per = train(per_step_step, trajs, encoded, cargs, args.model, args.seed)
    # equal losses after the updates too: the per-step gradients add up to the one-pass gradient
    for a, b in zip(one[2], per[2]):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), f"the two ways disagree: losses {one[2]} vs {per[2]}"
    rate_one, rate_per = one[1] / one[0], per[1] / per[0]
    print(f"{'one forward per step':<30} {rate_per:8.2f} transitions/s")
    print(f"{'one forward per trajectory':<30} {rate_one:8.2f} transitions/s")
    print(f"speed-up: {rate_one / rate_per:.2f}x (the same loss after each of {len(trajs)} updates, "
          f"last {one[2][-1]:.4f})")


if __name__ == "__main__":
    main()
