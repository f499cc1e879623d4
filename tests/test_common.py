"""Schema and JSONL files, ReAct parsing, action-token masks and log-probs."""
import json

import pytest
import torch

import common
from conftest import run_script


def test_parse_action():
    assert common.parse_action("Thought: go.\nAction: go to kitchen") == "go to kitchen"
    assert common.parse_action("Thought: x\nAction:  open door  \nObservation: y\nAction: no") == "open door"
    assert common.parse_action("Thought: I will open the door.") is None
    assert common.parse_action("Action:") is None
    assert common.parse_action("") is None


def test_reader_names_file_line_and_field(sciworld_expert, tmp_path):
    lines = sciworld_expert.read_text().splitlines()
    good = json.loads(lines[0])
    cases = {
        "not json {": "not valid JSON",
        json.dumps({k: v for k, v in good.items() if k != "reward"}): "missing field 'reward'",
        json.dumps({**good, "steps": [{**good["steps"][0], "env_reward": "high"}]}):
            "field 'steps[0].env_reward': expected int/float",
        json.dumps({**good, "steps": []}): "field 'steps': a trajectory needs at least one step",
        json.dumps({**good, "env": "minecraft"}): "field 'env'",
        json.dumps({**good, "variation": True}): "field 'variation': expected int",
    }
    for bad, expected in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(lines[0] + "\n" + bad + "\n")
        with pytest.raises(common.UserError) as e:
            common.read_jsonl(path)
        assert str(e.value).startswith(f"{path}:2:") and expected in str(e.value), str(e.value)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(common.UserError, match="no trajectories"):
        common.read_jsonl(tmp_path / "empty.jsonl")


def test_non_finite_reward_is_rejected(sciworld_expert, tmp_path):
    good = json.loads(sciworld_expert.read_text().splitlines()[0])
    path = tmp_path / "nan.jsonl"
    path.write_text(json.dumps({**good, "reward": float("nan")}) + "\n")
    with pytest.raises(common.UserError, match="nan.jsonl:1: field 'reward': nan is not a finite number"):
        common.read_jsonl(path)


def test_reads_etos_released_format(tmp_path):
    record = {"id": "sciworld_7", "conversations": [
        {"from": "human", "value": "Task: boil water"},
        {"from": "gpt", "value": "Thought: look first.\nAction: look around"},
        {"from": "human", "value": "Observation: This room is called the kitchen."},
        {"from": "gpt", "value": "Thought: done.\nAction: focus on water"}]}
    path = tmp_path / "eto.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (traj,) = common.read_jsonl(path)
    assert traj["env"] == "sciworld" and traj["source"] == "expert"
    assert [s["action"] for s in traj["steps"]] == ["look around", "focus on water"]
    assert traj["steps"][0]["observation"] == "This room is called the kitchen."


def test_append_then_read_round_trips(tmp_path, sciworld_expert):
    trajs = common.read_jsonl(sciworld_expert)
    out = tmp_path / "copy.jsonl"
    for t in trajs:
        common.append_jsonl(out, t)
    assert common.read_jsonl(out) == trajs


@pytest.fixture(scope="module")
def tiny():
    return common.load_base("tiny")


def test_action_mask_covers_exactly_the_assistant_turns(tiny):
    _, tok = tiny
    messages = common.first_messages("You act.", "boil water", "You are in the kitchen.")
    messages += [{"role": "assistant", "content": "Thought: hot.\nAction: open stove"},
                 common.observation_message("The stove is open."),
                 {"role": "assistant", "content": "Thought: wait.\nAction: wait"}]
    ids, spans = common.tokenize_chat(tok, messages)
    decoded = [tok.decode(ids[s:e]) for s, e in spans]
    # Each span is the turn's text plus the template's end-of-turn marker, nothing of the prompt.
    assert decoded == ["Thought: hot.\nAction: open stove<|im_end|>\n", "Thought: wait.\nAction: wait<|im_end|>\n"]
    assert tok.decode(ids[:spans[0][0]]).endswith("<|im_start|>assistant\n")


def test_action_logprobs_match_a_full_softmax(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 12))
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[0, 3:6], mask[1, 8:12] = 1, 1
    with torch.no_grad():
        got = common.action_logprobs(model, ids, attn, mask)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    want = torch.zeros(2, 12)
    for b, i in zip(*mask.nonzero(as_tuple=True)):
        want[b, i] = full[b, i - 1, ids[b, i]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("script", ["bc.py", "collect.py", "relabel.py", "critic.py", "bppo.py",
                                    "bench/rollout_speed.py", "bench/critic_speed.py",
                                    "bench/gpu_memory.py", "bench/bppo_memory.py", "envs/webshop_build.py",
                                    "tools/results.py"])
def test_every_script_answers_help(script):
    assert "usage" in run_script(script, "--help").stdout.lower()


def test_bad_jsonl_gives_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"\n')
    proc = run_script("bc.py", "--data", str(bad), "--model", "tiny", "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {bad}:1: not valid JSON (Expecting ',' delimiter at column 11)"
