"""Policy improvement (paper §1.7, eq. 7): behaviour-proximal policy optimization on the dataset's actions.

    L_π = −E_D[ min(η_t A_t, clip(η_t, 1 − ε_low, 1 + ε_high) A_t) ] + α · KL(π_φ ‖ π_ref),
    η_t = π_φ(a_t | u, h_t, o_t) / π_old(a_t | u, h_t, o_t)

per action token, the step's advantage A_t (critic.py) broadcast to its tokens. The lower clip is looser
(ε_low > ε_high): negative-advantage actions can be pushed down further than positive ones pushed up.
π_old is the policy that collected this iteration's data, π_ref the BC policy. Both are adapters on the
one base model (or, after bc.py --full-finetune, whole models): their log-probabilities are computed once,
before any update, with frozen weights.

    python bppo.py --data data/iter1_scored.jsonl --policy runs/bc --reference runs/bc --out runs/iter1/policy
"""
from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import chat
import common
import models


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
    objective: Literal["bppo", "awr"] = "bppo"
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
    center_adv: bool = False
    """subtract the mean step advantage over the whole dataset (a departure): a failure-heavy dataset's process
    rewards are mostly negative, which pushes down most of its actions; centred, BPPO raises the actions that
    did better than the data's average and lowers those that did worse"""
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
    track: bool = False
    """also log to Weights & Biases (metrics.jsonl and TensorBoard events in --out always)"""
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
    if args.kl_coef is None:
        args.kl_coef = 0.05 if args.objective == "bppo" else 0.0
    if args.threads:
        torch.set_num_threads(args.threads)
    common.seed_everything(args.seed)
    rng = random.Random(args.seed)
    workers = common.Workers()  # one process, or each of `accelerate launch`'s (docs/scale.md)
    trajs = common.read_jsonl(args.data)
    common.require_step_field(trajs, args.data, "advantage", "critic.py")
    model, tok, base_model, same_ref = load_models(args)
    model = workers.shard(model)  # an FSDP launch: a full fine-tuning's weights sharded over the processes
    batches = encode(trajs, tok, model, args)
    data_mean = float(torch.tensor([a for b in batches for a in b["step_adv"]]).mean()) if args.center_adv else 0.0
    # π_old and π_ref are fixed during the update: their log-probabilities once, from the starting weights (a
    # resumed run recomputes them the same way), then only the `policy` adapter (or every weight) trains.
    old_and_ref_logprobs(model, batches, same_ref, args)
    params = trainable(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    out = Path(args.out)
    common.save_args(out, args)
    resume = common.Resume(out, args, lambda: {n: p for n, p in model.named_parameters() if p.requires_grad},
                           optimizer, None, lambda d, w: models.save_policy(model, d, base_model, w))
    step = resume.load()
    tracker = common.Tracker(out / "metrics.jsonl", out, args, resumed_step=step)
    bar = tqdm(total=math.ceil(len(batches) / args.grad_accum) * args.epochs, initial=step, desc=args.objective,
               unit="step", disable=not workers.main)
    dev, t0, trained = model.device, time.time(), 0
    for epoch in resume.epochs(args.epochs, rng):
        order = list(range(len(batches)))
        rng.shuffle(order)
        for i in resume.groups(len(order), args.grad_accum):
            group = [batches[j] for j in order[i:i + args.grad_accum]]
            mean, std = advantage_scale(group, args, data_mean)
            n_tokens = sum(b["mask"].sum().item() for b in group)
            logs = defaultdict(float)
            for b in workers.share(group):
                ids, mask = b["ids"].to(dev), b["mask"].to(dev)
                adv = ((b["adv"] - mean) / (std + 1e-8)).to(dev) * mask
                logp, entropy = models.action_logprobs(model, ids, torch.ones_like(ids), mask, True, args.bf16)
                old, ref = b["logp_old"].to(dev), b["logp_ref"].to(dev)
                if args.objective == "bppo":  # eq. 7
                    loss = bppo_loss(logp, old, adv, mask, args.eps_low, args.eps_high)
                else:
                    loss = awr_loss(logp, adv, mask, args.awr_beta, args.awr_max_weight)
                kl = (kl_estimate(logp, ref) * mask).sum() / mask.sum()
                share = mask.sum().item() / n_tokens  # token-weighted mean over the whole optimizer step
                ((loss + args.kl_coef * kl) * share).backward()
                for k, v in diagnostics(loss, kl, logp, old, entropy, mask, args).items():
                    logs[k] += share * v
            workers.sum_grads(params)  # several processes: the whole step's gradient
            logs = workers.sum(logs, ("loss", "kl_ref", "approx_kl", "clip_frac", "entropy"))
            resume.check_finite(logs, step)
            if args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, trained = step + 1, trained + len(group)
            tracker.log(step, losses={k: logs[k] for k in ("loss", "kl_ref")},
                        charts={"epoch": epoch, **{k: logs[k] for k in ("approx_kl", "clip_frac", "entropy")},
                                "trajectories_per_s": trained / (time.time() - t0)})
            resume.step_done(step)
            bar.set_postfix(loss=f"{logs['loss']:.4f}", kl=f"{logs['kl_ref']:.4f}", clip=f"{logs['clip_frac']:.2f}")
            bar.update()
    bar.close()
    weights = workers.full_weights(model)  # FSDP: the shards gathered
    if not workers.finish():
        return  # process 0 writes the policy
    tracker.close()
    models.save_policy(model, out, base_model, weights)
    resume.done()
    print(f"policy written to {out / 'policy'} after {step} steps")


# ----------------------------------------------------------------------------- set-up and diagnostics
def load_models(args: Args):
    """One base, two adapters: `policy` (trainable, starts as π_old) and `ref` (frozen π_ref). In iteration 1
    π_old is π_ref (both the BC checkpoint): then one adapter, and one pass gives both log-probabilities.
    A full fine-tuning's π_ref is a model of its own, loaded by old_and_ref_logprobs for its pass."""
    ref_meta = models.read_meta(args.reference, "policy")
    same_ref = Path(args.policy).resolve() == Path(args.reference).resolve()
    model, tok, base_model = models.load_policy(args.policy, args.load_in_4bit, trainable=True,
                                                grad_ckpt=args.grad_ckpt)
    if ref_meta["base_model"] != base_model:
        raise common.UserError(f"--reference {args.reference}: a policy on another base model than {base_model}")
    if ref_meta.get("full_finetune", False) != models.is_full_finetune(model):
        raise common.UserError(f"--reference {args.reference} and --policy {args.policy}: one is a LoRA adapter, "
                               "the other a full fine-tuning (bc.py --full-finetune); train both the same way")
    if not same_ref and not models.is_full_finetune(model):
        model.load_adapter(str(Path(args.reference) / "policy"), adapter_name="ref", is_trainable=False)
    return model, tok, base_model, same_ref


def encode(trajs: list[dict], tok, model, args: Args) -> list[dict]:
    """Per trajectory: token ids, the action mask, each action token's advantage, and the steps' advantages."""
    batches = []
    for t in trajs:
        ids, spans = chat.tokenize_steps(tok, t)
        models.check_length(args.data, t["id"], len(ids), args.max_length, model)
        mask = torch.zeros(1, len(ids), dtype=torch.long)
        adv = torch.zeros(1, len(ids))
        for (s, e), step in zip(spans, t["steps"]):
            mask[0, s:e], adv[0, s:e] = 1, step["advantage"]
        batches.append({"ids": torch.tensor([ids]), "mask": mask, "adv": adv,
                        "step_adv": [s["advantage"] for s in t["steps"]]})
    return batches


@torch.no_grad()
def old_and_ref_logprobs(model, batches: list[dict], same_ref: bool, args: Args) -> None:
    """log π_old and log π_ref of every action token, into each batch (frozen weights, eval mode)."""
    full = models.is_full_finetune(model)
    model.eval()
    for name, key in [("policy", "logp_old")] + ([] if same_ref else [("ref", "logp_ref")]):
        if full:  # π_old is the model about to train; π_ref a whole model of its own, in the same precision
            policy = models.load_policy(args.reference, trainable=True)[0].eval() if name == "ref" else model
        else:
            policy = model
            model.set_adapter(name)
        dev = policy.device
        for b in tqdm(batches, desc=f"log π_{'old' if name == 'policy' else 'ref'}", unit="traj",
                      disable=not common.main_process()):
            b[key] = models.action_logprobs(policy, b["ids"].to(dev), torch.ones_like(b["ids"]).to(dev),
                                            b["mask"].to(dev), bf16=args.bf16).cpu()
            if same_ref:
                b["logp_ref"] = b[key]
    if not full:
        model.set_adapter("policy")


def trainable(model) -> list[torch.nn.Parameter]:
    """The `policy` adapter's weights (a full fine-tuning's every weight), trainable; dropout off, so that η
    compares π and π_old as functions."""
    full = models.is_full_finetune(model)
    params = [p for n, p in model.named_parameters() if full or ".policy." in n]
    for p in params:
        p.requires_grad_(True)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    return params


def advantage_scale(group: list[dict], args: Args, data_mean: float = 0.0) -> tuple[float, float]:
    """What the advantages are shifted by and divided by: (mean, std) of the batch's step advantages with
    --normalize-adv, (the dataset's mean, 1) with --center-adv (both departures), else (0, 1)."""
    step_adv = torch.tensor([a for b in group for a in b["step_adv"]])
    if args.normalize_adv and len(step_adv) > 1:
        return step_adv.mean().item(), step_adv.std().item()
    return (data_mean if args.center_adv else 0.0), 1.0


@torch.no_grad()
def diagnostics(loss, kl, logp, old, entropy, mask, args: Args) -> dict[str, float]:
    """What one trajectory's update did: its loss and KL to π_ref, the approximate KL to π_old, the fraction
    of tokens whose ratio lies outside the clip, and the policy's entropy on the action tokens."""
    on = mask.bool()
    ratio = torch.exp(logp - old)[on]
    return {"loss": loss.item(), "kl_ref": kl.item(), "approx_kl": (old - logp)[on].mean().item(),
            "clip_frac": ((ratio < 1 - args.eps_low) | (ratio > 1 + args.eps_high)).float().mean().item(),
            "entropy": entropy[on].mean().item()}


if __name__ == "__main__":
    common.run_stage(main)
