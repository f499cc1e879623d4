"""bppo.py: eq. 7's clipped surrogate by hand, and a real update that moves log-probabilities the right way."""
import json
import math
import shutil

import pytest
import torch

import bppo
import chat
import common
import models
from conftest import run_script, tensorboard_scalars


def test_bppo_loss_by_hand():
    logp_new = torch.log(torch.tensor([[1.5, 0.1, 1.5, 1.2, 1.0]]))
    logp_old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # η=1.5, A=+1: clipped at 1 + ε_high = 1.4     -> 1.4
    # η=0.1, A=-1: clipped at 1 - ε_low = 0.2       -> min(-0.1, -0.2) = -0.2
    # η=1.5, A=-1: the unclipped side is smaller     -> -1.5
    # η=1.2, A=+1: inside the clip range             -> 1.2 ; the fifth token is masked out
    want = -(1.4 - 0.2 - 1.5 + 1.2) / 4
    got = bppo.bppo_loss(logp_new, logp_old, adv, mask, eps_low=0.8, eps_high=0.4)
    assert got.item() == pytest.approx(want, abs=1e-6)
    # a symmetric 0.2 clip caps the pushes earlier
    got = bppo.bppo_loss(logp_new, logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert got.item() == pytest.approx(-(1.2 - 0.8 - 1.5 + 1.2) / 4, abs=1e-6)


def test_clip_stops_the_gradient_outside_the_trust_region():
    logp = torch.log(torch.tensor([[1.5, 0.1, 1.1]])).requires_grad_()
    bppo.bppo_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3), 0.8, 0.4).backward()
    grad = logp.grad[0]
    assert grad[0] == 0 and grad[1] == 0  # clipped: no push beyond 1.4 up or below 0.2 down
    assert grad[2] < 0  # inside: minimising the loss raises a positive-advantage token


def test_kl_estimate_and_awr():
    assert bppo.kl_estimate(torch.tensor(0.3), torch.tensor(0.3)).item() == 0.0
    assert bppo.kl_estimate(torch.tensor(-1.0), torch.tensor(-2.0)).item() == pytest.approx(math.exp(-1) + 1 - 1)
    loss = bppo.awr_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.0, math.log(2)]]), torch.ones(1, 2), 1.0)
    assert loss.item() == pytest.approx(-(1 * -1.0 + 2 * -2.0) / 2)


def sum_logp(checkpoint, traj):
    model, tok, _ = models.load_policy(str(checkpoint))
    ids, spans = chat.tokenize_chat(tok, traj["messages"])
    mask = torch.zeros(1, len(ids), dtype=torch.long)
    for s, e in spans:
        mask[0, s:e] = 1
    with torch.no_grad():
        return models.action_logprobs(model, torch.tensor([ids]), torch.ones_like(mask), mask).sum().item()


def good_and_bad(expert, tmp_path):
    """The two demonstrations scored +1 (good) and − (bad), written to tmp_path/scored.jsonl.

    The two share most of their tokens ("Thought: ... Action: ..."), so one LoRA update moves both: with +1 on
    the longer one's 12 steps and −1 on the other's 5, raising the first raised the second too (+3 nats). The
    advantages sum to 0 over the batch instead, as they would after standardising them."""
    good, bad = common.read_jsonl(expert)
    for traj, a in ((good, 1.0), (bad, -len(good["steps"]) / len(bad["steps"]))):
        for s in traj["steps"]:
            s["advantage"] = a
    common.write_jsonl(tmp_path / "scored.jsonl", [good, bad])
    return good, bad, tmp_path / "scored.jsonl"


@pytest.mark.parametrize("objective,bf16", [("bppo", False), ("awr", False), ("bppo", True)])
def test_update_raises_positive_and_lowers_negative_actions(objective, bf16, tiny_policy, sciworld_expert, tmp_path):
    good, bad, data = good_and_bad(sciworld_expert, tmp_path)
    out = tmp_path / "next"
    # lr 1e-3: at 1e-2 Adam moves every LoRA weight by ~lr per step whatever its gradient, the update leaves the
    # region where the surrogate predicts the change, and over 6 LoRA inits the sign of Δ log π was a coin flip.
    # At 1e-3 all 6 moved the right way, by 2-3 nats (bad) and 2-5 (good, bppo) or 16-20 (good, awr).
    run_script("bppo.py", "--data", str(data), "--policy", str(tiny_policy), "--reference", str(tiny_policy),
               "--out", str(out), "--epochs", "3", "--lr", "1e-3", "--grad-accum", "2", "--kl-coef", "0",
               "--objective", objective, *(["--bf16"] if bf16 else []))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # η = 1 at the first step: π_old's log-probs come from the same computation as the update's, bf16 or not
    assert len(metrics) == 3 and metrics[0]["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    scalars = tensorboard_scalars(out)
    assert [s for s, _ in scalars["losses/loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["charts/clip_frac"]] == pytest.approx([m["clip_frac"] for m in metrics], abs=1e-6)
    assert sum_logp(out, good) > sum_logp(tiny_policy, good)
    if objective == "bppo":  # AWR has no way to push an action down: that is the paper's point
        assert sum_logp(out, bad) < sum_logp(tiny_policy, bad)


def test_a_full_finetuning_updates_against_a_reference_of_its_own(tiny_full_policy, tiny_policy, sciworld_expert,
                                                                   tmp_path):
    """After bc.py --full-finetune: π_old is the whole model that trains, π_ref a whole model of its own (here a
    step further than π_old, so the KL to it starts above 0); a LoRA policy with a full reference is refused."""
    good, bad, data = good_and_bad(sciworld_expert, tmp_path)
    ref = tmp_path / "ref"
    run_script("bc.py", "--init", str(tiny_full_policy), "--data", str(sciworld_expert), "--steps", "1",
               "--lr", "1e-3", "--out", str(ref))
    out = tmp_path / "next"
    run_script("bppo.py", "--data", str(data), "--policy", str(tiny_full_policy), "--reference", str(ref),
               "--out", str(out), "--epochs", "3", "--lr", "1e-4", "--grad-accum", "2")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["approx_kl"] == pytest.approx(0.0, abs=1e-6) and metrics[0]["kl_ref"] > 1e-3
    assert models.read_meta(out, "policy")["full_finetune"]
    assert sum_logp(out, good) > sum_logp(tiny_full_policy, good)
    assert sum_logp(out, bad) < sum_logp(tiny_full_policy, bad)

    proc = run_script("bppo.py", "--data", str(data), "--policy", str(tiny_policy), "--reference",
                      str(ref), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "one is a LoRA adapter, the other a full fine-tuning" in proc.stderr


def test_missing_advantage_is_a_clear_error(tiny_policy, sciworld_expert, tmp_path):
    proc = run_script("bppo.py", "--data", str(sciworld_expert), "--policy", str(tiny_policy),
                      "--reference", str(tiny_policy), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "no finite 'advantage'" in proc.stderr


def test_reference_equal_to_policy_takes_one_pass_with_the_same_result(tiny_policy, sciworld_expert, tmp_path):
    # Iteration 1 passes the BC checkpoint as both π_old and π_ref; bppo.py then skips the second log-prob pass.
    # A copy of the checkpoint at another path takes both passes: the updates (KL term included) must agree.
    trajs = common.read_jsonl(sciworld_expert)
    for traj, a in zip(trajs, (1.0, -1.0)):
        for s in traj["steps"]:
            s["advantage"] = a
    data = tmp_path / "scored.jsonl"
    common.write_jsonl(data, trajs)
    copy = tmp_path / "reference"
    shutil.copytree(tiny_policy, copy)
    runs = {}
    for name, ref in (("same", tiny_policy), ("copy", copy)):
        out = tmp_path / name
        proc = run_script("bppo.py", "--data", str(data), "--policy", str(tiny_policy), "--reference", str(ref),
                          "--out", str(out), "--epochs", "3", "--lr", "1e-2", "--grad-accum", "2", "--kl-coef", "1")
        runs[name] = (proc.stderr.count("log π_ref"), [json.loads(line) for line in
                                                       (out / "metrics.jsonl").read_text().splitlines()])
    assert runs["same"][0] == 0 and runs["copy"][0] > 0
    assert runs["same"][1][-1]["kl_ref"] > 0  # the KL term was live, so logp_ref mattered
    for a, b in zip(runs["same"][1], runs["copy"][1]):
        assert a["loss"] == b["loss"] and a["kl_ref"] == b["kl_ref"]
    assert sum_logp(tmp_path / "same", trajs[0]) == sum_logp(tmp_path / "copy", trajs[0])


def _scored(sciworld_expert, tmp_path, name, transform=lambda a: a):
    trajs = common.read_jsonl(sciworld_expert)
    raw = [[0.1 * (t + 1) * (1 if k else -1) for t in range(len(traj["steps"]))] for k, traj in enumerate(trajs)]
    flat = torch.tensor([a for row in raw for a in row])
    for traj, row in zip(trajs, raw):
        for s, a in zip(traj["steps"], row):
            s["advantage"] = transform(a, flat)
    common.write_jsonl(tmp_path / name, trajs)
    return tmp_path / name


def _policy_weights(out):
    from safetensors.torch import load_file
    return load_file(str(out / "policy" / "adapter_model.safetensors"))


def test_departure_flags_do_what_they_say(tiny_policy, sciworld_expert, tmp_path):
    """--normalize-adv is exactly per-batch standardisation; --max-grad-norm only clips."""
    raw = _scored(sciworld_expert, tmp_path, "raw.jsonl", lambda a, flat: a)
    std = _scored(sciworld_expert, tmp_path, "std.jsonl",
                  lambda a, flat: ((a - flat.mean()) / (flat.std() + 1e-8)).item())
    base = ["--policy", str(tiny_policy), "--reference", str(tiny_policy), "--epochs", "2", "--lr", "1e-3",
            "--grad-accum", "2"]  # one optimizer batch holds both trajectories: standardised over the same steps
    runs = {"norm": (raw, ["--normalize-adv"]), "pre": (std, []), "raw": (raw, []),
            "loose_clip": (raw, ["--max-grad-norm", "1e9"]), "tight_clip": (raw, ["--max-grad-norm", "1e-3"])}
    weights, losses = {}, {}
    for name, (data, extra) in runs.items():
        run_script("bppo.py", "--data", str(data), "--out", str(tmp_path / name), *base, *extra)
        weights[name] = _policy_weights(tmp_path / name)
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in metrics]

    def same(a, b, tol):
        return all(torch.allclose(weights[a][k], weights[b][k], atol=tol, rtol=0) for k in weights[a])

    # The two standardisations differ in the last float bits (here in float32, there through JSON), and Adam's
    # first steps move a weight whose gradient is near zero by ±lr either way: compare the losses, not weights.
    assert losses["norm"] == pytest.approx(losses["pre"], rel=1e-4, abs=1e-6)
    assert abs(losses["norm"][0] - losses["raw"][0]) > 1e-3
    assert same("loose_clip", "raw", 0) and not same("tight_clip", "raw", 1e-6)


def test_centred_advantages_are_centred_over_the_whole_dataset(tiny_policy, sciworld_expert, tmp_path):
    """--center-adv subtracts the mean over every step of the data (not over each optimizer batch): with one
    trajectory a batch, it trains as the same data with that mean taken off beforehand does."""
    raw = _scored(sciworld_expert, tmp_path, "raw.jsonl", lambda a, flat: a)
    pre = _scored(sciworld_expert, tmp_path, "pre.jsonl", lambda a, flat: (a - flat.mean()).item())
    base = ["--policy", str(tiny_policy), "--reference", str(tiny_policy), "--lr", "1e-3", "--grad-accum", "1"]
    losses = {}
    for name, data, extra in (("center", raw, ["--center-adv"]), ("pre", pre, []), ("raw", raw, [])):
        run_script("bppo.py", "--data", str(data), "--out", str(tmp_path / name), *base, *extra)
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["center"]) == 2 and losses["center"] == pytest.approx(losses["pre"], rel=1e-4, abs=1e-6)
    assert abs(losses["center"][0] - losses["raw"][0]) > 1e-3


def test_awr_has_no_kl_term_unless_asked(tiny_policy, sciworld_expert, tmp_path):
    data = _scored(sciworld_expert, tmp_path, "raw.jsonl", lambda a, flat: a)
    awr = ["--objective", "awr"]
    for name, extra in (("bppo", []), ("awr", awr), ("awr_kl", awr + ["--kl-coef", "0.05"])):
        run_script("bppo.py", "--data", str(data), "--policy", str(tiny_policy), "--reference", str(tiny_policy),
                   "--out", str(tmp_path / name), "--epochs", "1", *extra)
    kl = {n: json.loads((tmp_path / n / "args.json").read_text())["kl_coef"] for n in ("bppo", "awr", "awr_kl")}
    assert kl == {"bppo": 0.05, "awr": 0.0, "awr_kl": 0.05}
