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
