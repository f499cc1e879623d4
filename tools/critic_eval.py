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
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import relabel  # noqa: E402


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """a critic.py output folder"""
    data: tyro.conf.Positional[str]
    """trajectories to score"""
    out: str | None = None
    """write the figures here as JSON"""


# ------------------------------------------------------------------ the figures (critic.py reports them too)
def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def auc(pos: list[float], neg: list[float]) -> float:
    """P(score of a success > score of a failure), ties counted half (Mann-Whitney U)."""
    if not pos or not neg:
        return float("nan")
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's r; nan when either side is constant."""
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = (x.norm() * y.norm()).item()
    return (x @ y).item() / denom if denom > 0 else float("nan")


def first_state_ceiling(tasks: list, success: list[bool]) -> float:
    """The highest AUC any function of the first state can reach: V_0 is the same for every attempt at one
    task (same prompt, same first observation), so the best it can do is rank tasks by their success rate.
    Hybrid data caps it: an expert success and a policy failure on one task always tie."""
    groups = defaultdict(list)
    for task, ok in zip(tasks, success):
        groups[task].append(ok)
    rate = {task: sum(oks) / len(oks) for task, oks in groups.items()}
    return auc([rate[t] for t, ok in zip(tasks, success) if ok], [rate[t] for t, ok in zip(tasks, success) if not ok])


def value_record(traj: dict, V: torch.Tensor, returns: torch.Tensor) -> tuple:
    """What value_report needs of one trajectory, V given for its steps: task, success, V_0, mean V, and V and
    the discounted return-to-go of r_env + r_aux (critic.returns_to_go: what V regresses on) at every step."""
    return ((traj["env"], traj["task"], traj["variation"]), traj["success"], float(V[0]), float(V.mean()),
            V.tolist(), returns.tolist())


def value_report(records: list[tuple]) -> dict:
    """How V ranks successes above failures (AUC of V_0 and of V averaged over the states, beside the first
    state's ceiling) and how it fits the returns (Pearson's r, state by state) on these value_records."""
    tasks, ok, first, average, vs, returns = zip(*records) if records else ((),) * 6

    def ranked(scores):
        return auc([x for x, y in zip(scores, ok) if y], [x for x, y in zip(scores, ok) if not y])

    return {"trajectories": len(records), "successes": sum(ok), "auc_v0": ranked(first),
            "auc_v0_ceiling": first_state_ceiling(tasks, ok), "auc_mean_v": ranked(average),
            "return_corr": correlation([v for x in vs for v in x], [g for x in returns for g in x])}


def describe(figures: dict) -> str:
    """A value_report as one line."""
    return (f"{figures['trajectories']} trajectories ({figures['successes']} successes); AUC success vs failure: "
            f"V_0 {figures['auc_v0']:.3f} (the most any function of the first state could reach here: "
            f"{figures['auc_v0_ceiling']:.3f}), V averaged over the states {figures['auc_mean_v']:.3f}; "
            f"correlation of V with the discounted return, state by state: {figures['return_corr']:.3f}")


# ----------------------------------------------------------------------------- main
def main() -> None:
    import critic  # here, not above: critic.py imports this module's figures
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
            records.append(value_record(t, V[:len(t["steps"])], critic.returns_to_go(t, gamma)))
    report = {"checkpoint": args.checkpoint, "data": args.data, **value_report(records)}
    print(f"{args.checkpoint} on {args.data}: {describe(report)}")
    if args.out:
        common.write_json(args.out, report)


if __name__ == "__main__":
    common.run_stage(main)
