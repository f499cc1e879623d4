"""ScienceWorld (Wang et al. 2022) through the real `scienceworld` package, with ETO's splits.

Departures from the stock `ScienceWorldEnv`:
- a thin step: the stock one builds every valid action-object combination on every call (~20 steps/s);
  we read only the observation, score and completion flag (~80+ steps/s);
- the JVM heap is capped (`-Xmx1g`): the default is a quarter of the RAM and grows to ~3 GB;
- every call into the JVM times out (`step_timeout`); a JVM that died or hung is restarted and the episode's
  actions replayed, so one engine fault costs one replay, not the run;
- the expert is the gold path with a `look around` after each move (see `with_looks`).

Splits are ETO's (data/eto/, copied from github.com/Yifan-Song793/ETO): train 1483, seen (ETO's dev) 194,
unseen (ETO's test) 211 (task, variation) pairs. Kept exactly as released: 54 of ETO's dev pairs are also in
its train list; the unseen pairs appear in neither.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from envs import EnvError, Task, TextEnv, canonical_split

ETO_DIR = Path(__file__).resolve().parent.parent / "data" / "eto"
SPLIT_FILES = {"train": "data_sciworld_train_indices.json", "seen": "data_sciworld_dev_indices.json",
               "unseen": "data_sciworld_test_indices.json"}
# The stock engine's rejection texts (read off scienceworld 1.2.3); relabel.py keys on the same strings.
REJECTIONS = ("No known action matches that input.", "Unknown action.", "Ambiguous request")
# ETO plays with doors open and teleport available (its in-context example teleports). Electrical
# tasks cannot take noElectricalAction, so "easy" minus that one is used for them.
EASY = "teleportAction,openDoors,selfWateringFlowerPots,openContainers,noElectricalAction"

SYSTEM_PROMPT = """You are a helpful assistant doing science experiments in a text world, ScienceWorld.
Each turn you see an observation and answer in exactly this format:
Thought: your reasoning about what to do next.
Action: one action.

Actions (OBJ and LOC are names you see in the observations):
open OBJ, close OBJ, activate OBJ, deactivate OBJ, connect OBJ to OBJ, disconnect OBJ, use OBJ [on OBJ],
look around, look at OBJ, look in OBJ, read OBJ, move OBJ to OBJ, pick up OBJ, put down OBJ, pour OBJ into OBJ,
dunk OBJ into OBJ, mix OBJ, go to LOC, teleport to LOC, eat OBJ, flush OBJ, focus on OBJ, wait, wait1, inventory.
Focus on an object only when the task tells you to: focusing on a wrong object ends the task.
If the observation says "No known action matches that input.", your previous action was not valid."""


def eto_task_name(eto_name: str) -> str:
    """'task-10-measure-melting-point-(known-substance)' -> 'measure-melting-point-known-substance'."""
    name = re.sub(r"^task-[0-9a-z]+-", "", eto_name).replace("(", "").replace(")", "")
    return name.replace("mendellian", "mendelian")  # ETO's spelling


def _patch_engine(heap: str, timeout: float) -> None:
    """Cap the JVM heap, and give every call into it a socket timeout, so that a hung engine raises instead
    of blocking the whole run (the adapter then restarts it). No performance-data file either: py4j reads the
    JVM's first line of output as its port, and a JVM whose /tmp/hsperfdata file is locked (a PID reused while a
    killed JVM's file lingers) prints a warning there first, and the engine fails to start."""
    import scienceworld.scienceworld as sw
    from py4j.java_gateway import GatewayParameters
    launch = getattr(sw.launch_gateway, "original", sw.launch_gateway)

    def capped_launch(*args, **kwargs):
        kwargs["javaopts"] = [f"-Xmx{heap}", "-XX:+UseSerialGC", "-XX:-UsePerfData"]
        return launch(*args, **kwargs)

    def timed_parameters(*args, **kwargs):
        return GatewayParameters(*args, **kwargs, read_timeout=timeout)

    capped_launch.original = launch
    sw.launch_gateway, sw.GatewayParameters = capped_launch, timed_parameters


def java_list(jlist) -> list[str]:
    """A Java list as a Python one. Iterating a py4j list ends quietly when the JVM dies mid-way (py4j turns
    the error into StopIteration), so a dead engine would pass for a short task list or gold path; the
    final size() call raises instead."""
    items = [str(x) for x in jlist]
    size = jlist.size()
    if len(items) != size:
        raise ConnectionError(f"the JVM returned {len(items)} of {size} list items")
    return items


def with_looks(gold: list[str]) -> list[str]:
    """The gold path with a `look around` after every move that is not already followed by one.

    Moving only prints "You move to the outside."; the gold path then often acts on what is there (e.g.
    `focus on egg parrot`) without looking, which no policy can learn to imitate: the object's name is in
    no observation. Looking changes neither the world nor the score."""
    out = []
    for k, action in enumerate(gold):
        out.append(action)
        moved = action.startswith(("go to ", "teleport to "))
        if moved and k + 1 < len(gold) and gold[k + 1] != "look around":
            out.append("look around")
    return out


class SciWorldEnv(TextEnv):
    name = "sciworld"
    parallel = True  # one JVM per instance
    system_prompt = SYSTEM_PROMPT

    def __init__(self, max_steps: int = 24, simplification: str = EASY, jvm_heap: str = "1g",
                 step_timeout: float = 120.0):
        """step_timeout: seconds one call into the engine may take before it counts as hung (loading a task
        with its gold path takes a few)."""
        self.max_steps, self.simplification, self.jvm_heap = max_steps, simplification, jvm_heap
        self.step_timeout = step_timeout
        self._sw = None
        self._gold: list[str] = []

    def _engine(self):
        if self._sw is None:
            _patch_engine(self.jvm_heap, self.step_timeout)
            from scienceworld import ScienceWorldEnv
            self._sw = ScienceWorldEnv("", envStepLimit=10_000)  # our own step counter caps episodes
        return self._sw

    def tasks(self, split: str) -> list[Task]:
        split = canonical_split(split)
        pairs = json.loads((ETO_DIR / SPLIT_FILES[split]).read_text())
        return [Task("sciworld", eto_task_name(n), int(v), split) for n, v in pairs]

    def task(self, name: str, variation: int, split: str) -> Task | None:
        """Any variation of any ScienceWorld task, in an ETO split or not (its test variations 103-124 are in
        none); the engine knows the families and how many variations each has."""
        sw = self._engine()
        if name not in java_list(sw.server.getTaskNames()) or not 0 <= variation < sw.get_max_variations(name):
            return None
        return Task("sciworld", name, variation, split)

    def jvm(self):
        """The engine's Java process (tests kill it to check the restart)."""
        return self._engine()._gateway.java_process

    def reset(self, task: Task) -> tuple[str, dict]:
        self._task, self._actions = task, []
        return self._with_restart(self._reset, task)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        result = self._with_restart(self._step, action)
        self._actions.append(action)
        return result

    def _with_restart(self, fn, arg, attempts: int = 3):
        """Run fn(arg); if the JVM died or hung, start a new one, replay this episode's actions, and run it again
        (a failure during the replay counts as one more attempt)."""
        from py4j.protocol import Py4JError
        for attempt in range(1, attempts + 1):
            try:
                if attempt > 1:
                    self._kill()
                    self._reset(self._task)
                    for action in self._actions:
                        self._step(action)
                return fn(arg)
            except (Py4JError, ConnectionError) as e:
                if attempt == attempts:
                    raise EnvError(f"ScienceWorld's JVM failed {attempts} times in a row on {self._task.key} "
                                   f"({type(e).__name__}: {e})") from e
                print(f"ScienceWorld's JVM failed ({type(e).__name__}); restarting it and replaying "
                      f"{len(self._actions)} actions of {self._task.key}", file=sys.stderr)

    def _kill(self) -> None:
        if self._sw is not None:
            try:
                self._sw._gateway.java_process.kill()
                self._sw._gateway.shutdown()
            except Exception:  # already dead: nothing left to stop
                pass
            self._sw = None

    def _reset(self, task: Task) -> tuple[str, dict]:
        sw = self._engine()
        if task.name not in java_list(sw.server.getTaskNames()):
            raise EnvError(f"unknown ScienceWorld task {task.name!r}")
        simplification = self.simplification
        if "power-component" in task.name or "conductivity" in task.name:
            simplification = ",".join(s for s in simplification.split(",") if s != "noElectricalAction")
        sw.load(task.name, task.variation, simplification, generateGoldPath=True)
        sw.server.reset()
        self._gold = with_looks(java_list(sw.server.getGoldActionSequence()))
        obs = sw.server.step("look around")
        # Some tasks start with part of the score (e.g. an open door); it is no step's reward.
        self._t, self._score = 0, max(int(round(100 * sw.server.getScore())), 0)
        return obs, {"instruction": sw.server.getTaskDescription(), "score": self._score / 100}

    def _step(self, action: str) -> tuple[str, float, bool, dict]:
        sw = self._sw
        obs = sw.server.step(action)
        if obs.startswith("Ambiguous request"):
            # The engine now waits for a number; a ReAct agent never sends one, so take the first reading.
            obs = sw.server.step("0")
        self._t += 1
        raw = int(round(100 * sw.server.getScore()))
        score = max(raw, 0)  # a wrong 'focus on' gives -100 and ends the episode; the paper scores it 0
        reward, self._score = (score - self._score) / 100, score
        won = bool(sw.server.getCompleted()) and raw >= 100
        terminated = bool(sw.server.getCompleted()) or raw < 0  # the task ended, won or lost
        valid = not obs.startswith(REJECTIONS)
        done = terminated or self._t >= self.max_steps
        return obs, reward, done, {"score": score / 100, "won": won, "valid": valid, "terminated": terminated}

    def expert_action(self) -> str | None:
        return self._gold[self._t] if self._t < len(self._gold) else None

    def expert_steps(self) -> int | None:
        return len(self._gold)

    def think(self, action: str) -> str:
        verb, _, rest = action.partition(" ")
        templates = {
            "go": f"I should move on: {action}.", "teleport": f"The next place I need is {rest.removeprefix('to ')}.",
            "focus": f"This is what the task asks about, so I {action}.",
            "pick": f"I will need {rest.removeprefix('up ')}, so I pick it up.",
            "look": "Let me look to see what is here.", "open": f"I should open {rest} to get through or see inside.",
            "wait": "The process needs time, so I wait.", "wait1": "I wait a moment and check again.",
        }
        return templates.get(verb, f"Next I {action}.")

    def close(self) -> None:
        if self._sw is not None:
            self._sw.close()
            self._sw = None
