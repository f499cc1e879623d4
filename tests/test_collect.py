"""collect.py: expert export on the real ScienceWorld, policy rollouts, episode ends, the critic's rerank."""
import json
from types import SimpleNamespace

import pytest
import torch

import common
from conftest import run_script


def test_expert_export_is_schema_valid_react(sciworld_expert):
    trajs = common.read_jsonl(sciworld_expert)
    assert len(trajs) == 2 and all(t["success"] and t["reward"] == 1.0 for t in trajs)
    for t in trajs:
        assert t["source"] == "expert" and t["split"] == "train" and t["id"].endswith("/expert0")
        assert len(t["steps"]) <= 24
        for step, msg in zip(t["steps"], [m for m in t["messages"] if m["role"] == "assistant"]):
            assert msg["content"] == step["text"] and step["text"].startswith("Thought: ")
            assert common.parse_action(step["text"]) == step["action"]
    args = json.loads(sciworld_expert.with_suffix(".args.json").read_text())
    assert args["env"] == "sciworld" and args["num_tasks"] == 2


def test_rerun_skips_what_is_written(sciworld_expert, tmp_path):
    out = tmp_path / "resume.jsonl"
    first = sciworld_expert.read_text().splitlines()
    out.write_text(first[0] + "\n")  # as if killed after the first episode
    run_script("collect.py", "--env", "sciworld", "--num-tasks", "2", "--out", str(out))
    ids = [t["id"] for t in common.read_jsonl(out)]
    assert ids == [json.loads(line)["id"] for line in first]


def test_policy_rollouts_batched_and_cached_equal_one_at_a_time(tiny_policy, tmp_path):
    common_args = ["collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "3",
                   "--temperature", "0", "--max-steps", "3", "--max-new-tokens", "12"]
    run_script(*common_args, "--num-envs", "3", "--out", str(tmp_path / "fast.jsonl"))
    run_script(*common_args, "--num-envs", "1", "--no-kv-cache", "--out", str(tmp_path / "slow.jsonl"))
    fast, slow = (common.read_jsonl(tmp_path / f) for f in ("fast.jsonl", "slow.jsonl"))
    assert sorted(t["id"] for t in fast) == sorted(t["id"] for t in slow)
    slow = {t["id"]: t for t in slow}
    for t in fast:
        assert [s["text"] for s in t["steps"]] == [s["text"] for s in slow[t["id"]]["steps"]]
        assert t["messages"] == slow[t["id"]]["messages"]
        assert t["source"] == "policy" and len(t["steps"]) == 3 and t["steps"][-1]["done"]
        # the untrained policy never buys: the step cap cut every episode, whose chat keeps the state after it
        assert t["truncated"] and t["messages"][-1] == common.observation_message(t["steps"][-1]["observation"])
    summary = json.loads((tmp_path / "fast.summary.json").read_text())
    assert summary["episodes"] == 3 and summary["env_steps"] == 9
    # what collect.py writes, bc.py reads (policy data is schema-valid trajectories too)
    run_script("bc.py", "--data", str(tmp_path / "fast.jsonl"), "--model", "tiny", "--epochs", "1",
               "--out", str(tmp_path / "bc"))


def test_chat_past_max_length_ends_the_episode(tiny_policy, tmp_path):
    from transformers import AutoTokenizer
    argv = ["collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "2", "--num-envs", "2",
            "--temperature", "0", "--max-steps", "4", "--max-new-tokens", "12"]
    run_script(*argv, "--out", str(tmp_path / "full.jsonl"))
    full = common.read_jsonl(tmp_path / "full.jsonl")
    tok = AutoTokenizer.from_pretrained(common.resolve_model("tiny"))
    first = max(len(common.tokenize_chat(tok, t["messages"][:2], add_generation_prompt=True)[0]) for t in full)
    limit = first + 12 + 4  # room for the first answer, not for the observation after it
    proc = run_script(*argv, "--max-length", str(limit), "--out", str(tmp_path / "cut.jsonl"))
    cut = common.read_jsonl(tmp_path / "cut.jsonl")
    assert all(len(t["steps"]) == 4 and t["truncated"] for t in full)
    for t, f in zip(cut, full):
        assert t["truncated"] and len(t["steps"]) == 1 and t["steps"][0]["done"]
        # the state after the step does not fit: the chat ends with the answer
        assert t["steps"][0]["text"] == f["steps"][0]["text"] and t["messages"][-1]["role"] == "assistant"
        assert len(common.tokenize_steps(tok, t)[0]) <= limit
    assert "2 episodes ended early" in proc.stdout
    # the cut chats fit the training stages' own check at the same limit
    run_script("bc.py", "--data", str(tmp_path / "cut.jsonl"), "--model", "tiny", "--epochs", "1",
               "--max-length", str(limit), "--out", str(tmp_path / "bc"))


def test_killed_rollout_resumes_without_duplicates(tiny_policy, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT
    out = tmp_path / "killed.jsonl"
    argv = [sys.executable, "collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "6",
            "--num-envs", "1", "--max-steps", "2", "--max-new-tokens", "8", "--out", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = [t["id"] for t in common.read_jsonl(out)]
    assert 2 <= len(before) < 6
    run_script(*argv[1:])
    after = [t["id"] for t in common.read_jsonl(out)]
    assert after[:len(before)] == before and len(after) == len(set(after)) == 6


def test_step_caps_paper_by_default_etos_with_its_prompt():
    import collect
    from envs import Task
    from envs.sciworld import SciWorldEnv
    table = json.loads((common.ETO_DIR / "data_sciworld_max_steps.json").read_text())
    boil, alf, shop = Task("sciworld", "boil", 0, "train"), Task("alfworld", "x", 0, "train"), Task("webshop", "x", 0, "train")
    env = SciWorldEnv()  # no engine is started to read a cap
    short, eto = (collect.Args(env="sciworld", out="-", prompt=p) for p in ("short", "eto"))
    assert collect.step_cap(short, env, boil, env.max_steps) == env.max_steps == 24
    assert collect.step_cap(eto, env, boil, 24) == table["task-1-boil"] == 100
    assert collect.step_cap(collect.Args(env="sciworld", out="-", prompt="eto", max_steps=7), env, boil, 24) == 7
    for name, task, cap in (("alfworld", alf, 40), ("webshop", shop, 10)):
        assert collect.step_cap(eto, SimpleNamespace(name=name), task, 30) == cap


def test_an_ended_task_and_a_cut_episode_end_their_chats_differently():
    # WebShop's expert buys in a few steps: played through a Conversation, the task ends (chat ends with the
    # last answer, not truncated); with a cap of one step the episode is cut, and the chat keeps the state after
    # its last step, with the generation prompt, for the critic to read V there.
    from transformers import AutoTokenizer

    import collect
    import critic
    from envs import make_env
    tok = AutoTokenizer.from_pretrained(common.resolve_model("tiny"))
    env = make_env("webshop")
    task = env.tasks("train")[0]
    prompt = common.Prompt("short", "webshop", env.system_prompt)
    results = {}
    for cap in (10, 1):
        env.max_steps = cap
        conv = collect.Conversation(env, task, "t", tok, 4000, 4096, prompt)
        while not conv.done:
            conv.act(common.react("go on", env.expert_action()))
        results[cap] = conv.result(1)
    ended, cut = results[10], results[1]
    assert ended["success"] and not ended["truncated"] and ended["messages"][-1]["role"] == "assistant"
    assert cut["truncated"] and len(cut["steps"]) == 1 and not cut["success"]
    assert cut["messages"][-1] == common.observation_message(cut["steps"][0]["observation"])
    common.validate_trajectory(cut)
    ids, v_pos, q_pos = critic.encode(tok, cut)
    assert len(v_pos) == 2 and len(q_pos) == 1 and v_pos[-1] == ids.shape[1] - 1
    assert tok.decode(ids[0]).endswith(cut["steps"][0]["observation"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert len(critic.encode(tok, ended)[1]) == len(ended["steps"])


def test_reranker_plays_the_candidate_with_the_highest_q(tiny_policy, tmp_path):
    # A critic on the tiny model with random heads: the reranker's batched, left-padded Q of each candidate must
    # be the Q that critic.py reads for that answer in training (one forward over the chat, at its end-of-turn
    # token), and it must pick the largest.
    from peft import get_peft_model

    import collect
    import critic
    base, tok = common.load_base("tiny")
    common.seed_everything(3)
    config = common.lora_config(8, 16, 0.0)
    config.init_lora_weights = False  # an adapter that changes the features: reading Q through it must matter
    model = get_peft_model(base, config, adapter_name="critic")
    heads = critic.Heads(base.config.hidden_size)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    critic.save_critic(model, heads, tmp_path / "critic", "tiny")

    policy, tok, base_model = common.load_policy(str(tiny_policy))
    reranker = collect.Reranker(str(tmp_path / "critic"), policy, base_model)
    messages = common.first_messages("Act.", "Find the animal.", "You are in the kitchen.")
    texts = ["Thought: look.\nAction: look around", "Thought: go.\nAction: open door to outside", "Action: wait",
             "Thought: look.\nAction: look around"]
    got = reranker.q_values(tok, messages, texts)
    model, heads, _ = critic.load_critic(str(tmp_path / "critic"))
    want = []
    for text in texts:
        traj = {"messages": messages + [{"role": "assistant", "content": text}], "steps": [{}]}
        with torch.no_grad():
            want.append(critic.values(model, heads, *critic.encode(tok, traj))[1].item())
    assert got == pytest.approx(want, abs=1e-4)
    assert len(set(round(q, 4) for q in want)) == 3  # the three distinct answers score differently
    assert reranker.pick(tok, messages, texts) == max(range(4), key=lambda k: (want[k], -k))
    # the policy's adapter is active again after scoring
    assert policy.active_adapter == "policy"


def test_collect_with_a_reranking_critic(tiny_policy, tmp_path):
    from peft import get_peft_model

    import critic
    base, _ = common.load_base("tiny")
    model = get_peft_model(base, common.lora_config(8, 16, 0.0), adapter_name="critic")
    critic.save_critic(model, critic.Heads(base.config.hidden_size), tmp_path / "critic", "tiny")
    argv = ["collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "2", "--num-envs", "2",
            "--max-steps", "2", "--max-new-tokens", "8", "--rerank-with", str(tmp_path / "critic")]
    run_script(*argv, "--candidates", "3", "--out", str(tmp_path / "r.jsonl"))
    trajs = common.read_jsonl(tmp_path / "r.jsonl")
    assert len(trajs) == 2 and all(len(t["steps"]) == 2 for t in trajs)
    proc = run_script(*argv, "--temperature", "0", "--out", str(tmp_path / "greedy.jsonl"), check=False)
    assert proc.returncode == 2 and "--rerank-with: needs" in proc.stderr and "Traceback" not in proc.stderr
