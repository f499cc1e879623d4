"""Expert trajectories released by other projects as the loop's expert data (evolve.sh's EXPERT=FILE): ETO's
`*_sft.json` (the GPT-4 ReAct trajectories the paper trains on), AgentGym's AgentTraj, AgentTuning's AgentInstruct,
read by common.read_jsonl (chat.from_conversation) and written as our JSONL, so that BC and the hybrid data take
them as they take the planner's.

    python tools/import_expert.py sciworld_sft.json --env sciworld --out runs/x/0/expert/train.jsonl

Each record keeps its own prompt (ETO's files: ETO's instruction and one-shot example, which PROMPT=eto also
gives the policy's rollouts). Records of another environment are left out; with --num-tasks only the first N.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from envs import ENVS  # noqa: E402


@dataclass
class Args:
    files: tyro.conf.Positional[tuple[str, ...]]
    """released expert files (JSON list or JSONL), in ETO's, AgentGym's or AgentTuning's layout"""
    env: Literal[ENVS]
    """the loop's environment: records of others are left out; records whose id and file name do not say
    theirs are taken as this one's"""
    out: str
    """our JSONL, one trajectory a line"""
    num_tasks: int | None = None
    """keep the first N records of the environment (default: all)"""


def main() -> None:
    args = tyro.cli(Args)
    trajs = [t for path in args.files for t in common.read_jsonl(path, env=args.env)]
    ours = [t for t in trajs if t["env"] == args.env][:args.num_tasks]
    if not ours:
        raise common.UserError(f"{' '.join(args.files)}: no {args.env} trajectory among their {len(trajs)} records")
    ids = [t["id"] for t in ours]
    if len(set(ids)) < len(ids):
        raise common.UserError(f"{' '.join(args.files)}: a trajectory id appears twice ({max(ids, key=ids.count)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    common.write_jsonl(args.out, ours)
    common.write_json(Path(args.out).with_suffix(".args.json"), vars(args))
    won = sum(t["success"] for t in ours)
    print(f"{len(ours)} expert trajectories ({won} successful, {sum(len(t['steps']) for t in ours)} steps) from "
          f"{len(args.files)} released file(s) into {args.out}; {len(trajs) - len(ours)} left out")


if __name__ == "__main__":
    common.run_stage(main)
