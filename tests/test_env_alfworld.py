"""ALFWorld adapter on the real ALFWorld engine (TextWorld-PDDL + Fast Downward), synthetic games."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import common
from conftest import run_script
from envs import EnvError
from envs import alfworld_gen as gen
from envs.alfworld import AlfWorldEnv, solvable

SIZES = dict(num_train=60, num_seen=12, num_unseen=12)


@pytest.fixture(scope="module")
def alf(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QEVOLVE_CACHE", str(tmp_path_factory.mktemp("qevolve_cache")))
        mp.delenv("ALFWORLD_DATA", raising=False)
        env = AlfWorldEnv(**SIZES)
        yield env
        env.close()


def combo(task):
    s = gen.GameSpec.parse(task.source)
    return s.task_type, s.obj, s.target, s.scene


def test_splits_are_deterministic_and_disjoint(alf):
    train, seen, unseen = (alf.tasks(s) for s in ("train", "seen", "unseen"))
    assert (len(train), len(seen), len(unseen)) == (60, 12, 12)
    assert alf.tasks("dev") == seen and alf.tasks("test") == unseen
    assert AlfWorldEnv(**SIZES).tasks("train") == train  # same list from a fresh adapter...
    code = "from envs.alfworld import AlfWorldEnv; print([t.source for t in AlfWorldEnv().tasks('unseen')[:12]])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    assert out.strip() == str([t.source for t in unseen])  # ...and from another process
    assert AlfWorldEnv(seed=1, **SIZES).tasks("train") != train
    for tasks in (train, seen, unseen):
        assert [t.variation for t in tasks] == list(range(len(tasks)))
        assert {t.name for t in tasks} == set(gen.TASK_TYPES)
    sources = [{t.source for t in ts} for ts in (train, seen, unseen)]
    assert not (sources[0] & sources[1]) and not (sources[0] & sources[2]) and not (sources[1] & sources[2])
    train_combos = {combo(t) for t in train}
    assert all(combo(t) in train_combos for t in seen)  # seen: new games of train combinations
    train_ors = {(c[1], c[2], c[3]) for c in train_combos}
    assert not any(combo(t)[1:] in train_ors for t in unseen)  # unseen: object-receptacle-scene never in train
    assert not {c[3] for c in train_combos} & {combo(t)[3] for t in unseen}


def test_games_respect_alfreds_placement_rules(alf):
    for task in alf.tasks("train")[:30]:
        spec = gen.GameSpec.parse(task.source)
        problem = gen.make_problem(spec)
        assert problem == gen.make_problem(spec)  # deterministic
        init = problem.split("(:init")[1].split("(:goal")[0]
        facts = [line.strip()[1:-1].split() for line in init.splitlines() if line.strip().startswith("(")]
        otype = {f[1]: f[2][:-4] for f in facts if f[0] == "objectType"}
        rtype = {f[1]: f[2][:-4] for f in facts if f[0] == "receptacleType"}
        for _, obj, recep in (f for f in facts if f[0] == "inReceptacle"):
            o, r = otype[obj], rtype[recep]
            assert o in gen.LAMPS or o in gen.C.VAL_RECEPTACLE_OBJECTS[r], (task.source, o, r)
            if spec.task_type != "look_at_obj_in_light":
                assert not (o == spec.obj and r == spec.target), task.source  # never solved at the start
        assert spec.obj in otype.values()


def test_expert_wins_every_task_type(alf):
    for task in alf.tasks("train")[:6]:  # the task types take turns
        obs, info = alf.reset(task)
        assert "Welcome to TextWorld" not in obs and obs.startswith("You are in the middle of a room.")
        assert obs.endswith("Your task is to: " + info["instruction"]) and info["instruction"]
        total, done, steps, planned = 0.0, False, 0, alf.expert_steps()
        while not done:
            action = alf.expert_action()
            assert action in info["admissible_commands"], (task.source, action)
            assert alf.think(action)
            obs, reward, done, info = alf.step(action)
            total, steps = total + reward, steps + 1
        assert info["won"] and info["score"] == 1.0 and total == 1.0 and reward == 1.0, task.source
        assert steps == planned < alf.max_steps and alf.expert_action() is None
    game_dirs = os.listdir(alf.cache_dir)  # written on first reset, whole or not at all
    assert {gen.GameSpec.parse(t.source).dirname for t in alf.tasks("train")[:6]} <= set(game_dirs)
    assert not [d for d in game_dirs if d.startswith(".")]
    for d in game_dirs:
        assert sorted(os.listdir(os.path.join(alf.cache_dir, d))) == ["game.tw-pddl", "traj_data.json"]


def test_invalid_actions_are_the_engines_nothing_happens(alf):
    obs, info = alf.reset(alf.tasks("seen")[0])
    expert = alf.expert_action()
    for bad in ("fly to the moon", "", "x" * 20000, "öffne den Kühlschrank ☃", "Go to Fridge 1",
                "Thought: hmm\nAction: look", "take unicorn 1 from table 9"):
        obs, reward, done, step = alf.step(bad)
        assert obs == "Nothing happens." and reward == 0.0 and not done and not step["valid"]
    assert alf.expert_action() == expert  # nothing changed, so the plan still applies
    obs, reward, done, step = alf.step(expert)
    assert step["valid"] and obs != "Nothing happens."


def test_step_cap_ends_the_episode(alf):
    alf.reset(alf.tasks("unseen")[1])  # a living room: small, so 30 steps are quick
    for t in range(alf.max_steps):
        _, reward, done, info = alf.step("look")
        assert done == (t == alf.max_steps - 1) and reward == 0.0 and info["valid"]
    assert not info["won"] and alf.max_steps == 30


def test_expert_replans_after_a_detour(alf):
    task = alf.tasks("train")[0]
    alf.reset(task)  # the same game again: restarted in place
    first = alf.expert_action()
    detour = next(a for a in alf.step("look")[3]["admissible_commands"] if a.startswith("go to") and a != first)
    obs, _, _, info = alf.step(detour)
    done = False
    while not done:
        obs, _, done, info = alf.step(alf.expert_action())
    assert info["won"]


def test_official_layout_is_read_like_alfworlds_loader(alf, tmp_path):
    game = gen.write_game(gen.GameSpec.parse(alf.tasks("train")[0].source), str(tmp_path / "src"))
    root = tmp_path / "alfworld_data" / "json_2.1.1"
    for split, task_dir, with_traj in [("train", "pick_and_place_simple-Box-None-ArmChair-230", True),
                                       ("train", "pick_and_place_simple-Box-None-Sofa-230", False),
                                       ("train", "pick_and_place_with_movable_recep-Box-Bowl-Sofa-1", True),
                                       ("valid_unseen", "pick_and_place_simple-Box-None-ArmChair-230", True)]:
        trial = root / split / task_dir / "trial_T20190000_000000_000000"
        trial.mkdir(parents=True)
        shutil.copy(game, trial / "game.tw-pddl")
        if with_traj:
            (trial / "traj_data.json").write_text(json.dumps({"task_type": task_dir.split("-")[0]}))
    official = AlfWorldEnv(data_dir=str(tmp_path / "alfworld_data"))
    train = official.tasks("train")
    assert [(t.name, t.variation) for t in train] == [("pick_and_place_simple", 0)]
    assert train[0].source.endswith("ArmChair-230/trial_T20190000_000000_000000/game.tw-pddl")
    assert official.tasks("seen") == [] and len(official.tasks("unseen")) == 1
    obs, info = official.reset(train[0])
    assert info["instruction"] and official.expert_action()
    official.close()
    with pytest.raises(EnvError):
        AlfWorldEnv(data_dir=str(tmp_path / "nothing_here"))


# ---------------------------------------------------------------- ALFWorld's official game files (tests/data/alfworld)
OFFICIAL = Path(__file__).parent / "data" / "alfworld"


@pytest.fixture(scope="module")
def official():
    env = AlfWorldEnv(data_dir=str(OFFICIAL))
    yield env
    env.close()


def test_official_games_are_the_ones_alfworlds_loader_keeps(official):
    train, seen = official.tasks("train"), official.tasks("seen")
    assert [t.name for t in train] == ["pick_clean_then_place_in_recep", "pick_cool_then_place_in_recep"]
    assert [t.name for t in seen] == ["look_at_obj_in_light", "pick_and_place_simple",
                                      "pick_heat_then_place_in_recep", "pick_two_obj_and_place"]
    assert not any("RemoteControl" in t.source for t in seen)  # its `solvable` flag is false
    assert solvable(str(next(OFFICIAL.rglob("*RemoteControl*/*/game.tw-pddl")))) is False
    assert official.tasks("unseen") == []  # no valid_unseen folder here
    assert len(AlfWorldEnv(data_dir=str(OFFICIAL), num_seen=2).tasks("seen")) == 2


def test_expert_wins_official_games_of_every_task_type_in_etos_words(official):
    for task in official.tasks("train") + official.tasks("seen"):
        obs, info = official.reset(task)
        assert obs.startswith("You are in the middle of a room.") and info["instruction"] in obs
        done, puts = False, 0
        while not done:
            action = official.expert_action()
            assert action in info["admissible_commands"] and not action.startswith("move ")
            if action.startswith("put "):  # ETO's words, which is also this 0.2.2 game's own command
                assert " in/on " in action
                puts += 1
                if puts == 1:  # the 0.4 form of the same command is accepted too
                    action = action.replace("put ", "move ", 1).replace(" in/on ", " to ")
            obs, reward, done, info = official.step(action)
            assert info["valid"], (task.source, action, obs)
        assert info["won"] and reward == 1.0 and (puts >= 1) == (task.name != "look_at_obj_in_light"), task.source


def test_synthetic_games_take_etos_put_too(alf):
    """ALFWorld 0.4's games (ours are written like them) say "move X to Y"; the agent still writes ETO's form."""
    task = next(t for t in alf.tasks("train") if t.name == "pick_and_place_simple")
    _, info = alf.reset(task)
    done = False
    while not done:
        action = alf.expert_action()
        _, _, done, info = alf.step(action)
        assert info["valid"] and not any(c.startswith("move ") for c in info["admissible_commands"])
    assert info["won"] and action.startswith("put ") and " in/on " in action


def test_a_game_the_engine_cannot_load_is_one_error_line_and_keeps_finished_episodes(tmp_path, monkeypatch):
    root = tmp_path / "data"
    shutil.copytree(OFFICIAL, root)
    broken = next(root.rglob("*RemoteControl*/*/game.tw-pddl"))  # claimed solvable, as 62 files were listed before
    broken.write_text(broken.read_text().replace('"solvable": false', '"solvable": true'))
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    out = tmp_path / "expert.jsonl"
    proc = run_script("collect.py", "--env", "alfworld", "--split", "seen", "--out", str(out), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {broken}: the ALFWorld engine cannot load this game (KeyError"), last
    assert [t["task"] for t in common.read_jsonl(out)] == ["look_at_obj_in_light"]  # played before it: kept
    broken.write_text(broken.read_text()[:1000])  # a cut file: no flag at its end, no JSON
    with pytest.raises(EnvError, match=f"{broken}: not an ALFWorld game file"):
        AlfWorldEnv(data_dir=str(root)).tasks("seen")


def test_policy_plays_an_official_game_through_collect(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(OFFICIAL))
    out = tmp_path / "policy.jsonl"
    run_script("collect.py", "--env", "alfworld", "--policy", str(tiny_policy), "--split", "seen", "--num-tasks", "1",
               "--max-steps", "2", "--max-new-tokens", "8", "--temperature", "0", "--out", str(out))
    (traj,) = common.read_jsonl(out)
    assert traj["source"] == "policy" and traj["task"] == "look_at_obj_in_light" and len(traj["steps"]) == 2
    assert traj["initial_observation"].startswith("You are in the middle of a room.")
