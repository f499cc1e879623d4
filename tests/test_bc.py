"""bc.py end to end on the tiny model: it learns (a LoRA adapter, or every weight), writes a loadable policy, and\nfails loudly on bad input."""
import json

import pytest
import torch

import chat
import common
import models
from conftest import run_script, tensorboard_scalars


def action_nll(model, tok, path) -> float:
    """Mean NLL per action token of the file's trajectories, computed here as bc.py's eval.json should."""
    nll, count = 0.0, 0
    for traj in common.read_jsonl(path):
        ids, spans = chat.tokenize_chat(tok, traj["messages"])
        mask = torch.zeros(1, len(ids), dtype=torch.long)
        for s, e in spans:
            mask[0, s:e] = 1
        with torch.no_grad():
            logp = models.action_logprobs(model, torch.tensor([ids]), torch.ones_like(mask), mask)
        nll, count = nll - logp.sum().item(), count + mask.sum().item()
    return nll / count


def test_bc_lowers_nll_and_writes_a_reloadable_policy(sciworld_expert, tmp_path):
    out = tmp_path / "bc"
    # Held-out = the training file itself: on the tiny random model we check learning, not generalisation.
    # Its frozen final norm and random tied embeddings bound how far LoRA can move the NLL (~0.3 nats).
    proc = run_script("bc.py", "--data", str(sciworld_expert), "--eval-data", str(sciworld_expert),
                      "--model", "tiny", "--out", str(out), "--epochs", "4", "--lr", "3e-2",
                      "--batch-size", "1", "--grad-accum", "1")
    result = json.loads((out / "eval.json").read_text())
    assert result["heldout_nll_after"] < result["heldout_nll_before"] - 0.1, result
    assert "held-out NLL of expert actions: before" in proc.stdout
    args = json.loads((out / "args.json").read_text())
    assert args["model"] == "tiny" and args["epochs"] == 4
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 8 and metrics[-1]["loss"] < metrics[0]["loss"]
    # TensorBoard holds the same curve under losses/ and charts/, and the held-out NLL under eval/
    scalars = tensorboard_scalars(out)
    assert [s for s, _ in scalars["losses/loss"]] == list(range(1, 9))
    assert [v for _, v in scalars["losses/loss"]] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert {"charts/lr", "charts/tokens_per_s", "eval/heldout_nll_after"} <= scalars.keys()
    assert scalars["eval/heldout_nll_after"][0][1] == pytest.approx(result["heldout_nll_after"], rel=1e-6)

    # The checkpoint reloads onto a fresh base and scores actions exactly as eval.json says.
    model, tok, base = models.load_policy(str(out))
    assert base == "tiny"
    assert abs(action_nll(model, tok, sciworld_expert) - result["heldout_nll_after"]) < 1e-4


def test_policy_checkpoint_errors_are_clear(tmp_path):
    (tmp_path / "empty").mkdir()
    try:
        models.load_policy(str(tmp_path / "empty"))
    except common.UserError as e:
        assert "not a policy checkpoint" in str(e)
    else:
        raise AssertionError("load_policy accepted an empty folder")


def test_too_long_chat_is_an_error_not_a_cut(sciworld_expert, tmp_path):
    proc = run_script("bc.py", "--data", str(sciworld_expert), "--model", "tiny", "--out", str(tmp_path / "o"),
                      "--max-length", "64", check=False)
    assert proc.returncode == 2 and "tokens > 64 (--max-length" in proc.stderr and "Traceback" not in proc.stderr


def test_init_continues_a_policy_for_a_set_number_of_steps(sciworld_expert, tmp_path):
    """The baselines' BC (evolve.sh's sft and rft): --init goes on from a policy's adapter, --steps counts optimizer
    steps across epochs, --successes-only drops the failed trajectories."""
    from safetensors.torch import load_file
    first = tmp_path / "first"
    run_script("bc.py", "--data", str(sciworld_expert), "--model", "tiny", "--out", str(first), "--epochs", "1",
               "--lr", "3e-2", "--grad-accum", "1")
    trajs = common.read_jsonl(sciworld_expert)
    failed = [{**t, "id": t["id"] + "/failed", "success": False, "reward": 0.0} for t in trajs]
    mixed = tmp_path / "mixed.jsonl"
    common.write_jsonl(mixed, trajs + failed)

    still = tmp_path / "still"  # learning rate 0: the adapter must come out as it went in
    proc = run_script("bc.py", "--init", str(first), "--data", str(mixed), "--successes-only", "--steps", "5",
                      "--grad-accum", "1", "--lr", "0", "--schedule", "constant", "--out", str(still))
    assert f"{len(trajs)} training and 0 held-out trajectories" in proc.stdout
    metrics = [json.loads(line) for line in (still / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5] and metrics[-1]["epoch"] == 2  # 2 a pass: 3 passes
    assert all(m["lr"] == 0 for m in metrics)
    before, after = (load_file(str(d / "policy" / "adapter_model.safetensors")) for d in (first, still))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(k.endswith("lora_B.weight") and before[k].abs().sum() > 0 for k in before)  # trained, not a fresh B=0
    assert models.read_meta(still, "policy")["base_model"] == "tiny"

    proc = run_script("bc.py", "--init", str(first), "--data", str(tmp_path / "none.jsonl"), "--successes-only",
                      "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    common.write_jsonl(tmp_path / "none.jsonl", failed)
    proc = run_script("bc.py", "--init", str(first), "--data", str(tmp_path / "none.jsonl"), "--successes-only",
                      "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "no successful trajectory (--successes-only)" in proc.stderr


def test_a_full_finetuning_trains_every_weight_and_reloads(sciworld_expert, tiny_full_policy, tmp_path):
    """--full-finetune: no adapter, every weight of the model trains; the checkpoint is the whole model, which
    loads as the policy bc.py measured, and --init goes on training every weight."""
    from safetensors.torch import load_file
    out = tmp_path / "full"
    run_script("bc.py", "--data", str(sciworld_expert), "--eval-data", str(sciworld_expert), "--model", "tiny",
               "--full-finetune", "--epochs", "2", "--lr", "1e-3", "--grad-accum", "1", "--out", str(out))
    result = json.loads((out / "eval.json").read_text())
    assert result["heldout_nll_after"] < result["heldout_nll_before"] - 0.1, result
    assert models.read_meta(out, "policy") == {"kind": "policy", "base_model": "tiny", "full_finetune": True}
    assert not (out / "policy" / "adapter_model.safetensors").exists()
    trained = load_file(str(out / "policy" / "model.safetensors"))
    base = load_file(str(models.resolve_model("tiny") + "/model.safetensors"))
    assert {k for k in base if not torch.equal(base[k], trained[k])} == set(base)  # every weight moved
    model, tok, _ = models.load_policy(str(out))
    assert models.is_full_finetune(model) and not model.training
    assert abs(action_nll(model, tok, sciworld_expert) - result["heldout_nll_after"]) < 1e-4

    more = tmp_path / "more"  # --init on a full fine-tuning: every weight goes on training
    run_script("bc.py", "--init", str(tiny_full_policy), "--data", str(sciworld_expert), "--steps", "1",
               "--lr", "1e-3", "--out", str(more))
    before, after = (load_file(str(d / "policy" / "model.safetensors")) for d in (tiny_full_policy, more))
    assert models.read_meta(more, "policy")["full_finetune"]
    assert {k for k in before if not torch.equal(before[k], after[k])} == set(before)

    proc = run_script("bc.py", "--data", str(sciworld_expert), "--model", "tiny", "--full-finetune",
                      "--load-in-4bit", "True", "--out", str(tmp_path / "q"), check=False)
    assert proc.returncode == 2 and "cannot train a 4-bit base" in proc.stderr and "Traceback" not in proc.stderr


TRAVEL = """
import json, sys
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
policy = sys.argv[1]
base = json.load(open(policy + "/adapter_config.json"))["base_model_name_or_path"]
model = AutoPeftModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(base)
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
out = model.generate(ids, max_new_tokens=12, do_sample=False)
print(json.dumps({"base": base, "answer": out[0, ids.shape[1]:].tolist()}))
"""


def test_a_policy_loads_with_plain_peft_and_answers_as_the_project_does(tmp_path):
    """A checkpoint names its base by the hub id (not a path into this machine's cache): plain peft and
    transformers load it, here offline from the embedded copy, and greedy answers match the project's loader."""
    import subprocess
    import sys
    from peft import get_peft_model
    model, tok = models.load_base("smollm2-135m")
    torch.manual_seed(0)
    model = get_peft_model(model, models.lora_config(8, 16, 0.0), adapter_name="policy")
    with torch.no_grad():  # LoRA's B starts at zero: make the adapter change the answers
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    models.save_policy(model, tmp_path, "smollm2-135m")
    config = json.loads((tmp_path / "policy" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == models.HUB_ID
    question = "Which animal lives longest: a mouse, an elephant or a bee?"
    proc = subprocess.run([sys.executable, "-c", TRAVEL, str(tmp_path / "policy"), question], capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    ours, tok, _ = models.load_policy(str(tmp_path))
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    answer = ours.eval().generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    base_only = ours.get_base_model()
    with ours.disable_adapter():
        untouched = base_only.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert plain == {"base": models.HUB_ID, "answer": answer} and answer != untouched
