"""ALFWorld adapter: text household tasks played on the real ALFWorld engine (TextWorld-PDDL).

Games come from one of two sources:

* **Official data**, when `data_dir` or `$ALFWORLD_DATA` (alfworld's default: ~/.cache/alfworld)
  holds `json_2.1.1/`:
  `json_2.1.1/{train,valid_seen,valid_unseen}/<task-dir>/<trial>/game.tw-pddl` become the splits
  train / seen / unseen. Exactly the games ALFWorld's own loader keeps: trials with `traj_data.json`,
  no "movable" or "Sliced" task, one of the six task types (read from the task folder name,
  `pick_heat_then_place_in_recep-Apple-None-GarbageCan-10`), and the game file's `solvable` flag true
  (read from the end of the file, where both releases write it). That gives the paper's 140 seen and 134
  unseen evaluation games; 47 of the 187 seen trials are unsolvable, and some of those crash the engine.
  Both releases of the files load: ALFWorld 0.2.2's (the ones ETO, QLASS and the paper use) and 0.4's
  newer `game.tw-pddl` (its `json_2.1.2` download, unzipped into the same `json_2.1.1/` folders).
  `Task.source` is the game file path.
* **Synthetic games** otherwise (the official files cannot be downloaded here): see
  `envs/alfworld_gen.py`. The tasks are drawn deterministically from `seed`, one task type after
  the other; train and seen use ALFRED's training floor plans, and every seen game repeats the
  (task type, object, receptacle, floor plan) of a train game with a new placement; unseen uses
  ALFRED's held-out floor plans, so none of its object-receptacle-scene combinations is in train.
  `Task.source` is the game spec ("synth:<task type>/<object>/<target>/FloorPlan<n>/<seed>"); the
  game is written on first reset to `$QEVOLVE_CACHE/alfworld/<generator hash>/` (default
  `~/.cache/qevolve`).

`num_train` / `num_seen` / `num_unseen` are the split sizes (default: every official game; synthetic
200 / 40 / 40). Synthetic task i depends only on (seed, split, i), so a smaller split is a prefix of a
bigger one. Official data takes an evenly spaced subset of the sorted games; 0 means all of them.

Commands: the agent writes putting as ETO's trajectories and the paper's agents do, "put X in/on Y".
The engine's own word depends on the game file: ALFWorld 0.2.2's games say "put X in/on Y", 0.4's
(and our synthetic ones) "move X to Y". The adapter translates an agent's put ("put X in/on Y",
"put X in Y", "put X on Y" or "move X to Y") into the loaded game's form, and shows the expert's
actions and the admissible commands in the agent's form, so one policy plays both generations.

The expert is ALFWorld's planner (the Fast Downward replanning behind `AlfredExpert("planner")`),
but called lazily: that wrapper replans after every step, and one plan (a blind search) takes a
median 0.03 s but up to 11 s (two-object tasks in kitchens; 46 s in the biggest uncapped kitchen),
so the adapter plans only when `expert_action()` is asked and keeps the plan while the actions
follow it (or change nothing).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import zlib
from dataclasses import replace

from envs import EnvError, Task, TextEnv, canonical_split
from envs import alfworld_gen as gen

SPLIT_DIRS = {"train": "train", "seen": "valid_seen", "unseen": "valid_unseen"}
# Admissible commands that change nothing a plan depends on.
INFO_COMMANDS = ("look", "inventory", "help", "examine ")

SYSTEM_PROMPT = """You are an agent acting in a household to complete a task. Each turn you are shown \
what your last action did. Reply with exactly two lines:
Thought: <a short reasoning about what to do next>
Action: <one command>

Commands (write names exactly as the observations do, in lower case with their number, \
e.g. "apple 1", "countertop 2"):
- go to <receptacle>
- open <receptacle> / close <receptacle>
- take <object> from <receptacle>
- put <object> in/on <receptacle>   (put the object you carry in or on the receptacle)
- use <lamp>   (turn a desklamp or floorlamp on)
- heat <object> with <microwave> / cool <object> with <fridge> / clean <object> with <sinkbasin>
- examine <object or receptacle>
- inventory
- look

You can carry one object at a time, and must be at a receptacle (and have opened it, if it \
opens) to take from it or put into it. If the observation is "Nothing happens.", your previous \
action was invalid and changed nothing: try a different action."""

THOUGHTS = {
    "go to": ("I need to check {0}.", "Next, I should go to {0}.", "Let me go to {0} and see what is there."),
    "open": ("{0} is closed; I should open it.", "Let me open {0} to see inside."),
    "close": ("I am done with {0}; I will close it.",),
    "take": ("I found {0}; I should take it.", "There is {0} in {1}; I will pick it up."),
    "put": ("Now I can put {0} in/on {1}.", "I should place {0} in/on {1}."),
    "heat": ("I should heat {0} with {1}.", "{0} needs to be hot; {1} can heat it."),
    "cool": ("I should cool {0} with {1}.", "{0} needs to be cool; {1} can cool it."),
    "clean": ("I should clean {0} with {1}.", "{0} needs to be clean; I will wash it in {1}."),
    "use": ("I should turn on {0} to see the object in its light.", "Now I can use {0}."),
    "examine": ("Let me examine {0} more closely.",),
}
SIMPLE_THOUGHTS = {"look": "Let me look around.", "inventory": "Let me check what I am carrying."}
ACTION_RE = re.compile(r"(go to|open|close|take|put|heat|cool|clean|use|examine) (.+?)"
                       r"(?: (?:from|in/on|with) (.+))?")
# Putting, in every form an agent may write it; the object and receptacle names are "<word(s)> <number>".
PUT_RE = re.compile(r"(?:put (.+? \d+) (?:in/on|in|on|into)|move (.+? \d+) to) (.+ \d+)")
AGENT_PUT = "put {0} in/on {1}"  # also ALFWorld 0.2.2's own command; 0.4's is "move {0} to {1}"
ENGINE_PUTS = {"old": AGENT_PUT, "new": "move {0} to {1}"}


class AlfWorldEnv(TextEnv):
    name = "alfworld"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, max_steps: int = 30, num_train: int | None = None, num_seen: int | None = None,
                 num_unseen: int | None = None, seed: int = 0, data_dir: str | None = None) -> None:
        self.max_steps = max_steps
        self.seed = seed
        root = data_dir or os.environ.get("ALFWORLD_DATA")  # (alfworld itself sets a default)
        official = os.path.join(root, "json_2.1.1") if root else ""
        self.official = official if os.path.isdir(official) else None
        if data_dir and not self.official:
            raise EnvError(f"no json_2.1.1/ in ALFWorld data_dir {data_dir!r}")
        default = (0, 0, 0) if self.official else (200, 40, 40)  # official: every game, as the paper evaluates
        self.sizes = {split: d if n is None else n
                      for split, n, d in zip(("train", "seen", "unseen"), (num_train, num_seen, num_unseen), default)}
        cache = os.environ.get("QEVOLVE_CACHE") or os.path.expanduser("~/.cache/qevolve")
        # Specs fix each game; the hash only guards against files from another generator version.
        version = hashlib.sha1(f"{gen.GEN_VERSION}/{gen.CAPS}/{gen.ALFWORLD_VERSION}".encode()).hexdigest()[:12]
        self.cache_dir = os.path.join(cache, "alfworld", version)
        self._tasks: dict[str, list[Task]] = {}
        self._gym = None
        self._game = ""  # the game file loaded in the engine
        self._put = ENGINE_PUTS["new"]  # the loaded game's own command for putting an object somewhere
        self._plan: list[str] | None = None  # the planner's remaining path; None: replan when asked
        self._start_len: int | None = None
        self._admissible: list[str] = []
        self._steps = 0
        self._won = False

    # ---- tasks ------------------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        split = canonical_split(split)
        if split not in self._tasks:
            games = self._official_games(split) if self.official else self._synthetic_games(split)
            self._tasks[split] = [Task("alfworld", name, i, split, source) for i, (name, source) in enumerate(games)]
        return list(self._tasks[split])

    def _official_games(self, split: str) -> list[tuple[str, str]]:
        games = []
        base = os.path.join(self.official, SPLIT_DIRS[split])
        for task_dir in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            task_type = task_dir.split("-")[0]
            if task_type not in gen.TASK_TYPES or "movable" in task_dir or "Sliced" in task_dir:
                continue
            for trial in sorted(os.listdir(os.path.join(base, task_dir))):
                game = os.path.join(base, task_dir, trial, "game.tw-pddl")
                if os.path.exists(os.path.join(base, task_dir, trial, "traj_data.json")) and solvable(game):
                    games.append((task_type, game))
        n = self.sizes[split]
        if 0 < n < len(games):  # evenly spaced, so every task type stays represented
            games = [games[i * len(games) // n] for i in range(n)]
        return games

    def _synthetic_games(self, split: str) -> list[tuple[str, str]]:
        n, types = max(self.sizes[split], 0), gen.TASK_TYPES
        if split == "seen":
            train = [gen.GameSpec.parse(t.source) for t in self.tasks("train")]
            taken, specs = set(train), []
            for i in range(n if train else 0):
                rng = random.Random(f"alfworld/seen/{self.seed}/{i}")
                same_type = [s for s in train if s.task_type == types[i % len(types)]] or train
                spec = replace(rng.choice(same_type), seed=rng.randrange(2**31))
                while spec in taken:  # a new game, never a train one
                    spec = replace(spec, seed=spec.seed + 1)
                taken.add(spec)
                specs.append(spec)
        else:
            scenes = gen.C.TRAIN_SCENE_NUMBERS if split == "train" else gen.C.TEST_SCENE_NUMBERS
            specs = [gen.sample_spec(random.Random(f"alfworld/{split}/{self.seed}/{i}"), types[i % len(types)], scenes)
                     for i in range(n)]
        return [(s.task_type, str(s)) for s in specs]

    # ---- episodes -----------------------------------------------------------------------------
    def reset(self, task: Task) -> tuple[str, dict]:
        if task.env != "alfworld":
            raise EnvError(f"not an ALFWorld task: {task.key}")
        if task.source.startswith("synth:"):
            game = gen.write_game(gen.GameSpec.parse(task.source), self.cache_dir)
        elif os.path.exists(task.source):
            game = task.source
        else:
            raise EnvError(f"ALFWorld game file not found: {task.source}")
        if game != self._game:
            try:  # textworld's loader fails with whatever its parser meets (KeyError, ValueError, ...)
                env = self._engine(game)
                env.gamefiles = [game]  # the next reset() plays this game (seed() rebuilds the game cycle)
                env.seed(0)
                raw, infos = env.reset()
                with open(game) as f:  # ALFWorld 0.4's games say "move X to Y", 0.2.2's "put X in/on Y"
                    self._put = ENGINE_PUTS["new" if "move {o} to {r}" in f.read() else "old"]
            except Exception as e:
                self.close()
                raise EnvError(f"{game}: the ALFWorld engine cannot load this game "
                               f"({type(e).__name__}: {str(e)[:200]})") from None
        else:  # the same game again (several rollouts per task): restart it without reloading the file
            raws, batch_infos = self._gym.batch_env.reset()
            raw, infos = raws[0], {k: v[0] for k, v in batch_infos.items()}
        self._game = game
        obs = "\n".join(raw.split("\n\n")[1:])  # drop the "-= Welcome to TextWorld, ALFRED! =-" banner, as ETO
        match = re.search(r"Your task is to: (.*)", obs)
        self._plan, self._start_len, self._steps, self._won = None, None, 0, False
        self._admissible = list(infos["admissible_commands"])
        return obs, {"instruction": match[1].strip() if match else "", "won": False, "score": 0.0,
                     "admissible_commands": self._agent_commands(), "gamefile": game}

    def _engine(self, game: str):
        """One TextWorld gym env for all episodes: its PDDL backend and planner library are reused."""
        if self._gym is None:
            import textworld
            import textworld.gym
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
            infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
            env_id = textworld.gym.register_game(game, infos, max_episode_steps=None,
                                                 wrappers=[AlfredDemangler(), AlfredInfos])
            self._gym = textworld.gym.make(env_id)
        return self._gym

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._gym is None:
            raise EnvError("call reset() before step()")
        command = str(action).strip()  # the engine strips too; anything else it does not know is "Nothing happens."
        if command not in self._admissible and (put := put_args(command)):
            command = self._put.format(*put)  # the agent's put in this game's words
        valid = command in self._admissible
        obs, _, _, infos = self._gym.step(command)
        self._steps += 1
        reward = 1.0 if infos["won"] and not self._won else 0.0
        self._won = self._won or bool(infos["won"])
        self._admissible = list(infos["admissible_commands"])
        if self._won:
            self._plan = []
        elif self._plan is not None:  # keep the plan while the actions follow it
            if self._plan and command == self._plan[0]:
                self._plan = self._plan[1:]
            elif valid and not command.startswith(INFO_COMMANDS):
                self._plan = None
        done = self._won or self._steps >= self.max_steps
        return obs, reward, done, {"won": self._won, "score": float(self._won), "valid": valid,
                                   "terminated": self._won, "admissible_commands": self._agent_commands()}

    def _agent_commands(self) -> list[str]:
        return [to_agent(c) for c in self._admissible]

    def expert_action(self) -> str | None:
        if self._gym is None:
            return None
        if self._plan is None:
            pddl = self._gym.batch_env.envs[0].unwrapped  # the PddlEnv under the wrappers
            # The same call that fills infos["policy_commands"] / AlfredExpert's "extra.expert_plan".
            self._plan = list(pddl._pddl_state.replan(pddl._entity_infos))
            if self._steps == 0:
                self._start_len = len(self._plan)
        return to_agent(self._plan[0]) if self._plan else None

    def expert_steps(self) -> int | None:
        """Length of the planner's path from the initial state (planned now, if not yet)."""
        if self._start_len is None and self._steps == 0 and self._gym is not None:
            self.expert_action()
        return self._start_len

    def think(self, action: str) -> str:
        action = action.strip()
        if action in SIMPLE_THOUGHTS:
            return SIMPLE_THOUGHTS[action]
        match = ACTION_RE.fullmatch(action)
        if not match:
            return f"I should {action} next."
        options = THOUGHTS[match[1]]
        template = options[zlib.crc32(action.encode()) % len(options)]
        text = template.format(match[2], match[3] or "")
        return text[0].upper() + text[1:]

    def close(self) -> None:
        if self._gym is not None:
            self._gym.close()
        self._gym, self._game = None, ""


def put_args(command: str) -> tuple[str, str] | None:
    """(object, receptacle) of a put command in any of its forms, else None."""
    put = PUT_RE.fullmatch(command)
    return (put[1] or put[2], put[3]) if put else None


def to_agent(command: str) -> str:
    """An engine command in the agent's words: every form of putting becomes "put X in/on Y"."""
    put = put_args(command)
    return AGENT_PUT.format(*put) if put else command


def solvable(game: str) -> bool:
    """The game file's `solvable` flag, as ALFWorld's loader reads it (a game without one is skipped).

    Both releases write it as the JSON object's last key, so the file's tail is read first; the whole
    file only when the tail does not have it."""
    with open(game, "rb") as f:
        f.seek(max(0, os.path.getsize(game) - 200))
        flag = re.search(rb'"solvable":\s*(true|false)\s*}\s*$', f.read())
    if flag:
        return flag[1] == b"true"
    try:
        with open(game) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise EnvError(f"{game}: not an ALFWorld game file ({e})") from None
    return isinstance(data, dict) and data.get("solvable") is True
