"""Text-environment adapters: one small class per environment, one interface for all.

Every adapter plays *one* episode at a time:

    env = make_env("sciworld")
    task = env.tasks("train")[0]
    obs, info = env.reset(task)            # obs = o_0; info["instruction"] = u (the task text)
    obs, env_reward, done, info = env.step("look around")   # env_reward on a 0..1 scale
    env.expert_action()                    # the expert's next action, or None when it has none

`done` is true when the task ended (info["terminated"]: won, or lost for good) or the step cap was reached;
the two differ for the critic, which bootstraps from V after a cut episode and from 0 after an ended task.

The adapters return the environment's own feedback text unchanged (e.g. ALFWorld's
"Nothing happens.", ScienceWorld's "No known action matches that input."), because the
retrospective relabelling (relabel.py, paper eq. 3) keys on that text, not on adapter flags.
"""
from __future__ import annotations

from dataclasses import dataclass

# Canonical split names; the right-hand side are the names the papers and benchmarks use.
SPLIT_ALIASES = {"train": "train", "seen": "seen", "dev": "seen", "valid_seen": "seen", "test": "unseen",
                 "unseen": "unseen", "valid_unseen": "unseen"}
ENVS = ("sciworld", "alfworld", "webshop")


class EnvError(Exception):
    """A user-facing problem with an environment (unknown split, missing data, ...)."""


@dataclass(frozen=True)
class Task:
    env: str         # "sciworld" | "alfworld" | "webshop"
    name: str        # task family: ScienceWorld task, ALFWorld task type, WebShop category
    variation: int   # index inside the family (ScienceWorld variation, game or goal number)
    split: str       # "train" | "seen" | "unseen"
    source: str = "" # what the adapter needs to load it (a game file, a goal id); opaque to stages

    @property
    def key(self) -> str:
        return f"{self.env}/{self.name}/{self.variation}"


class TextEnv:
    """The interface every adapter implements (see the module docstring)."""

    name: str
    max_steps: int        # the paper's per-episode cap (§1.3): WebShop 10, ScienceWorld 24, ALFWorld 30
    system_prompt: str    # ReAct instructions shown as the system message
    # Whether several instances may reset and step at the same time in threads (the rollout engine then runs
    # them side by side). ScienceWorld's each run in their own JVM; ALFWorld's engine shares state between
    # instances, and the pure-Python ones would gain nothing.
    parallel: bool = False

    def tasks(self, split: str) -> list[Task]:
        raise NotImplementedError

    def reset(self, task: Task) -> tuple[str, dict]:
        raise NotImplementedError

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        raise NotImplementedError

    def expert_action(self) -> str | None:
        raise NotImplementedError

    def expert_steps(self) -> int | None:
        """Length of the expert's whole path for the episode just reset, when known in advance."""
        return None

    def think(self, action: str) -> str:
        """A short templated thought for an expert action (the ReAct 'Thought:' of expert data)."""
        return f"I should {action} next."

    def close(self) -> None:
        pass


def canonical_split(split: str) -> str:
    if split not in SPLIT_ALIASES:
        raise EnvError(f"unknown split {split!r}; use one of train, seen (dev), unseen (test)")
    return SPLIT_ALIASES[split]


def make_env(name: str, **kwargs) -> TextEnv:
    """Build an adapter by name; imports only that environment's package."""
    if name == "sciworld":
        from envs.sciworld import SciWorldEnv
        return SciWorldEnv(**kwargs)
    if name == "alfworld":
        from envs.alfworld import AlfWorldEnv
        return AlfWorldEnv(**kwargs)
    if name == "webshop":
        from envs.webshop import WebShopEnv
        return WebShopEnv(**kwargs)
    raise EnvError(f"unknown env {name!r}; use one of {', '.join(ENVS)}")
