"""The real ScienceWorld engine through our thin adapter."""
from pathlib import Path

import pytest

from envs import Task, canonical_split


def test_splits_are_etos_and_disjoint(sciworld):
    train, seen, unseen = (sciworld.tasks(s) for s in ("train", "seen", "unseen"))
    assert (len(train), len(seen), len(unseen)) == (1483, 194, 211)
    keys = [{t.key for t in ts} for ts in (train, seen, unseen)]
    assert not (keys[0] & keys[2]) and not (keys[1] & keys[2])  # ETO's dev shares 54 pairs with its train
    assert canonical_split("dev") == "seen" and canonical_split("test") == "unseen"


def test_gold_path_wins_and_rewards_sum_to_score(sciworld):
    obs, info = sciworld.reset(Task("sciworld", "find-animal", 0, "train"))
    assert info["instruction"].startswith("Your task is to find")
    assert "This room is called" in obs
    total, done = info["score"], False
    while not done:
        obs, reward, done, step = sciworld.step(sciworld.expert_action())
        total += reward
    assert step["won"] and step["score"] == 1.0 and abs(total - 1.0) < 1e-9


def test_rejections_are_the_engines_own_text(sciworld):
    sciworld.reset(Task("sciworld", "find-animal", 0, "train"))
    for bad in ("fly to the moon", "", "pick up unicorn", "Thought: hmm\nAction: dance"):
        obs, reward, done, info = sciworld.step(bad)
        assert obs == "No known action matches that input."
        assert reward == 0 and not done and not info["valid"]


def test_step_cap_ends_the_episode(sciworld):
    sciworld.reset(Task("sciworld", "find-animal", 0, "train"))
    for t in range(sciworld.max_steps):
        _, _, done, info = sciworld.step("look around")
        assert done == (t == sciworld.max_steps - 1)
    assert not info["won"]


def test_the_jvm_keeps_no_performance_data_file(sciworld):
    """py4j reads the JVM's first output line as its port: a JVM that warns about a locked /tmp/hsperfdata file
    (a killed JVM's file lingering under a reused PID) failed to start. Without the file there is no warning."""
    import getpass
    import tempfile
    pid = sciworld.jvm().pid
    assert not (Path(tempfile.gettempdir()) / f"hsperfdata_{getpass.getuser()}" / str(pid)).exists()
    assert "-XX:-UsePerfData" in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_dead_jvm_is_restarted_and_the_episode_replayed(capfd):
    from envs import make_env
    env = make_env("sciworld")
    task = Task("sciworld", "find-animal", 0, "train")
    env.reset(task)
    for action in ("go to kitchen", "look around"):
        env.step(action)
    env.jvm().kill()
    env.jvm().wait()
    obs, reward, done, info = env.step("go to hallway")
    assert "restarting it and replaying 2 actions" in capfd.readouterr().err
    assert obs == "You move to the hallway." and not done
    env.close()


def test_a_list_cut_short_by_a_dead_jvm_raises():
    """py4j ends the iteration of a Java list quietly when the JVM dies mid-way; java_list must raise instead
    (collect once took a task list cut short for "unknown task" and stopped)."""
    from py4j.protocol import Py4JError

    from envs import make_env
    from envs.sciworld import java_list
    env = make_env("sciworld")
    env.reset(Task("sciworld", "find-animal", 0, "train"))
    gold = env._sw.server.getGoldActionSequence()
    assert java_list(gold)[:2] == ["open door to greenhouse", "go to greenhouse"]

    class CutShort:  # the same list as py4j hands it over when its iteration stops after the first item
        def __iter__(self):
            yield from list(gold)[:1]

        size = gold.size

    with pytest.raises(ConnectionError, match="1 of"):
        java_list(CutShort())
    iterator = iter(gold)
    assert next(iterator) == "open door to greenhouse"
    env.jvm().kill()
    env.jvm().wait()
    assert list(iterator) == []  # py4j: the JVM died mid-iteration, and the list just ends
    with pytest.raises(Py4JError):
        java_list(gold)  # the JVM is asked again at the end, and is gone
    env.close()


def test_hung_jvm_times_out_and_is_restarted(capfd):
    import signal

    from envs import make_env
    env = make_env("sciworld", step_timeout=5)
    task = Task("sciworld", "find-animal", 0, "train")
    env.reset(task)
    env.step("go to kitchen")
    env.jvm().send_signal(signal.SIGSTOP)  # alive but answering nothing, as a deadlocked engine
    obs, reward, done, info = env.step("go to hallway")
    assert "restarting it and replaying 1 actions" in capfd.readouterr().err
    assert obs == "You move to the hallway." and not done
    env.close()


def test_expert_looks_after_every_move():
    from envs.sciworld import with_looks
    gold = ["open door to outside", "go to outside", "focus on egg parrot", "teleport to kitchen", "look around",
            "go to hallway"]
    assert with_looks(gold) == ["open door to outside", "go to outside", "look around", "focus on egg parrot",
                                "teleport to kitchen", "look around", "go to hallway"]


# ----------------------------------------------------------------------------- task lists (data/tasks/)
def tasks_file(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "tasks" / f"lifespan-{name}.txt"


def test_the_studys_task_lists_are_what_their_rules_give_and_keep_apart(sciworld):
    import sys
    sys.path.insert(0, str(tasks_file("dev").parent.parent.parent / "tools"))
    import tasksets
    from envs import read_task_list
    lists = {n: read_task_list(str(tasks_file(n)), sciworld, n) for n in tasksets.HEADERS}
    keys = {n: {(t.name, t.variation) for t in ts} for n, ts in lists.items()}
    # the files are what tools/tasksets.py writes (the demonstrations' choice also reads the expert's path)
    rebuilt = tasksets.sets(lambda family, variation: 0)
    for name in ("dev", "pool", "confirm", "eto-unseen"):
        assert [(t.name, t.variation) for t in lists[name]] == rebuilt[name]
    assert {n: len(k) for n, k in keys.items()} == {"dev": 50, "pool": 226, "demos": 30, "confirm": 66,
                                                     "eto-unseen": 30}
    eto = {s: {(t.name, t.variation) for t in sciworld.tasks(s)} for s in ("train", "seen", "unseen")}
    assert not keys["dev"] & keys["pool"] and keys["demos"] <= keys["pool"]
    assert {k for k in eto["seen"] if k[0] in tasksets.FAMILIES} <= keys["dev"]  # ETO's dev tasks, and 20 more
    assert not keys["confirm"] & (eto["train"] | eto["seen"] | eto["unseen"])  # in no ETO split: untouched
    assert keys["eto-unseen"] == {k for k in eto["unseen"] if k[0] in tasksets.FAMILIES}
    assert not (keys["dev"] | keys["pool"]) & (keys["confirm"] | keys["eto-unseen"])
    for name in ("dev", "pool", "demos", "confirm"):  # the families in (near) equal shares
        per_family = [sum(t.name == f for t in lists[name]) for f in tasksets.FAMILIES]
        assert max(per_family) - min(per_family) <= 2, (name, per_family)
    assert all(t.split == "confirm" for t in lists["confirm"])


def test_a_bad_task_list_names_its_file_and_line(sciworld, tmp_path):
    from envs import EnvError, read_task_list
    path = tmp_path / "tasks.txt"
    for text, line, what in (("# ok\nlifespan-longest-lived/3\nlifespan-longest-lived/125\n", 3, "is no sciworld task"),
                             ("boil/1\nno-such-family/1\n", 2, "is no sciworld task"),
                             ("boil/1\nboil\n", 2, "is no sciworld task"),
                             ("boil/1\nboil/1 # again\n", 2, "listed twice"),
                             ("# nothing\n\n", None, "lists no task")):
        path.write_text(text)
        with pytest.raises(EnvError) as e:
            read_task_list(str(path), sciworld, "x")
        assert (f"{path}:{line}:" if line else f"{path}:") in str(e.value) and what in str(e.value)
    with pytest.raises(EnvError, match="no such task list"):
        read_task_list(str(tmp_path / "missing.txt"), sciworld, "x")


def test_draws_from_a_pool_are_fresh_balanced_and_seeded():
    from envs import draw_tasks
    pool = [Task("sciworld", f, v, "train") for f in ("a", "b", "c") for v in range(10 if f != "c" else 7)]
    rounds = [draw_tasks(pool, 6, r, seed=5) for r in (1, 2, 3, 4)]
    assert all(len(r) == 6 for r in rounds)
    assert all(sorted(t.name for t in r) == ["a", "a", "b", "b", "c", "c"] for r in rounds[:3])
    firsts = [t for r in rounds[:4] for t in r][:len(pool)]
    assert len(set(firsts)) == len(firsts) == 24  # no task twice while the pool lasts (27 tasks)
    assert draw_tasks(pool, 6, 2, seed=5) == rounds[1] and draw_tasks(pool, 6, 1, seed=6) != rounds[0]
    # past the pool's end the order starts over: round 5 holds the last 3 tasks and the first 3
    order = [t for r in (draw_tasks(pool, 27, 1, seed=5),) for t in r]
    assert draw_tasks(pool, 6, 5, seed=5) == order[24:] + order[:3]
