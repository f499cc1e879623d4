"""Policy improvement (paper §1.7, eq. 7): behaviour-proximal policy optimization on the dataset's actions.

    L_π = −E_D[ min(η_t A_t, clip(η_t, 1 − ε_low, 1 + ε_high) A_t) ] + α · KL(π_φ ‖ π_ref),
    η_t = π_φ(a_t | u, h_t, o_t) / π_old(a_t | u, h_t, o_t)

per action token, the step's advantage A_t (critic.py) broadcast to its tokens. The lower clip is looser
(ε_low > ε_high): negative-advantage actions can be pushed down further than positive ones pushed up.
π_old is the policy that collected this iteration's data, π_ref the BC policy. Both are adapters on the
one base model: their log-probabilities are computed once, before any update, with frozen weights.

    python bppo.py --data data/iter1_scored.jsonl --policy runs/bc --reference runs/bc --out runs/iter1/policy
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tqdm import tqdm

import common


@dataclass
class Args:
    data: str
    """trajectories with per-step `advantage` (critic.py output)"""
    policy: str
    """π_old: the policy checkpoint that collected this iteration's data; training continues from it"""
    reference: str
    """π_ref for the KL term: the BC checkpoint"""
    out: str = "runs/bppo"
    """the next policy checkpoint, args.json and metrics.jsonl"""
    objective: str = "bppo"
    """bppo (eq. 7) | awr: advantage-weighted regression E[exp(A / β) log π], the paper's 'w/o PI + AWR' row"""
    eps_low: float = 0.8
    """clip η from below at 1 − eps_low (the value reported for the paper)"""
    eps_high: float = 0.4
    """clip η from above at 1 + eps_high"""
    kl_coef: float | None = None
    """α: weight of the per-token KL estimate against π_ref (default: 0.05 for bppo, 0 for awr, whose paper
    form has no KL term)"""
    awr_beta: float = 1.0
    """AWR temperature β: weights exp(A / β) (the paper writes exp(A): β = 1)"""
    awr_max_weight: float = 100.0
    """cap on AWR's weights exp(A / β), as IQL's AWR caps them (a guard that A of a few units never reaches)"""
    normalize_adv: bool = False
    """standardise advantages over the steps of each optimizer batch (a departure: the paper's process reward
    is the GAE advantage itself)"""
    max_grad_norm: float | None = None
    """clip the gradient's norm (a departure, off in the paper's setting)"""
    epochs: int = 1
    lr: float = 5e-5
    """LoRA learning rate (small: the update must stay near π_old)"""
    grad_accum: int = 4
    """trajectories per optimizer step"""
    save_every: int = 50
    """optimizer steps between resume states in <out>/resume/ (also at every epoch's end)"""
    max_length: int = 4096
    load_in_4bit: bool | None = None
    """4-bit nf4 base; default: on with CUDA, off on CPU"""
    grad_ckpt: bool | None = None
    """gradient checkpointing; default: on with CUDA (activation memory), off on CPU (1.4x faster at 135M)"""
    bf16: bool = False
    """run the model's forward and backward passes in bfloat16 (torch.autocast; weights, gradients and optimizer
    state stay fp32, the heads fp32): ~1.4x faster on a CPU with AVX512-BF16 (evolve.sh's default, BF16=1)"""
    seed: int = 1
    threads: int | None = None


def bppo_loss(logp_new, logp_old, advantages, mask, eps_low: float, eps_high: float) -> torch.Tensor:
    """−mean over masked tokens of min(η A, clip(η, 1 − ε_low, 1 + ε_high) A), η = exp(logp_new − logp_old)."""
    ratio = torch.exp(logp_new - logp_old)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    mask = mask.float()
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)


def awr_loss(logp_new, advantages, mask, beta: float, max_weight: float = 100.0) -> torch.Tensor:
    """−mean of exp(A / β) · log π: only raises the probability of actions in the data (paper §1.7)."""
    weights = torch.exp(advantages / beta).clamp(max=max_weight)
    mask = mask.float()
    return -(weights * logp_new * mask).sum() / mask.sum().clamp(min=1)


def kl_estimate(logp_new, logp_ref) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π's own data: exp(r) − r − 1, r = ref − new (k3)."""
    r = logp_ref - logp_new
    return torch.exp(r) - r - 1


def main() -> None:
    args = tyro.cli(Args)
    if args.objective not in ("bppo", "awr"):
        raise common.UserError(f"--objective {args.objective!r}: use bppo or awr")
    if args.kl_coef is None:
        args.kl_coef = 0.05 if args.objective == "bppo" else 0.0
    if args.threads:
        torch.set_num_threads(args.threads)
    common.seed_everything(args.seed)
    rng = random.Random(args.seed)
    trajs = common.read_jsonl(args.data)
    common.require_step_field(trajs, args.data, "advantage", "critic.py")

    ref_base = common.read_meta(args.reference, "policy")["base_model"]
    # One base, two adapters: `policy` (trainable, starts as π_old) and `ref` (frozen π_ref). In iteration 1
    # π_old is π_ref (both the BC checkpoint): one adapter and one pass give both log-probabilities.
    same_ref = Path(args.policy).resolve() == Path(args.reference).resolve()
    model, tok, base_model = common.load_policy(args.policy, args.load_in_4bit, trainable=True,
                                                grad_ckpt=args.grad_ckpt)
    if ref_base != base_model:
        raise common.UserError(f"--reference {args.reference}: a policy on another base model than {base_model}")
    if not same_ref:
        model.load_adapter(str(Path(args.reference) / "policy"), adapter_name="ref", is_trainable=False)

    dev = model.device
    batches = []
    for t in trajs:
        ids, spans = common.tokenize_steps(tok, t)
        common.check_length(args.data, t["id"], len(ids), args.max_length, model)
        mask = torch.zeros(1, len(ids), dtype=torch.long)
        adv = torch.zeros(1, len(ids))
        for (s, e), step in zip(spans, t["steps"]):
            mask[0, s:e], adv[0, s:e] = 1, step["advantage"]
        batches.append({"ids": torch.tensor([ids]), "mask": mask, "adv": adv, "step_adv": [s["advantage"] for s in
                                                                                              t["steps"]]})
    model.eval()
    with torch.no_grad():
        for name, key in [("policy", "logp_old")] + ([] if same_ref else [("ref", "logp_ref")]):
            model.set_adapter(name)
            for b in tqdm(batches, desc=f"log π_{'old' if name == 'policy' else 'ref'}", unit="traj"):
                b[key] = common.action_logprobs(model, b["ids"].to(dev), torch.ones_like(b["ids"]).to(dev),
                                                b["mask"].to(dev), bf16=args.bf16).cpu()
                if same_ref:
                    b["logp_ref"] = b[key]
    model.set_adapter("policy")
    params = [p for n, p in model.named_parameters() if ".policy." in n]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    for m in model.modules():  # η must compare π and π_old as functions: no dropout noise in either
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.save_args(out, args)
    # π_old and π_ref log-probs above come from the starting weights; a resumed run recomputes them the same way.
    resume = common.Resume(out, args, lambda: {n: p for n, p in model.named_parameters() if ".policy." in n},
                           optimizer, None, lambda d: common.save_policy(model, d, base_model))
    step = resume.load()
    metrics = resume.metrics()
    bar = tqdm(total=math.ceil(len(batches) / args.grad_accum) * args.epochs, initial=step, desc=args.objective,
               unit="step")
    t0, trained = time.time(), 0
    for epoch in resume.epochs(args.epochs, rng):
        order = list(range(len(batches)))
        rng.shuffle(order)
        for i in resume.groups(len(order), args.grad_accum):
            group = [batches[j] for j in order[i:i + args.grad_accum]]
            step_adv = torch.tensor([a for b in group for a in b["step_adv"]])
            mean, std = (step_adv.mean(), step_adv.std()) if args.normalize_adv and len(step_adv) > 1 else (0.0, 1.0)
            n_tokens = sum(b["mask"].sum().item() for b in group)
            logs = {"loss": 0.0, "approx_kl": 0.0, "clip_frac": 0.0, "entropy": 0.0, "kl_ref": 0.0}
            for b in group:
                ids, mask = b["ids"].to(dev), b["mask"].to(dev)
                adv = ((b["adv"] - mean) / (std + 1e-8)).to(dev) * mask
                logp, entropy = common.action_logprobs(model, ids, torch.ones_like(ids), mask, True, args.bf16)
                old, ref = b["logp_old"].to(dev), b["logp_ref"].to(dev)
                share = mask.sum().item() / n_tokens  # token-weighted mean over the whole optimizer step
                if args.objective == "bppo":
                    loss = bppo_loss(logp, old, adv, mask, args.eps_low, args.eps_high)
                else:
                    loss = awr_loss(logp, adv, mask, args.awr_beta, args.awr_max_weight)
                kl = (kl_estimate(logp, ref) * mask).sum() / mask.sum()
                ((loss + args.kl_coef * kl) * share).backward()
                with torch.no_grad():
                    ratio = torch.exp(logp - old)[mask.bool()]
                    logs["loss"] += share * loss.item()
                    logs["kl_ref"] += share * kl.item()
                    logs["approx_kl"] += share * (old - logp)[mask.bool()].mean().item()
                    logs["clip_frac"] += share * ((ratio < 1 - args.eps_low) | (ratio > 1 + args.eps_high)).float().mean().item()
                    logs["entropy"] += share * entropy[mask.bool()].mean().item()
            resume.check_finite(logs, step)
            if args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, trained = step + 1, trained + len(group)
            metrics.write(json.dumps({"step": step, "epoch": epoch, **logs,
                                      "trajectories_per_s": trained / (time.time() - t0)}) + "\n")
            metrics.flush()
            resume.step_done(step)
            bar.set_postfix(loss=f"{logs['loss']:.4f}", kl=f"{logs['kl_ref']:.4f}", clip=f"{logs['clip_frac']:.2f}")
            bar.update()
    bar.close()
    metrics.close()
    common.save_policy(model, out, base_model)
    resume.done()
    print(f"policy written to {out / 'policy'} after {step} steps")


if __name__ == "__main__":
    common.run_stage(main)
