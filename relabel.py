"""Retrospective reward relabelling (paper §1.4, eq. 3): rule-based step penalties for the critic.

Merges expert and self-generated trajectories into the hybrid dataset and gives every step an auxiliary
reward from the environment's own text feedback o_{t+1}:

    r_aux(t) = r_fmt     if the answer has no parsable action (or o_{t+1} is a format-error message)
               r_inv     if o_{t+1} is the environment's rejection of the action
               r_repeat  if o_{t+1} == o_t (nothing changed; o_0 is the initial observation)
               0         otherwise                                   (one rule per step, in this order)

The rules read text, not adapter flags, so they also label trajectories collected elsewhere (ETO's files).
r_aux trains the critic only (critic.py adds it to r_env in L_Q); env_reward is never changed.

    python relabel.py data/sciworld_expert.jsonl data/iter1_self.jsonl --out data/iter1_hybrid.jsonl
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

import chat
import common
from envs import ENVS

# Paper defaults (fmt, inv, repeat) of the relabelling rules (eq. 3): WebShop sets the last two to 0.
PENALTIES = {"alfworld": (-0.3, -0.2, -0.1), "sciworld": (-0.3, -0.2, -0.1), "webshop": (-0.3, 0.0, 0.0)}
# Format-error observations: ours (chat.FORMAT_ERROR) and ETO's wrappers' two spellings.
FORMAT_TEXTS = ("Invalid format.", "Error Input. Your input must contains 'Action: '")
# Each environment's own rejection texts, as its engine writes them (docs/stages.md, Relabel).
INVALID_TEXTS = {
    "alfworld": ("Nothing happens.", "Nothing happened"),
    "sciworld": ("No known action matches that input.", "Unknown action.", "Ambiguous request",
                 "It's not clear how to get there from here.", "Invalid action!"),
    "webshop": ("Invalid action!",),
}


@dataclass
class Args:
    data: tyro.conf.Positional[tuple[str, ...]]
    """trajectory files to merge (expert and self-generated): our JSONL, or conversations released elsewhere
    (ETO's *_sft.json, AgentGym, AgentTuning; JSON list or JSONL)"""
    out: str
    """the hybrid dataset, every step with aux_reward and rules"""
    fmt: float | None = None
    """format-error penalty (default per env: -0.3)"""
    inv: float | None = None
    """invalid-action penalty (default: -0.2, WebShop 0)"""
    repeat: float | None = None
    """no-change penalty (default: -0.1, WebShop 0)"""
    off: bool = False
    """write aux_reward 0 everywhere: the paper's 'w/o RR' ablation"""
    env: Literal[ENVS] | None = None
    """environment of released records whose id and file name do not name it"""


def _clean(observation: str) -> str:
    return observation.removeprefix("Observation:").strip()


def fired_rule(text: str, observation: str, previous: str, env: str) -> str | None:
    obs = _clean(observation)
    if chat.parse_action(text) is None or obs.startswith(FORMAT_TEXTS):
        return "format"
    if obs.startswith(INVALID_TEXTS[env]):
        return "invalid"
    if obs == _clean(previous):
        return "repeat"
    return None


def label_trajectory(traj: dict, penalties: tuple[float, float, float] | None = None) -> dict:
    """The trajectory with `aux_reward` and `rules` on every step (defaults: the paper's for traj['env'])."""
    fmt, inv, rep = penalties or PENALTIES[traj["env"]]
    value = {"format": fmt, "invalid": inv, "repeat": rep}
    previous, steps = traj["initial_observation"], []
    for step in traj["steps"]:
        rule = fired_rule(step["text"], step["observation"], previous, traj["env"])
        steps.append({**step, "aux_reward": value[rule] if rule else 0.0, "rules": [rule] if rule else []})
        previous = step["observation"]
    return {**traj, "steps": steps}


def main() -> None:
    args = tyro.cli(Args)
    trajs, source_of = [], {}
    for path in args.data:
        for t in common.read_jsonl(path, env=args.env):
            if t["id"] in source_of:
                raise common.UserError(f"{path}: trajectory id {t['id']} is already in {source_of[t['id']]}")
            source_of[t["id"]] = path
            trajs.append(t)

    out, counts = [], Counter()
    for t in trajs:
        default = PENALTIES[t["env"]]
        penalties = (0.0, 0.0, 0.0) if args.off else tuple(
            d if flag is None else flag for d, flag in zip(default, (args.fmt, args.inv, args.repeat)))
        labelled = label_trajectory(t, penalties)
        out.append(labelled)
        key = (t["env"], t["source"])
        counts[key + ("steps",)] += len(t["steps"])
        for step in labelled["steps"]:
            for rule in step["rules"]:
                counts[key + (rule,)] += 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    common.write_jsonl(args.out, out)
    common.write_json(Path(args.out).with_suffix(".args.json"), vars(args))

    print(f"{'env':<10} {'source':<7} {'steps':>7} {'format':>7} {'invalid':>8} {'repeat':>7}")
    for env, source in sorted({k[:2] for k in counts}):
        c = [counts[(env, source, r)] for r in ("steps", "format", "invalid", "repeat")]
        print(f"{env:<10} {source:<7} {c[0]:>7} {c[1]:>7} {c[2]:>8} {c[3]:>7}")
    print(f"wrote {len(out)} trajectories to {args.out}" + (" (aux rewards off)" if args.off else ""))


if __name__ == "__main__":
    common.run_stage(main)
