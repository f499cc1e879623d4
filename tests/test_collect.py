"""collect.py: expert export on the real ScienceWorld, policy rollouts, episode ends, the critic's rerank."""
import json
from types import SimpleNamespace

import pytest
import torch

import chat
import common
import models
from conftest import run_script, tensorboard_scalars


def test_expert_export_is_schema_valid_react(sciworld_expert):
    trajs = common.read_jsonl(sciworld_expert)
    assert len(trajs) == 2 and all(t["success"] and t["reward"] == 1.0 for t in trajs)
    for t in trajs:
        assert t["source"] == "expert" and t["split"] == "train" and t["id"].endswith("/expert0")
        assert len(t["steps"]) <= 24
        for step, msg in zip(t["steps"], [m for m in t["messages"] if m["role"] == "assistant"]):
            assert msg["content"] == step["text"] and step["text"].startswith("Thought: ")
            assert chat.parse_action(step["text"]) == step["action"]
    args = json.loads(sciworld_expert.with_suffix(".args.json").read_text())
    assert args["env"] == "sciworld" and args["num_tasks"] == 2


def test_rerun_skips_what_is_written(sciworld_expert, tmp_path):
    out = tmp_path / "resume.jsonl"
    first = sciworld_expert.read_text().splitlines()
    out.write_text(first[0] + "\n")  # as if killed after the first episode
    run_script("collect.py", "--env", "sciworld", "--num-tasks", "2", "--out", str(out))
    ids = [t["id"] for t in common.read_jsonl(out)]
    assert ids == [json.loads(line)["id"] for line in first]


@pytest.mark.parametrize("env_name", ["webshop", "alfworld"])
def test_engine_plays_the_episodes_of_etos_one_at_a_time_loop(tiny_policy, tmp_path, env_name):
    # Greedy on a deterministic environment, the engine (2 slots for 5 tasks: slots are refilled as episodes end,
    # the shared prefix is copied in, the LoRA merged) plays the same answers as rollout.play_one, which prefills
    # the whole chat with generate every turn, one episode at a time, on the unmerged policy.
    import rollout
    from envs import make_env
    argv = ["collect.py", "--env", env_name, "--policy", str(tiny_policy), "--num-tasks", "5", "--temperature", "0",
            "--max-steps", "4", "--max-new-tokens", "12", "--num-envs", "2"]
    run_script(*argv, "--out", str(tmp_path / "fast.jsonl"))
    fast = {t["id"]: t for t in common.read_jsonl(tmp_path / "fast.jsonl")}
    model, tok, _ = models.load_policy(str(tiny_policy))
    env = make_env(env_name, max_steps=4)
    prompt = chat.Prompt("short", env_name, env.system_prompt)
    tasks = env.tasks("train")[:5]
    assert sorted(fast) == sorted(f"{t.key}/policy0" for t in tasks)
    for task in tasks:
        ref, got = rollout.play_one(env, task, "x", model, tok, prompt, 12), fast[f"{task.key}/policy0"]
        assert [s["text"] for s in got["steps"]] == [s["text"] for s in ref["steps"]]
        assert got["messages"] == ref["messages"] and got["truncated"] == ref["truncated"]
        assert got["source"] == "policy" and got["steps"][-1]["done"]
    summary = json.loads((tmp_path / "fast.summary.json").read_text())
    assert summary["episodes"] == 5 and summary["env_steps"] == sum(len(t["steps"]) for t in fast.values())
    if env_name == "webshop":  # the untrained policy never buys: every episode is cut and keeps its last state
        assert all(t["truncated"] and t["messages"][-1] == chat.observation_message(t["steps"][-1]["observation"])
                   for t in fast.values())
        # what collect.py writes, bc.py reads (policy data is schema-valid trajectories too)
        run_script("bc.py", "--data", str(tmp_path / "fast.jsonl"), "--model", "tiny", "--epochs", "1",
                   "--out", str(tmp_path / "bc"))


def test_several_splits_share_one_run_and_each_keeps_its_file(tiny_policy, tmp_path):
    # evolve.sh evaluates seen and unseen tasks in one process: each split's episodes go to its own file, with its
    # own summary, and are the episodes a run of that split alone plays (greedy, deterministic WebShop).
    argv = ["collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "2", "--temperature", "0",
            "--max-steps", "3", "--max-new-tokens", "12", "--num-envs", "3"]
    proc = run_script(*argv, "--split", "seen", "unseen", "--out", str(tmp_path / "both" / "{split}.jsonl"))
    for split in ("seen", "unseen"):
        both = common.read_jsonl(tmp_path / "both" / f"{split}.jsonl")
        run_script(*argv, "--split", split, "--out", str(tmp_path / f"{split}.jsonl"))
        alone = {t["id"]: t for t in common.read_jsonl(tmp_path / f"{split}.jsonl")}
        assert len(both) == 2 and all(t["split"] == split for t in both)
        assert all(t["messages"] == alone[t["id"]]["messages"] for t in both)
        summary = json.loads((tmp_path / "both" / f"{split}.summary.json").read_text())
        assert summary["split"] == split and summary["episodes"] == 2
        assert f"| webshop {split} |" in proc.stdout
    # TensorBoard beside the files: each episode under charts/, each split's greedy result under eval/
    scalars = tensorboard_scalars(tmp_path / "both" / "seen_unseen.logs")
    assert [s for s, _ in scalars["charts/episode_reward"]] == [1, 2, 3, 4]
    for split in ("seen", "unseen"):
        summary = json.loads((tmp_path / "both" / f"{split}.summary.json").read_text())
        assert scalars[f"eval/{split}_reward_x100"] == [(0, pytest.approx(summary["reward_x100"]))]
    bad = run_script(*argv, "--split", "seen", "unseen", "--out", str(tmp_path / "one.jsonl"), check=False)
    assert bad.returncode == 2 and "--out must hold {split}" in bad.stderr and "Traceback" not in bad.stderr


def test_engine_refills_slots_and_compacts_its_cache(tiny_policy):
    # More episodes than slots on a long chat: each refilled row forgets its last episode (its cache positions
    # masked, the shared prefix copied in) and the cache is compacted, yet each episode equals play_one's.
    from functools import partial

    import rollout
    from envs import make_env
    model, tok, _ = models.load_policy(str(tiny_policy))
    envs = [make_env("webshop", max_steps=6) for _ in range(2)]
    prompt = chat.Prompt("short", "webshop", envs[0].system_prompt)
    tasks = envs[0].tasks("train")[:4]

    def episode(task, env):
        return rollout.Conversation(env, task, task.key, tok, 4000, 4096, prompt)

    engine = rollout.Engine(rollout.for_rollouts(model, merge=False), tok, 16, 0.0)
    widths, compact = [], engine._compact

    def spy():  # the cache's width before and after each compaction check, and the longest row
        before = engine.mask.shape[1]
        compact()
        if len(engine.seen):
            widths.append((before, engine.mask.shape[1], int(engine.seen.max())))
    engine._compact = spy
    got = {c.traj_id: c.result(0) for c in engine.play(envs, [partial(episode, t) for t in tasks])}
    assert len(engine.prefix) > 50  # the system prompt, shared by every episode
    assert all(w <= s + 64 + s // 4 for _, w, s in widths)  # holes never outgrow the tokens in use
    assert any(w < before for before, w, _ in widths)  # and were dropped at least once
    for task in tasks:
        ref = rollout.play_one(envs[0], task, task.key, model, tok, prompt, 16)
        assert [s["text"] for s in got[task.key]["steps"]] == [s["text"] for s in ref["steps"]]


def test_chat_past_max_length_ends_the_episode(tiny_policy, tmp_path):
    from transformers import AutoTokenizer
    argv = ["collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "2", "--num-envs", "2",
            "--temperature", "0", "--max-steps", "4", "--max-new-tokens", "12"]
    run_script(*argv, "--out", str(tmp_path / "full.jsonl"))
    full = common.read_jsonl(tmp_path / "full.jsonl")
    tok = AutoTokenizer.from_pretrained(models.resolve_model("tiny"))
    first = max(len(chat.tokenize_chat(tok, t["messages"][:2], add_generation_prompt=True)[0]) for t in full)
    limit = first + 12 + 4  # room for the first answer, not for the observation after it
    proc = run_script(*argv, "--max-length", str(limit), "--out", str(tmp_path / "cut.jsonl"))
    cut = common.read_jsonl(tmp_path / "cut.jsonl")
    assert all(len(t["steps"]) == 4 and t["truncated"] for t in full)
    for t, f in zip(cut, full):
        assert t["truncated"] and len(t["steps"]) == 1 and t["steps"][0]["done"]
        # the state after the step does not fit: the chat ends with the answer
        assert t["steps"][0]["text"] == f["steps"][0]["text"] and t["messages"][-1]["role"] == "assistant"
        assert len(chat.tokenize_steps(tok, t)[0]) <= limit
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
    # the per-episode curve goes on from where the killed run stopped, no step twice
    steps = [s for s, _ in tensorboard_scalars(tmp_path / "killed.logs")["charts/episode_reward"]]
    assert steps == sorted(set(steps)) and steps[-1] == 6 and len(steps) >= 5


def test_step_caps_paper_by_default_etos_with_its_prompt():
    import collect
    from envs import Task
    from envs.sciworld import SciWorldEnv
    table = json.loads((chat.ETO_DIR / "data_sciworld_max_steps.json").read_text())
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

    import critic
    import rollout
    from envs import make_env
    tok = AutoTokenizer.from_pretrained(models.resolve_model("tiny"))
    env = make_env("webshop")
    task = env.tasks("train")[0]
    prompt = chat.Prompt("short", "webshop", env.system_prompt)
    results = {}
    for cap in (10, 1):
        env.max_steps = cap
        conv = rollout.Conversation(env, task, "t", tok, 4000, 4096, prompt)
        while not conv.done:
            conv.act(chat.react("go on", env.expert_action()))
        results[cap] = conv.result(1)
    ended, cut = results[10], results[1]
    assert ended["success"] and not ended["truncated"] and ended["messages"][-1]["role"] == "assistant"
    assert cut["truncated"] and len(cut["steps"]) == 1 and not cut["success"]
    assert cut["messages"][-1] == chat.observation_message(cut["steps"][0]["observation"])
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

    import critic
    import rollout
    base, tok = models.load_base("tiny")
    common.seed_everything(3)
    config = models.lora_config(8, 16, 0.0)
    config.init_lora_weights = False  # an adapter that changes the features: reading Q through it must matter
    model = get_peft_model(base, config, adapter_name="critic")
    heads = critic.Heads(base.config.hidden_size)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    critic.save_critic(model, heads, tmp_path / "critic", "tiny")

    policy, tok, base_model = models.load_policy(str(tiny_policy))
    reranker = rollout.Reranker(str(tmp_path / "critic"), policy, base_model)
    messages = chat.first_messages("Act.", "Find the animal.", "You are in the kitchen.")
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
    base, _ = models.load_base("tiny")
    model = get_peft_model(base, models.lora_config(8, 16, 0.0), adapter_name="critic")
    critic.save_critic(model, critic.Heads(base.config.hidden_size), tmp_path / "critic", "tiny")
    argv = ["collect.py", "--env", "webshop", "--policy", str(tiny_policy), "--num-tasks", "2", "--num-envs", "2",
            "--max-steps", "2", "--max-new-tokens", "8", "--rerank-with", str(tmp_path / "critic")]
    run_script(*argv, "--candidates", "3", "--out", str(tmp_path / "r.jsonl"))
    trajs = common.read_jsonl(tmp_path / "r.jsonl")
    assert len(trajs) == 2 and all(len(t["steps"]) == 2 for t in trajs)
    proc = run_script(*argv, "--temperature", "0", "--out", str(tmp_path / "greedy.jsonl"), check=False)
    assert proc.returncode == 2 and "--rerank-with: needs" in proc.stderr and "Traceback" not in proc.stderr


def test_a_full_finetuning_plays_and_is_refused_a_reranking_critic(tiny_full_policy, tmp_path):
    """A whole-model policy (bc.py --full-finetune) plays as an adapter does; the critic's adapter belongs on a
    LoRA policy's base weights, so reranking with it is refused."""
    argv = ["collect.py", "--env", "webshop", "--policy", str(tiny_full_policy), "--num-tasks", "2", "--num-envs", "2",
            "--max-steps", "2", "--max-new-tokens", "8"]
    run_script(*argv, "--temperature", "0", "--out", str(tmp_path / "greedy.jsonl"))
    trajs = common.read_jsonl(tmp_path / "greedy.jsonl")
    assert len(trajs) == 2 and all(t["source"] == "policy" and len(t["steps"]) == 2 for t in trajs)
    from peft import get_peft_model

    import critic
    base, _ = models.load_base("tiny")
    model = get_peft_model(base, models.lora_config(8, 16, 0.0), adapter_name="critic")
    critic.save_critic(model, critic.Heads(base.config.hidden_size), tmp_path / "critic", "tiny")
    proc = run_script(*argv, "--rerank-with", str(tmp_path / "critic"), "--out", str(tmp_path / "r.jsonl"), check=False)
    assert proc.returncode == 2 and "the policy is a full fine-tuning" in proc.stderr and "Traceback" not in proc.stderr


def test_task_lists_name_their_sets_and_a_round_draws_fresh_tasks(tiny_policy, tmp_path):
    from envs import Task, draw_tasks
    pool = ["lifespan-longest-lived/0", "lifespan-longest-lived/1", "lifespan-shortest-lived/0",
            "lifespan-shortest-lived/1", "lifespan-longest-lived/2", "lifespan-shortest-lived/2"]
    (tmp_path / "pool.txt").write_text("# a pool\n" + "\n".join(pool) + "\n")
    (tmp_path / "confirm.txt").write_text("lifespan-shortest-lived/110\n")
    expert = ["collect.py", "--env", "sciworld", "--policy", "expert", "--seed", "3"]
    for rnd in (1, 2):  # evolve.sh's iterations: each its own draw of 2, the families in equal shares
        out = tmp_path / f"round{rnd}.jsonl"
        run_script(*expert, "--task-file", f"train={tmp_path / 'pool.txt'}", "--num-tasks", "2", "--round", str(rnd),
                   "--out", str(out))
        want = draw_tasks([Task("sciworld", p.split("/")[0], int(p.split("/")[1]), "train") for p in pool], 2, rnd, 3)
        got = common.read_jsonl(out)
        assert [(t["task"], t["variation"]) for t in got] == [(t.name, t.variation) for t in want]
        assert {t["task"] for t in got} == {"lifespan-longest-lived", "lifespan-shortest-lived"}
        assert all(t["split"] == "train" for t in got)
    first, second = ({(t["task"], t["variation"]) for t in common.read_jsonl(tmp_path / f"round{r}.jsonl")}
                     for r in (1, 2))
    assert not first & second
    # a policy's evaluation on two named lists, one file each (a list's name: NAME= or the file's stem)
    run_script("collect.py", "--env", "sciworld", "--policy", str(tiny_policy), "--temperature", "0", "--max-steps",
               "2", "--max-new-tokens", "8", "--task-file", f"dev={tmp_path / 'pool.txt'}", str(tmp_path / "confirm.txt"),
               "--num-tasks", "1", "--out", str(tmp_path / "eval" / "{split}.jsonl"))
    dev, confirm = (common.read_jsonl(tmp_path / "eval" / f"{n}.jsonl") for n in ("dev", "confirm"))
    assert [(t["task"], t["variation"], t["split"]) for t in dev] == [("lifespan-longest-lived", 0, "dev")]
    assert [(t["task"], t["variation"], t["split"]) for t in confirm] == [("lifespan-shortest-lived", 110, "confirm")]
    # mistakes: one line each, no traceback
    (tmp_path / "bad.txt").write_text("lifespan-longest-lived/0\nlifespan-longest-lived/999\n")
    for argv, message in ((["--task-file", str(tmp_path / "bad.txt")], f"{tmp_path / 'bad.txt'}:2:"),
                          (["--split", "train", "--num-tasks", "2", "--round", "1"], "--round R"),
                          (["--task-file", str(tmp_path / "pool.txt"), str(tmp_path / "confirm.txt")],
                           "--out must hold {split}")):
        proc = run_script(*expert, *argv, "--out", str(tmp_path / "x.jsonl"), check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
