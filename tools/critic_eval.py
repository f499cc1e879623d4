"""How well a critic ranks and fits trajectories it was not trained on, e.g. the next iteration's rollouts.

    python tools/critic_eval.py runs/evolve-sciworld/1/critic runs/evolve-sciworld/2/collect/self.jsonl

For the trajectories of DATA (collect.py, relabel.py or critic.py output; unlabelled ones get relabel.py's
default penalties): the AUC of V_0 and of V averaged over the states for successes against failures, the most
any function of the first state could reach on them, and V's correlation, state by state, with the discounted
return-to-go of r_env + r_aux (what V regresses on, as critic.py reports it), with the critic's own γ.
Prints one line and, with --out, writes the figures as JSON.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import critic  # noqa: E402
import relabel  # noqa: E402


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """a critic.py output folder"""
    data: tyro.conf.Positional[str]
    """trajectories to score"""
    out: str | None = None
    """write the figures here as JSON"""


def main() -> None:
    args = tyro.cli(Args)
    trajs = [t if all("aux_reward" in s for s in t["steps"]) else relabel.label_trajectory(t)
             for t in common.read_jsonl(args.data)]
    model, heads, tok = critic.load_critic(args.checkpoint)  # (checks that it is a critic checkpoint)
    gamma = json.loads((Path(args.checkpoint) / "args.json").read_text())["gamma"]
    model.eval()
    records = []
    with torch.no_grad():
        for t in tqdm(trajs, desc="V", unit="traj"):
            V = critic.values(model, heads, *critic.encode(tok, t))[0].cpu()
            records.append(critic.value_record(t, V[:len(t["steps"])], gamma))
    report = {"checkpoint": args.checkpoint, "data": args.data, **critic.value_report(records)}
    print(f"{args.checkpoint} on {args.data}: {critic.describe(report)}")
    if args.out:
        common.write_json(args.out, report)


if __name__ == "__main__":
    common.run_stage(main)
