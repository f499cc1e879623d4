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

    def task(self, name: str, variation: int, split: str) -> Task | None:
        """The task `name/variation` labelled `split`, for a task list (read_task_list); None if there is none.
        Here: any split's task of that name and variation (ALFWorld's games and WebShop's goals live in splits)."""
        for s in ("train", "seen", "unseen"):
            for t in self.tasks(s):
                if (t.name, t.variation) == (name, variation):
                    return Task(t.env, t.name, t.variation, split, t.source)
        return None

    def expert_steps(self) -> int | None:
        """Length of the expert's whole path for the episode just reset, when known in advance."""
        return None

    def think(self, action: str) -> str:
        """A short templated thought for an expert action (the ReAct 'Thought:' of expert data)."""
        return f"I should {action} next."

    def close(self) -> None:
        pass


def read_task_list(path: str, env: TextEnv, split: str) -> list[Task]:
    """A task list: one `family/variation` a line (`lifespan-longest-lived/103`), `#` comments and blank lines
    skipped, in the file's order; each task labelled `split`. A line that names no task of env: EnvError with
    the file and line."""
    from pathlib import Path
    if not Path(path).is_file():
        raise EnvError(f"{path}: no such task list")
    tasks, seen = [], set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, variation = line.rpartition("/")
        task = env.task(name, int(variation), split) if name and variation.isdigit() else None
        if task is None:
            raise EnvError(f"{path}:{lineno}: {line!r} is no {env.name} task (expected family/variation)")
        if (name, task.variation) in seen:
            raise EnvError(f"{path}:{lineno}: {line!r} is listed twice")
        seen.add((name, task.variation))
        tasks.append(task)
    if not tasks:
        raise EnvError(f"{path}: lists no task")
    return tasks


def draw_tasks(tasks: list[Task], n: int, round_: int, seed: int) -> list[Task]:
    """Round `round_` (1, 2, ...) of `n` tasks drawn from a pool, fresh each round: the pool in a seeded order that
    alternates between its families (each family shuffled, then one of each in turn), cut into consecutive
    draws of n, so that rounds share no task until the pool is used up (then it starts over) and every draw
    holds the families in equal shares, as far as n allows."""
    import random
    families: dict[str, list[Task]] = {}
    for t in tasks:
        families.setdefault(t.name, []).append(t)
    rng = random.Random(seed)
    for name in sorted(families):
        rng.shuffle(families[name])
    order = [fam[k] for k in range(max(map(len, families.values()))) for _, fam in sorted(families.items())
             if k < len(fam)]
    start = (round_ - 1) * n
    return [order[(start + k) % len(order)] for k in range(min(n, len(order)))]


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
