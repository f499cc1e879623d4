"""relabel.py's rules (paper eq. 3) on real feedback from the three real environments."""

import pytest

import chat
import common
import relabel
from rollout import env_step, trajectory
from conftest import run_script
from envs import make_env


def play(env, task, texts):
    """Play the answers in `texts` on the real environment and return the trajectory collect.py would write."""
    obs0, info = env.reset(task)
    messages = chat.first_messages(env.system_prompt, info["instruction"], obs0)
    steps = []
    for t, text in enumerate(texts):
        messages.append({"role": "assistant", "content": text})
        step, _ = env_step(env, text, t)
        steps.append(step)
        messages.append(chat.observation_message(step["observation"]))
    return trajectory(env, task, f"{task.key}/policy0", "policy", 1, info, obs0, messages[:-1], steps, 0.0, False)


def rules_of(traj):
    return [s["rules"][0] if s["rules"] else None for s in relabel.label_trajectory(traj)["steps"]]


def test_sciworld_rules(sciworld):
    task = sciworld.tasks("train")[1]  # find-animal 0, starts in the hallway
    traj = play(sciworld, task, ["Thought: look.\nAction: look around", "Thought: again.\nAction: look around",
                                 "Thought: fly.\nAction: fly to the moon", "I have no idea",
                                 "Thought: go.\nAction: go to kitchen"])
    assert traj["steps"][2]["observation"] == "No known action matches that input."
    # o_1 is the initial room again (o_0 = look around), so the first look is a repeat too
    assert rules_of(traj) == ["repeat", "repeat", "invalid", "format", None]
    labelled = relabel.label_trajectory(traj)
    assert [s["aux_reward"] for s in labelled["steps"]] == [-0.1, -0.1, -0.2, -0.3, 0.0]
    assert [s["env_reward"] for s in labelled["steps"]] == [s["env_reward"] for s in traj["steps"]]


def test_alfworld_rules():
    env = make_env("alfworld")
    task = env.tasks("train")[0]
    traj = play(env, task, ["Thought: hm.\nAction: fly to the moon", "Thought: look.\nAction: look",
                            "Thought: look.\nAction: look", "Thought: no action here"])
    env.close()
    assert traj["steps"][0]["observation"] == "Nothing happens."
    assert rules_of(traj) == ["invalid", None, "repeat", "format"]


def test_webshop_rules_and_defaults():
    env = make_env("webshop")
    task = env.tasks("train")[0]
    traj = play(env, task, ["Thought: click.\nAction: click[nothing here]", "Action: search[shirt]",
                            "Thought: I forgot the format"])
    assert traj["steps"][0]["observation"].startswith("Invalid action!")
    assert rules_of(traj) == ["invalid", None, "format"]
    # WebShop's paper penalties: only format errors cost anything
    assert [s["aux_reward"] for s in relabel.label_trajectory(traj)["steps"]] == [0.0, 0.0, -0.3]


def test_etos_format_error_text_counts():
    assert relabel.fired_rule("Thought: x\nAction: look", "Observation: Invalid format. The input must contains "
                              "'Action: '", "room", "webshop") == "format"
    assert relabel.fired_rule("Thought: x\nAction: look", "Nothing happened.", "room", "alfworld") == "invalid"


@pytest.fixture()
def hybrid(sciworld, sciworld_expert, tmp_path):
    self_data = tmp_path / "self.jsonl"
    traj = play(sciworld, sciworld.tasks("train")[1], ["Thought: fly.\nAction: fly", "no format"])
    common.append_jsonl(self_data, traj)
    return sciworld_expert, self_data, tmp_path / "hybrid.jsonl"


def test_cli_merges_and_counts(hybrid):
    expert, self_data, out = hybrid
    proc = run_script("relabel.py", str(expert), str(self_data), "--out", str(out), "--inv", "-0.5")
    trajs = common.read_jsonl(out)
    assert [t["source"] for t in trajs] == ["expert", "expert", "policy"]
    assert [s["aux_reward"] for s in trajs[-1]["steps"]] == [-0.5, -0.3]
    assert all("rules" in s and "aux_reward" in s for t in trajs for s in t["steps"])
    assert "sciworld   policy        2       1        1       0" in proc.stdout


def test_off_writes_zeros_and_duplicates_fail(hybrid):
    expert, self_data, out = hybrid
    run_script("relabel.py", str(expert), str(self_data), "--out", str(out), "--off")
    assert all(s["aux_reward"] == 0.0 for t in common.read_jsonl(out) for s in t["steps"])
    proc = run_script("relabel.py", str(expert), str(expert), "--out", str(out), check=False)
    assert proc.returncode == 2 and "is already in" in proc.stderr
