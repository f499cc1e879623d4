"""The paper-scale path rehearsed on the CPU: `REHEARSAL=1 bash evolve.sh` runs PRESET=7b's loop (its flags,
DEPARTURES=none, ETO's prompt) on a 4-bit nf4 base (double quantization) with the policy's and the critic's LoRA
adapters on it, on the tiny model and a few tasks; killed in iteration 1's rollouts and run again. Then what
only this path exercises: gradients through 4-bit layers, adapters saved and reloaded on a quantized base, π_old
and π_ref on one base against fresh loads, the critic on the policy's quantized weights, greedy rollouts."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import chat
import common
import models
from conftest import ROOT


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("rehearsal") / "run"

    def start():
        return subprocess.Popen(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "REHEARSAL": "1", "RUN": str(run)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc = start()
    collecting, deadline = run / "1" / "collect" / "self.jsonl", time.time() + 900
    while not (collecting.exists() and collecting.read_text().count("\n") >= 1):  # episodes in flight
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "iteration 1 never started collecting"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    out, _ = start().communicate(timeout=1800)
    assert (run / "results.md").exists(), out[-3000:]
    return run


def quantized(model) -> dict[str, torch.Tensor]:
    import bitsandbytes as bnb
    return {name.split("model.", 1)[-1]: m.weight.data.clone() for name, m in model.named_modules()
            if isinstance(m, bnb.nn.Linear4bit)}


def step_logprobs(model, tok, traj: dict) -> torch.Tensor:
    ids, spans = chat.tokenize_steps(tok, traj)
    mask = torch.zeros(1, len(ids), dtype=torch.long)
    for s, e in spans:
        mask[0, s:e] = 1
    ids = torch.tensor([ids])
    return models.action_logprobs(model, ids, torch.ones_like(ids), mask)[mask.bool()]


def test_lora_gradients_through_4bit_layers_match_the_dequantized_model(tiny_policy):
    """bitsandbytes' CPU backend repacks a 4-bit weight for an inference kernel without a backward pass on the
    first eval-mode pass; models.keep_4bit_trainable keeps training stages off it, so LoRA gradients after an
    eval pass (BPPO's π_old) are those of the same model with the nf4 weights dequantized into fp32."""
    import bitsandbytes as bnb
    expert = common.read_jsonl(ROOT / "tests" / "data" / "expert_files" / "eto_style_sciworld_messages.json")
    grads = {}
    for kind in ("nf4", "dequantized"):
        model, tok, _ = models.load_policy(str(tiny_policy), load_in_4bit=kind == "nf4", trainable=True)
        if kind == "dequantized":
            ref, _, _ = models.load_policy(str(tiny_policy), load_in_4bit=True)
            layers = {n: m for n, m in ref.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
            for name, m in model.named_modules():
                if name in layers:
                    w = layers[name].weight
                    m.weight.data.copy_(bnb.functional.dequantize_4bit(w.data, w.quant_state).float())
        torch.manual_seed(0)
        for name, p in model.named_parameters():  # an adapter that does something
            if "lora_B" in name:
                p.data.normal_(0, 0.1)
        model.eval()
        with torch.no_grad():
            step_logprobs(model, tok, expert[0])
        assert not any(getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False)
                       for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
        model.train()
        (-step_logprobs(model, tok, expert[0]).sum()).backward()
        grads[kind] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["nf4"].keys() == grads["dequantized"].keys() and len(grads["nf4"]) == 28
    for name, g in grads["dequantized"].items():
        assert torch.allclose(grads["nf4"][name], g, rtol=1e-3, atol=1e-5), name


def test_the_rehearsal_runs_the_paper_settings_in_4bit_and_resumes(rehearsal):
    settings = (rehearsal / "settings.txt").read_text()
    for line in ("LOAD_IN_4BIT    1", "DEPARTURES      none", "PROMPT          eto", "SAMPLES         3",
                 "CRITIC_TAU      0.005", "MODEL           tiny"):
        assert line in settings
    for stage in ("0/bc", "1/critic", "1/bppo", "2/critic", "2/bppo"):
        args = json.loads((rehearsal / stage / "args.json").read_text())
        assert args["load_in_4bit"] is True and not args.get("refit_rounds") and not args.get("max_grad_norm")
    ids = [t["id"] for t in common.read_jsonl(rehearsal / "1" / "collect" / "self.jsonl")]
    assert len(ids) == len(set(ids)) == 2 * 3  # killed mid-stage: no episode lost or written twice
    assert "| Iter 2 |" in (rehearsal / "results.md").read_text()
    config = json.loads((rehearsal / "2" / "bppo" / "policy" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"].endswith("tiny-smollm2")  # the tiny model is a local folder


def test_old_and_reference_logprobs_on_one_4bit_base_equal_fresh_loads(rehearsal):
    """Iteration 2's BPPO holds π_old (iteration 1's policy) and π_ref (BC) as two adapters on one nf4 base: each
    log-probability is what a fresh 4-bit load of that checkpoint alone gives."""
    import bppo
    args = bppo.Args(data=str(rehearsal / "2" / "critic" / "scored.jsonl"), policy=str(rehearsal / "1" / "bppo"),
                     reference=str(rehearsal / "0" / "bc"), load_in_4bit=True)
    trajs = common.read_jsonl(args.data)[:3]
    model, tok, _, same_ref = bppo.load_models(args)
    batches = bppo.encode(trajs, tok, model, args)
    bppo.old_and_ref_logprobs(model, batches, same_ref, args)
    assert not same_ref
    for key, checkpoint in (("logp_old", args.policy), ("logp_ref", args.reference)):
        fresh, ftok, _ = models.load_policy(checkpoint, load_in_4bit=True, trainable=True)  # BPPO's kernels
        fresh.eval()
        with torch.no_grad():
            for b, t in zip(batches, trajs):
                assert torch.allclose(b[key][b["mask"].bool()], step_logprobs(fresh, ftok, t), atol=1e-5)
    assert not torch.allclose(batches[0]["logp_old"], batches[0]["logp_ref"])  # two different policies


def test_the_critic_reads_the_policys_quantized_weights(rehearsal):
    """The critic's adapter sits on the same nf4 weights as the policy's: loaded on its own or onto the policy's
    model (the reranker), it gives the same Q."""
    import critic
    from rollout import Reranker
    policy, tok, base = models.load_policy(str(rehearsal / "1" / "bppo"), load_in_4bit=True)
    alone, heads, _ = critic.load_critic(str(rehearsal / "2" / "critic"), load_in_4bit=True)
    assert quantized(policy).keys() == quantized(alone).keys()
    assert all(torch.equal(a, b) for a, b in zip(quantized(policy).values(), quantized(alone).values()))
    traj = common.read_jsonl(rehearsal / "2" / "critic" / "scored.jsonl")[0]
    alone.eval()
    with torch.no_grad():
        _, Q, _ = critic.values(alone, heads, *critic.encode(tok, traj))
    reranker = Reranker(str(rehearsal / "2" / "critic"), policy.eval(), base)
    answer = traj["steps"][0]["text"]  # the first step's answer, after the chat before it
    k = next(i for i, m in enumerate(traj["messages"]) if m["role"] == "assistant" and m["content"] == answer)
    q = reranker.q_values(tok, traj["messages"][:k], [answer])
    assert abs(q[0] - float(Q[0])) < 1e-4


def test_greedy_4bit_rollouts_are_the_one_at_a_time_loops(rehearsal, tmp_path):
    """The batched engine on a 4-bit policy (the adapter unmerged) plays what rollout.play_one plays (WebShop's
    mini shop: deterministic)."""
    import rollout
    from envs import make_env
    policy = str(rehearsal / "0" / "bc")
    out = tmp_path / "fast.jsonl"
    proc = subprocess.run(["python", "collect.py", "--env", "webshop", "--policy", policy, "--num-tasks", "3",
                           "--temperature", "0", "--max-steps", "3", "--max-new-tokens", "12", "--num-envs", "2",
                           "--load-in-4bit", "True", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fast = {t["id"]: t for t in common.read_jsonl(out)}
    model, tok, _ = models.load_policy(policy, load_in_4bit=True)
    env = make_env("webshop", max_steps=3)
    prompt = chat.Prompt("short", "webshop", env.system_prompt)
    for task in env.tasks("train")[:3]:
        ref = rollout.play_one(env, task, "x", model, tok, prompt, 12)
        assert [s["text"] for s in fast[f"{task.key}/policy0"]["steps"]] == [s["text"] for s in ref["steps"]]
