"""Property tests: the action parser, the JSONL reader and relabel.label_trajectory on arbitrary text
(non-ASCII and long inputs included) never fail with anything but the documented error."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chat
import common
import relabel

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=2000)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(TEXT)
def test_parse_action_on_any_text(text):
    action = chat.parse_action(text)
    assert action is None or (action and "\n" not in action and action == action.strip() and action in text)


@FUZZ
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
               max_size=300).map(str.strip).filter(bool), TEXT.map(lambda t: t.replace("Action:", "")))
def test_parse_action_finds_what_react_writes(action, thought):
    assert chat.parse_action(chat.react(thought.replace("\n", " "), action)) == action


def trajectory(texts: list[str], observations: list[str], env: str) -> dict:
    steps = [{"text": t, "action": chat.parse_action(t), "observation": o, "env_reward": 0.0, "done": False,
              "format_ok": chat.parse_action(t) is not None, "valid": True} for t, o in zip(texts, observations)]
    messages = chat.first_messages("system", "u", observations[0] if observations else "")
    for t, o in zip(texts, observations):
        messages += [{"role": "assistant", "content": t}, chat.observation_message(o)]
    return {"id": "fuzz/0", "env": env, "task": "t", "variation": 0, "split": "train", "source": "policy",
            "iteration": 1, "instruction": "u", "initial_observation": observations[0] if observations else "",
            "messages": messages[:-1], "steps": steps, "reward": 0.0, "success": False}


@FUZZ
@given(st.lists(TEXT, min_size=1, max_size=6), st.lists(TEXT, min_size=6, max_size=6),
       st.sampled_from(["sciworld", "alfworld", "webshop"]))
def test_label_trajectory_on_any_text(texts, observations, env):
    out = relabel.label_trajectory(trajectory(texts, observations, env))
    fmt, inv, rep = relabel.PENALTIES[env]
    for step in out["steps"]:
        assert len(step["rules"]) <= 1
        assert step["aux_reward"] == {(): 0.0, ("format",): fmt, ("invalid",): inv, ("repeat",): rep}[tuple(step["rules"])]
        if step["action"] is None:
            assert step["rules"] == ["format"]


@FUZZ
@given(st.one_of(TEXT, st.binary(max_size=500).map(lambda b: b.decode("utf-8", "replace")),
                 st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=20), max_size=5).map(json.dumps)))
def test_read_jsonl_on_any_line(tmp_path_factory, line):
    path = tmp_path_factory.mktemp("fuzz") / "f.jsonl"
    good = json.dumps(trajectory(["Thought: x\nAction: look"], ["o"], "sciworld"))
    path.write_text(good + "\n" + line.replace("\n", " ") + "\n", encoding="utf-8")
    try:
        trajs = common.read_jsonl(path)
    except common.UserError as e:
        assert str(e).startswith(f"{path}:2:"), str(e)  # names the file and the bad line
    else:
        assert len(trajs) in (1, 2)


def test_read_jsonl_on_a_huge_line(tmp_path):
    t = trajectory(["Thought: " + "ü" * 2_000_000 + "\nAction: look"], ["o" * 1_000_000], "sciworld")
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(t, ensure_ascii=False) + "\n", encoding="utf-8")
    assert common.read_jsonl(path)[0]["steps"][0]["action"] == "look"
