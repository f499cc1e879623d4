"""Schema and JSONL files, ReAct parsing, action-token masks and log-probs."""
import json
from pathlib import Path

import pytest
import torch

import chat
import common
import models
from conftest import run_script


def test_parse_action():
    assert chat.parse_action("Thought: go.\nAction: go to kitchen") == "go to kitchen"
    assert chat.parse_action("Thought: x\nAction:  open door  \nObservation: y\nAction: no") == "open door"
    assert chat.parse_action("Thought: I will open the door.") is None
    assert chat.parse_action("Action:") is None
    assert chat.parse_action("") is None


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
    return models.load_base("tiny")


def test_action_mask_covers_exactly_the_assistant_turns(tiny):
    _, tok = tiny
    messages = chat.first_messages("You act.", "boil water", "You are in the kitchen.")
    messages += [{"role": "assistant", "content": "Thought: hot.\nAction: open stove"},
                 chat.observation_message("The stove is open."),
                 {"role": "assistant", "content": "Thought: wait.\nAction: wait"}]
    ids, spans = chat.tokenize_chat(tok, messages)
    decoded = [tok.decode(ids[s:e]) for s, e in spans]
    # Each span is the turn's text plus the template's end-of-turn marker, nothing of the prompt.
    # what the policy generates: the answer and its end-of-turn token, not the template's newline after it
    assert decoded == ["Thought: hot.\nAction: open stove<|im_end|>", "Thought: wait.\nAction: wait<|im_end|>"]
    assert tok.decode(ids[:spans[0][0]]).endswith("<|im_start|>assistant\n")


def test_action_logprobs_match_a_full_softmax(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 12))
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[0, 3:6], mask[1, 8:12] = 1, 1
    with torch.no_grad():
        got = models.action_logprobs(model, ids, attn, mask)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    want = torch.zeros(2, 12)
    for b, i in zip(*mask.nonzero(as_tuple=True)):
        want[b, i] = full[b, i - 1, ids[b, i]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_runs_the_decoder_in_bfloat16_and_the_heads_in_fp32(tiny):
    model, _ = tiny
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 16))
    mask = torch.zeros_like(ids)
    mask[0, 5:12] = 1
    seen = {}
    layer = model.get_decoder().layers[0].self_attn.q_proj
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.__setitem__("decoder", o.dtype)),
             model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.__setitem__("head", i[0].dtype))]
    try:
        with torch.no_grad():
            fp32 = models.action_logprobs(model, ids, torch.ones_like(ids), mask)
            assert seen == {"decoder": torch.float32, "head": torch.float32}
            bf16 = models.action_logprobs(model, ids, torch.ones_like(ids), mask, bf16=True)
            assert seen == {"decoder": torch.bfloat16, "head": torch.float32}
    finally:
        for h in hooks:
            h.remove()
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)  # it did compute in bfloat16
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.0)  # ~3 significant digits through the decoder


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


# ----------------------------------------------------------------------------- expert files from elsewhere
EXPERT_FILES = Path(__file__).parent / "data" / "expert_files"
AGENTGYM_OK = "OK. I'll follow your instructions and try my best to solve the task."  # AgentInstruct's too
ACK = {"eto_webshop_sft.json": "OK", "eto_alfworld_sft_role_content.json": "OK",
       "agentinstruct_alfworld.json": AGENTGYM_OK, "agentinstruct_webshop_role_content.json": "Ok.",
       "agenttraj_alfworld_role_content.json": AGENTGYM_OK, "agenttraj_sciworld_role_content.json": AGENTGYM_OK,
       "eto_style_sciworld_messages.json": None}  # the first answer of each file: an acknowledgement, or none


@pytest.mark.parametrize("name", sorted(ACK))
def test_released_expert_files_are_read_with_prompt_turns_left_out(name):
    """Real records of each layout: every answer after the task's first turn is a step with a parsed action, the
    acknowledgement before it is prompt, and relabel.py finds no format error in the expert's answers."""
    import relabel
    records = json.loads((EXPERT_FILES / name).read_text())
    trajs = common.read_jsonl(EXPERT_FILES / name)
    assert len(trajs) == len(records) >= 1
    for record, traj in zip(records, trajs):
        turns = [(t.get("from", t.get("role")), t.get("value", t.get("content")))
                 for t in record.get("conversations", record.get("messages"))]
        answers = [k for k, (who, _) in enumerate(turns) if who in ("gpt", "assistant")]
        if ACK[name] is not None:
            assert turns[answers[0]][1].strip() == ACK[name]
        steps = answers[1:] if ACK[name] is not None else answers  # the acknowledgement is no step
        assert [s["text"] for s in traj["steps"]] == [turns[k][1] for k in steps]
        assert all(s["action"] and s["format_ok"] for s in traj["steps"])
        task_turn = chat.strip_observation(turns[steps[0] - 1][1])
        assert traj["instruction"] == task_turn and ("Your task is to" in task_turn or "Instruction:" in task_turn)
        assert traj["env"] in name and traj["source"] == "expert" and traj["steps"][-1]["done"]
        assert traj["steps"][-1]["env_reward"] == traj["reward"] == record.get("reward", 1.0)
        assert [s["observation"] for s in traj["steps"][:-1]] == \
            [chat.strip_observation(turns[k + 1][1]) for k in steps[:-1]]
        assert "format" not in [r for s in relabel.label_trajectory(traj)["steps"] for r in s["rules"]]


def test_agent_answer_formats_parse():
    assert chat.parse_action("THOUGHT: the laptop is here.\n ACTION: take laptop 1 from bed 1") == \
        "take laptop 1 from bed 1"
    assert chat.parse_action("Thought:\nI think I should buy it.\n\nAction:\nclick[Buy Now]") == "click[Buy Now]"
    assert chat.parse_action("action: look") == "look"
    assert chat.parse_action("Thought: x\nAction:\nObservation: y") is None  # a label is no action


def test_eto_example_in_the_chat_is_prompt_and_json_list_errors_name_the_line(tiny, tmp_path):
    """ETO's own prompt (instruction, OK, one-shot example, task), as collect.py --prompt eto writes it."""
    task = "You are in the middle of a room. Looking quickly around you, you see a desk 1.\n\nYour task is to: x."
    messages = chat.Prompt("eto", "alfworld", "").first("x", task) + [
        {"role": "assistant", "content": "Thought: go.\nAction: go to desk 1"},
        {"role": "user", "content": "Observation: On the desk 1, you see a mug 1."},
        {"role": "assistant", "content": "Thought: take it.\nAction: take mug 1 from desk 1"}]
    records = [{"id": f"alfworld_{i}", "messages": messages} for i in range(3)]
    path, jsonl = tmp_path / "alfworld_sft.json", tmp_path / "alfworld_sft.jsonl"
    path.write_text(json.dumps(records, indent=1))
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    trajs = common.read_jsonl(path)
    assert trajs == common.read_jsonl(jsonl)  # the same records as JSONL
    assert [s["action"] for s in trajs[0]["steps"]] == ["go to desk 1", "take mug 1 from desk 1"]
    assert trajs[0]["instruction"] == task and trajs[0]["messages"] == messages
    _, tok = tiny  # the example's answers stay in the chat, but only the steps' answers are trained
    ids, spans = chat.tokenize_steps(tok, trajs[0])
    assert [tok.decode(ids[s:e]).split("\n")[0] for s, e in spans] == ["Thought: go.", "Thought: take it."]
    records[1]["messages"] = records[1]["messages"][:1]
    path.write_text(json.dumps(records, indent=1))
    second = [i for i, text in enumerate(path.read_text().splitlines(), 1) if text == " {"][1]
    with pytest.raises(common.UserError, match=rf"alfworld_sft.json:{second}: field 'conversations'"):
        common.read_jsonl(path)
    (tmp_path / "sft.json").write_text(json.dumps([{"id": "7", "conversations": messages}]))
    with pytest.raises(common.UserError, match=r"sft.json:1: record '7': cannot tell its environment.*pass --env"):
        common.read_jsonl(tmp_path / "sft.json")
    assert common.read_jsonl(tmp_path / "sft.json", env="alfworld")[0]["env"] == "alfworld"


@pytest.mark.parametrize("source, layout", [
    ("agenttraj_sciworld_role_content.json", "agenttraj.jsonl"),  # AgentGym: {item_id, [{from, loss, value}]}
    ("eto_alfworld_sft_role_content.json", "alfworld_sft.json"),  # ETO: one JSON list of {id, [{from, value}]}
    ("eto_style_sciworld_messages.json", "sciworld_sft.json")])
def test_documented_layouts_of_the_real_records(source, layout, tmp_path):
    """The layouts as their projects document them, made from the real records in tests/data (which were
    published re-keyed to role/content) by putting the original keys back: the same trajectories come out."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    records = []
    for r in json.loads((EXPERT_FILES / source).read_text()):
        turns = [{"from": names[t["role"]], "value": t["content"]} | ({"loss": t["role"] == "assistant"}
                 if layout.startswith("agenttraj") else {}) for t in r.get("conversations", r.get("messages"))]
        records.append({"item_id" if layout.startswith("agenttraj") else "id": r["id"], "conversations": turns})
    path = tmp_path / layout  # AgentGym's file name does not name the env: the id does
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if layout.endswith(".jsonl") else json.dumps(records))
    assert common.read_jsonl(path) == common.read_jsonl(EXPERT_FILES / source)


def test_tracker_keeps_jsonl_and_tensorboard_in_step_and_drops_what_a_resumed_run_redoes(tmp_path):
    from dataclasses import dataclass

    from conftest import tensorboard_scalars

    @dataclass
    class Args:
        lr: float = 0.1
        track: bool = False

    tracker = common.Tracker(tmp_path / "metrics.jsonl", tmp_path, Args())
    for step in (1, 2, 3):
        tracker.log(step, losses={"loss": 1.0 / step}, charts={"lr": 0.1})
    tracker.scalars(3, eval={"auc": 0.75})
    tracker.close()
    # the run was killed after step 3 with its resume state at step 2: step 3 is redone, with another value
    tracker = common.Tracker(tmp_path / "metrics.jsonl", tmp_path, Args(), resumed_step=2)
    tracker.log(3, losses={"loss": 0.2}, charts={"lr": 0.1})
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 1.0, "lr": 0.1}, {"step": 2, "loss": 0.5, "lr": 0.1},
                     {"step": 3, "loss": 0.2, "lr": 0.1}]
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["losses/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(0.2))]
    assert [s for s, _ in scalars["charts/lr"]] == [1, 2, 3] and scalars.get("eval/auc", []) == []  # purged


def test_track_logs_to_weights_and_biases_or_says_how_to_install_it(tmp_path, monkeypatch):
    import sys
    import types
    from dataclasses import dataclass

    @dataclass
    class Args:
        lr: float = 0.1
        track: bool = True

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(common.UserError, match="pip install wandb"):
        common.Tracker(tmp_path / "m.jsonl", tmp_path, Args())
    calls = []

    class Run:
        def finish(self):
            calls.append("finish")

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "qevolve-test")
    tracker = common.Tracker(tmp_path / "m.jsonl", tmp_path / "tb", Args())
    tracker.log(1, losses={"loss": 0.5})
    tracker.close()
    init = calls[0]
    # W&B mirrors the TensorBoard events (so both show the same curves) and keeps the run's flags as its config
    assert init["project"] == "qevolve-test" and init["sync_tensorboard"] and init["config"] == {"lr": 0.1, "track": True}
    assert calls[-1] == "finish"
