"""In-distribution critic (paper §1.5-1.6): weighted Implicit Q-Learning on the hybrid dataset, then
per-step process rewards (GAE advantages) for the policy update.

    L_V = Σ_t w_t · L_2^m(Q̄_t − V_t),  L_2^m(δ) = |m − 1(δ<0)| δ²          (eqs. 1, 5)
    L_Q = Σ_t w_t · (r_t + γ V_{t+1} − Q_t)²,  r_t = r_env + r_aux              (eqs. 2, 5)
    w_t = 0.5 · (t/T + d) + 0.5,  d = 1 if the episode succeeded                (eq. 4)
    A_t = δ_t + γλ A_{t+1},  δ_t = r_env,t + γ V_{t+1} − V_t                    (eq. 6)

V_{T} after the last step is 0 when the task ended there, and the critic's own V of the state after the last
step when the step cap or the length limit cut the episode (collect.py's `truncated`): a cut episode says
nothing about what came next, so it must not be read as a failure.

The critic is the policy's base model with its own LoRA adapter `critic` and two fp32 scalar heads on the
last hidden state: V read at the last token of the state (the chat up to o_t, i.e. the end of the generation
prompt before a_t), Q at the last token of the action a_t; Q̄ is a Polyak-averaged copy of the Q head.
The chat is causal, so one forward pass per trajectory gives V and Q of every step.

    python critic.py --data data/iter1_hybrid.jsonl --policy runs/bc --out runs/iter1/critic \
        --out-data data/iter1_scored.jsonl
"""
from __future__ import annotations

import copy
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
from tools import critic_eval


@dataclass
class Args:
    data: str
    """relabelled hybrid JSONL (relabel.py output)"""
    policy: str
    """policy checkpoint whose base model the critic shares (bc.py / bppo.py output)"""
    out: str = "runs/critic"
    """critic checkpoint folder: `critic` adapter, heads.safetensors, args.json, metrics.jsonl"""
    out_data: str | None = None
    """the trajectories with per-step `value` and `advantage` (default: <out>/scored.jsonl)"""
    expectile: float = 0.7
    """m in L_2^m: 0.5 is mean regression, towards 1 V tracks the best in-distribution action"""
    gamma: float = 0.99
    gae_lambda: float = 0.95
    tau: float = 0.005
    """Polyak rate of the target Q head"""
    process_reward: Literal["gae", "gae_aux", "q_minus_v", "shaping"] = "gae"
    """gae (r_env) | gae_aux (r_env + r_aux) | q_minus_v | shaping (r_env + γV' − V): Table 4's rows"""
    no_weights: bool = False
    """plain IQL, w_t = 1 (Table 3's 'w/o W-IQL')"""
    no_success_weight: bool = False
    """drop d from w_t"""
    no_temporal_weight: bool = False
    """drop t/T from w_t"""
    d_from: Literal["success", "reward"] = "success"
    """d of eq. 4: the environment's success flag, or 'reward': the episode's steps earned a positive reward
    (the paper's "ended with a non-zero reward", without the score some ScienceWorld tasks give before any step)"""
    bootstrap_truncated: bool = True
    """an episode cut by the step cap or length bootstraps from V of its last state; off: from 0, as if the
    task had ended (for comparison)"""
    epochs: int = 3
    lr: float = 2e-4
    """LoRA learning rate"""
    head_lr: float = 1e-3
    grad_accum: int = 4
    """trajectories per optimizer step"""
    max_grad_norm: float | None = None
    """clip the gradient's norm (a departure, off in the paper's setting)"""
    save_every: int = 50
    """optimizer steps between resume states in <out>/resume/ (also at every epoch's end)"""
    heldout_frac: float = 0.0
    """trajectories kept out of critic training to measure V on unseen ones (a departure: the paper trains on
    all of D); they are still scored for the policy update"""
    max_length: int = 4096
    """longest chat in tokens; a longer one is an error, never silently cut"""
    lora_r: int = 16
    lora_alpha: int = 32
    load_in_4bit: bool | None = None
    """4-bit nf4 base; default: on with CUDA, off on CPU"""
    grad_ckpt: bool | None = None
    """gradient checkpointing; default: on with CUDA (activation memory), off on CPU (1.4x faster at 135M)"""
    bf16: bool = False
    """run the model's forward and backward passes in bfloat16 (torch.autocast; weights, gradients and optimizer
    state stay fp32, the heads fp32): ~1.4x faster on a CPU with AVX512-BF16 (evolve.sh's default, BF16=1)"""
    refit_rounds: int = 0
    """after the gradient steps, rounds of fitted IQL that solve eqs. 1, 2, 4, 5 exactly for the heads on the
    critic's features (see fit_heads); a departure for short runs, 0 (the paper) keeps the heads as the
    gradient steps left them"""
    refit_ridge: float = 0.1
    """ridge λ of those least-squares solves, on standardised features"""
    clip_values: bool = False
    """keep V and Q within the training data's discounted returns wherever a value is bootstrapped from or read
    (the targets of eqs. 2 and 5, the exact fit, the process rewards): a departure. Without it a looping episode
    that the step cap cut, whose states look alike, bootstraps from itself: V reached 8 where no return exceeds 1,
    and BPPO learned that episode's premature `focus on`"""
    track: bool = False
    """also log to Weights & Biases (metrics.jsonl and TensorBoard events in --out always)"""
    seed: int = 1
    threads: int | None = None


# ----------------------------------------------------------------------------- the equations


def iql_weights(T: int, success: bool, temporal: bool = True, success_term: bool = True) -> torch.Tensor:
    """w_t = 0.5 · (t/T + d) + 0.5 for t = 1..T (eq. 4); entry t-1 is w_t."""
    t = torch.arange(1, T + 1, dtype=torch.float32)
    d = float(success) if success_term else 0.0
    return 0.5 * ((t / T if temporal else torch.zeros(T)) + d) + 0.5


def expectile_loss(diff: torch.Tensor, m: float) -> torch.Tensor:
    """L_2^m(δ) = |m − 1(δ<0)| δ², element-wise (eq. 1)."""
    return torch.abs(m - (diff < 0).float()) * diff ** 2


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """A_t = δ_t + γλ A_{t+1} with δ_t = r_t + γ V_{t+1} − V_t (eq. 6); values has T+1 entries."""
    adv = torch.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * values[t + 1] - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


# ----------------------------------------------------------------------------- model


class Heads(torch.nn.Module):
    """V, Q and the target Q̄: scalar linear heads in fp32 on the last hidden state.

    They start at zero, so V = Q = 0 before training: a default-initialised linear layer on a last hidden state
    of norm ~56 (SmolLM2) starts at about ±1.4, beyond the returns' range, and a short run spends its updates
    undoing that offset (see docs/critic.md)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.v, self.q = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, 1)
        for p in (*self.v.parameters(), *self.q.parameters()):
            torch.nn.init.zeros_(p)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)

    def forward(self, hv: torch.Tensor, hq: torch.Tensor):
        """V_t, Q_t, Q̄_t from the hidden states at the V and Q read positions."""
        return self.v(hv).squeeze(-1), self.q(hq).squeeze(-1), self.q_target(hq.detach()).squeeze(-1)

    @torch.no_grad()
    def update_target(self, tau: float) -> None:
        for p, tp in zip(self.q.parameters(), self.q_target.parameters()):
            tp.mul_(1 - tau).add_(tau * p)


def encode(tok, traj: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids and the V / Q read positions of every step (see the module docstring); a chat that holds the
    state after the last step (a cut episode) has one more V position, its last token."""
    ids, spans = chat.tokenize_steps(tok, traj)
    v_pos = [s - 1 for s, _ in spans] + ([len(ids) - 1] if chat.ends_with_state(traj) else [])
    return torch.tensor([ids]), torch.tensor(v_pos), torch.tensor([e - 1 for _, e in spans])


def features(model, ids, v_pos, q_pos, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The last hidden state (fp32) at every step's V and Q read position, from one forward pass over the
    trajectory; bf16: the decoder under bfloat16 autocast (models.last_hidden)."""
    dev = model.get_input_embeddings().weight.device
    hidden = models.last_hidden(model, ids.to(dev), bf16=bf16)[0]
    return hidden[v_pos.to(dev)], hidden[q_pos.to(dev)]


def values(model, heads: Heads, ids, v_pos, q_pos, bf16: bool = False):
    """V_t, Q_t, Q̄_t for every step from one forward pass over the whole trajectory (fp32 heads)."""
    return heads(*features(model, ids, v_pos, q_pos, bf16))


def critic_rewards(traj: dict) -> torch.Tensor:
    """r_t = r_env + r_aux of every step: what Q regresses on (eq. 5); the auxiliary part trains the critic only."""
    return torch.tensor([s["env_reward"] + s["aux_reward"] for s in traj["steps"]])


def succeeded(traj: dict, args: Args) -> bool:
    """d of eq. 4 (--d-from)."""
    if args.d_from == "success":
        return traj["success"]
    return sum(s["env_reward"] for s in traj["steps"]) > 0


def step_weights(traj: dict, args: Args) -> torch.Tensor:
    """w_t of eq. 4, or the ablations' versions of it."""
    T = len(traj["steps"])
    if args.no_weights:
        return torch.ones(T)
    return iql_weights(T, succeeded(traj, args), not args.no_temporal_weight, not args.no_success_weight)


def returns_to_go(traj: dict, gamma: float) -> torch.Tensor:
    """The discounted return-to-go of r_env + r_aux at every step (what V regresses on; GAE with V = 0, λ = 1),
    a cut episode's counted as if it had ended there."""
    return gae(critic_rewards(traj), torch.zeros(len(traj["steps"]) + 1), gamma, 1.0)


def return_range(trajs: list[dict], gamma: float) -> tuple[float, float]:
    """The smallest and largest return-to-go over every step of trajs: the values V and Q can take on this data,
    for --clip-values."""
    returns = torch.cat([returns_to_go(t, gamma) for t in trajs])
    return float(returns.min()), float(returns.max())


def clip(x: torch.Tensor, bounds: tuple[float, float] | None) -> torch.Tensor:
    return x if bounds is None else x.clamp(*bounds)


def next_values(traj: dict, V: torch.Tensor, args: Args) -> torch.Tensor:
    """V_{t+1} for every step t. After the last step: 0 when the task ended; for a cut episode, V of the last
    state the chat holds (the state after the last step; the state before it when that did not fit)."""
    T, cut = len(traj["steps"]), args.bootstrap_truncated and traj.get("truncated", False)
    return torch.cat([V[1:T], V[-1:] if cut else V.new_zeros(1)])


def iql_loss(traj: dict, V, Q, Q_target, args: Args, bounds: tuple[float, float] | None = None):
    """Eqs. 1, 2, 5 for one trajectory, summed over its steps; V may hold one more state than there are steps.
    bounds (--clip-values): the targets' values kept within the data's returns."""
    r = critic_rewards(traj).to(V.device)
    w = step_weights(traj, args).to(V.device)
    loss_q = (w * (r + args.gamma * clip(next_values(traj, V.detach(), args), bounds) - Q) ** 2).sum()
    loss_v = (w * expectile_loss(clip(Q_target.detach(), bounds) - V[:len(Q)], args.expectile)).sum()
    return loss_q + loss_v, {"loss_q": loss_q.item(), "loss_v": loss_v.item()}


@torch.no_grad()
def fit_heads(heads: Heads, feats: list[tuple[torch.Tensor, torch.Tensor]], trajs: list[dict], args: Args,
              bounds: tuple[float, float] | None = None) -> dict:
    """Fitted IQL for the heads on fixed features: eqs. 1, 2, 4, 5, each loss minimised exactly in turn.

    Each round regresses Q on r_t + γ V_{t+1} (weighted least squares), then V on Q by iteratively reweighted
    least squares with the expectile's weights |m − 1(Q − V < 0)|; Q̄ = Q, since each round's targets are
    already fixed. Why not more gradient steps: on the last hidden state this is an ill-conditioned regression
    (SmolLM2 has a dimension of mean 42.5, while the directions that tell one task's first state from another's
    vary by ~0.15), and Adam on the heads alone was still at a V_0 AUC of 0.72 after 5000 full-batch updates
    where the exact solution reaches 0.80 (docs/critic.md). The solves run in float64 on standardised features
    with a ridge penalty λ on every weight but the bias, and are folded back into the two linear heads. With
    bounds (--clip-values) the values each round bootstraps from are kept within the data's returns."""
    hv = torch.cat([v for v, _ in feats]).double().cpu()  # every state, incl. the state after a cut episode
    hq = torch.cat([q for _, q in feats]).double().cpu()
    r = torch.cat([critic_rewards(t) for t in trajs]).double()
    w = torch.cat([step_weights(t, args) for t in trajs]).double()
    # for every step: the row of its state in hv, the row of the next state, and whether that next value counts
    # (0 after an ended task); next_values() with row numbers in place of values
    rows, nxt, live, start = [], [], [], 0
    for (v, _), t in zip(feats, trajs):
        T, index = len(t["steps"]), torch.arange(start, start + len(v), dtype=torch.float64)
        rows.append(index[:T])
        nxt.append(next_values(t, index, args))
        live.append(next_values(t, torch.ones(len(v), dtype=torch.float64), args))
        start += len(v)
    rows, nxt, live = torch.cat(rows).long(), torch.cat(nxt).long(), torch.cat(live)
    both = torch.cat([hv, hq])
    mu, sd = both.mean(0), both.std(0).clamp_min(1e-3)
    ones = torch.ones(len(r), 1, dtype=torch.float64)
    x_all = torch.cat([(hv - mu) / sd, torch.ones(len(hv), 1, dtype=torch.float64)], 1)
    xv, xq = x_all[rows], torch.cat([(hq - mu) / sd, ones], 1)
    penalty = torch.full((xv.shape[1],), args.refit_ridge, dtype=torch.float64)
    penalty[-1] = 0.0

    def solve(x, y, weight):
        return torch.linalg.solve(x.T @ (x * weight[:, None]) + torch.diag(penalty), x.T @ (weight * y))

    def from_head(layer):  # the head in standardised coordinates, so the rounds start where training left off
        a = layer.weight[0].double().cpu()
        return torch.cat([a * sd, (layer.bias.double().cpu() + a @ mu)])

    bv = from_head(heads.v)
    for _ in range(args.refit_rounds):
        v_prev = x_all @ bv
        target = r + args.gamma * live * clip(v_prev[nxt], bounds)
        bq = solve(xq, target, w)
        q = clip(xq @ bq, bounds)
        for _ in range(10):
            bv = solve(xv, q, w * torch.abs(args.expectile - (q - xv @ bv < 0).double()))
    for layer, b in ((heads.v, bv), (heads.q, bq), (heads.q_target, bq)):
        a = b[:-1] / sd
        layer.weight.copy_(a[None].to(layer.weight))
        layer.bias.copy_((b[-1] - a @ mu)[None].to(layer.bias))
    v = x_all @ bv
    return {"loss_q": float((w * (target - q) ** 2).sum() / len(r)),
            "loss_v": float((w * expectile_loss(q - v[rows], args.expectile)).sum() / len(r)),
            "last_round_change": float((v - v_prev).abs().max())}


def process_rewards(traj: dict, V: torch.Tensor, Q: torch.Tensor, args: Args) -> torch.Tensor:
    """A_t of every step (--process-reward); V may hold the state after a cut episode's last step."""
    steps = traj["steps"]
    r_env = torch.tensor([s["env_reward"] for s in steps])
    V_next, V = next_values(traj, V, args), V[:len(steps)]
    v_ext = torch.cat([V, V_next[-1:]])  # V_0 .. V_T, the last one 0 after an ended task
    if args.process_reward == "gae":
        return gae(r_env, v_ext, args.gamma, args.gae_lambda)
    if args.process_reward == "gae_aux":
        return gae(critic_rewards(traj), v_ext, args.gamma, args.gae_lambda)
    if args.process_reward == "q_minus_v":
        return Q - V
    return r_env + args.gamma * V_next - V  # shaping


# ----------------------------------------------------------------------------- checkpoints


def save_critic(model, heads: Heads, out: Path, base_model: str) -> None:
    from safetensors.torch import save_file
    models.save_adapter(model, "critic", out)
    tmp = out / "heads.safetensors.tmp"
    save_file({k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}, str(tmp))
    tmp.replace(out / "heads.safetensors")
    common.write_json(out / "qevolve.json", {"kind": "critic", "base_model": base_model})


def load_heads(checkpoint: str | Path, hidden: int) -> Heads:
    """The heads of a critic checkpoint written by save_critic (on the CPU)."""
    from safetensors.torch import load_file
    heads = Heads(hidden)
    heads.load_state_dict(load_file(str(Path(checkpoint) / "heads.safetensors")))
    return heads


def load_critic(checkpoint: str, load_in_4bit: bool | None = None):
    """(model, heads, tokenizer) from a critic checkpoint written by save_critic."""
    from peft import PeftModel
    meta = models.read_meta(checkpoint, "critic")
    base, tok = models.load_base(meta["base_model"], load_in_4bit, trains=False)
    model = PeftModel.from_pretrained(base, str(Path(checkpoint) / "critic"), adapter_name="critic")
    return model, load_heads(checkpoint, base.config.hidden_size).to(base.device), tok


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    common.seed_everything(args.seed)
    rng = random.Random(args.seed)
    workers = common.Workers()  # one process, or each of `accelerate launch`'s (docs/scale.md)
    trajs = common.read_jsonl(args.data)
    common.require_step_field(trajs, args.data, "aux_reward", "relabel.py")
    train, held = split(len(trajs), args, rng)
    bounds = return_range([trajs[j] for j in train], args.gamma) if args.clip_values else None
    if bounds:
        print(f"V and Q kept within the training data's returns [{bounds[0]:.3f}, {bounds[1]:.3f}] (--clip-values)")
    model, heads, tok, base_model = build_critic(args)
    encoded = [encode(tok, t) for t in trajs]
    for t, (ids, _, _) in zip(trajs, encoded):
        models.check_length(args.data, t["id"], ids.shape[1], args.max_length, model)
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad], "lr": args.lr},
                                   {"params": list(heads.v.parameters()) + list(heads.q.parameters()),
                                    "lr": args.head_lr}])

    out = Path(args.out)
    common.save_args(out, args)
    resume = common.Resume(
        out, args, lambda: {**{n: p for n, p in model.named_parameters() if p.requires_grad},
                            **{f"heads.{k}": v for k, v in heads.state_dict().items()}},  # Q̄ included
        optimizer, None, lambda d, _: save_critic(model, heads, d, base_model))
    step = resume.load()
    tracker = common.Tracker(out / "metrics.jsonl", out, args, resumed_step=step)
    n_steps = math.ceil(len(train) / args.grad_accum) * args.epochs
    note_target_rate(args.tau, n_steps)
    model.train()  # gradient checkpointing is only active in train mode (dropout is 0 in the critic)
    bar = tqdm(total=n_steps, initial=step, desc="critic", unit="step", disable=not workers.main)
    transitions, t0 = 0, time.time()
    for epoch in resume.epochs(args.epochs, rng):
        order = list(train)
        rng.shuffle(order)
        for i in resume.groups(len(order), args.grad_accum):
            group = order[i:i + args.grad_accum]
            n_trans = sum(len(trajs[j]["steps"]) for j in group)
            logs = defaultdict(float)
            for j in workers.share(group):
                V, Q, Q_target = values(model, heads, *encoded[j], args.bf16)
                loss, parts = iql_loss(trajs[j], V, Q, Q_target, args, bounds)  # eqs. 1, 2, 4, 5
                (loss / n_trans).backward()  # mean over the step's transitions
                for k, v in parts.items():
                    logs[k] += v / n_trans
            params = [p for g in optimizer.param_groups for p in g["params"]]
            workers.sum_grads(params)  # several processes: the whole step's gradient
            logs = workers.sum(logs, ("loss_q", "loss_v"))
            resume.check_finite(logs, step)
            if args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            heads.update_target(args.tau)
            step, transitions = step + 1, transitions + n_trans
            tracker.log(step, losses=dict(logs),
                        charts={"epoch": epoch, "transitions_per_s": transitions / (time.time() - t0)})
            resume.step_done(step)
            bar.set_postfix(loss_q=f"{logs['loss_q']:.4f}", loss_v=f"{logs['loss_v']:.4f}")
            bar.update()
    bar.close()
    if not workers.finish():
        return  # process 0 fits the heads exactly, writes the critic and scores the data

    model.eval()
    with torch.no_grad():
        feats = [features(model, *e, args.bf16) for e in tqdm(encoded, desc="features", unit="traj")]
    refit = fit_heads(heads, [feats[j] for j in train], [trajs[j] for j in train], args, bounds) \
        if args.refit_rounds else {}
    save_critic(model, heads, out, base_model)
    resume.done()

    scored, V = score(trajs, feats, heads, args, bounds)  # eq. 6, from the heads as saved
    out_data = Path(args.out_data or out / "scored.jsonl")
    out_data.parent.mkdir(parents=True, exist_ok=True)
    common.write_jsonl(out_data, scored)
    report(out, tracker, step, trajs, V, held, refit, bounds, args)
    tracker.close()
    print(f"critic written to {out}; scored trajectories to {out_data}")


# ----------------------------------------------------------------------------- set-up and report
@torch.no_grad()
def score(trajs: list[dict], feats: list, heads: Heads, args: Args, bounds) -> tuple[list[dict], list[torch.Tensor]]:
    """Every trajectory with each step's `value` V(s_t), `q` Q(s_t, a_t) and `advantage` (--process-reward), and
    each one's V."""
    scored, values_ = [], []
    for t, f in zip(trajs, feats):
        V, Q, _ = (clip(x.cpu(), bounds) for x in heads(*f))
        adv = process_rewards(t, V, Q, args)
        scored.append({**t, "steps": [{**s, "value": float(V[i]), "q": float(Q[i]), "advantage": float(adv[i])}
                                      for i, s in enumerate(t["steps"])]})
        values_.append(V)
    return scored, values_


def split(n: int, args: Args, rng: random.Random) -> tuple[list[int], set[int]]:
    """Indices of the trajectories trained on, and of those held out (--heldout-frac; none below 10)."""
    order = list(range(n))
    rng.shuffle(order)
    n_held = round(args.heldout_frac * n) if n >= 10 else 0
    return order[n_held:], set(order[:n_held])


def build_critic(args: Args):
    """The policy's base model with a fresh LoRA adapter `critic`, and zero-initialised heads."""
    from peft import get_peft_model
    base_model = models.read_meta(args.policy, "policy")["base_model"]
    base, tok = models.load_base(base_model, args.load_in_4bit, args.grad_ckpt)
    model = get_peft_model(base, models.lora_config(args.lora_r, args.lora_alpha, 0.0), adapter_name="critic")
    return model, Heads(base.config.hidden_size).to(base.device), tok, base_model


def note_target_rate(tau: float, n_steps: int) -> None:
    reach = 1 - (1 - tau) ** n_steps  # IQL's 0.005 assumes ~10^6 steps; a few dozen leave Q̄ near its init
    if reach < 0.8:
        print(f"note: --tau {tau} over {n_steps} steps moves the target Q head only {reach:.0%} of the way "
              f"to Q, and V (eq. 1) learns from Q̄; --tau {min(1.0, 2 / n_steps):.2g} would reach at least 86%")


def report(out: Path, tracker: common.Tracker, step: int, trajs: list[dict], V: list[torch.Tensor], held: set[int],
           refit: dict, bounds, args: Args) -> None:
    """The first check that V learned something, printed and in OUT/eval.json: mean V_0 of successes and
    failures per env and source, and on the trajectories trained on and on those held out how V ranks
    successes above failures and fits the returns it regresses on (tools/critic_eval.py)."""
    if refit:
        print(f"heads fitted exactly on the critic's features ({args.refit_rounds} rounds of fitted IQL): loss_q "
              f"{refit['loss_q']:.4f}, loss_v {refit['loss_v']:.4f}, the last round moved V by at most "
              f"{refit['last_round_change']:.2g}")
    groups, parts = defaultdict(lambda: ([], [])), {"train": [], "heldout": []}
    for k, t in enumerate(trajs):
        v = V[k][:len(t["steps"])]
        groups[(t["env"], t["source"])][0 if t["success"] else 1].append(float(v[0]))
        parts["heldout" if k in held else "train"].append(
            critic_eval.value_record(t, v, returns_to_go(t, args.gamma)))
    print(f"{'env':<10} {'source':<7} {'V_0 success':>12} {'V_0 failure':>12} {'n':>6}")
    for (env, source), (won, lost) in sorted(groups.items()):
        print(f"{env:<10} {source:<7} {critic_eval.mean(won):>12.3f} {critic_eval.mean(lost):>12.3f} "
              f"{len(won) + len(lost):>6}")
    figures = {"process_reward": args.process_reward, **{f"refit_{k}": v for k, v in refit.items()},
               "value_bounds": bounds}
    for part, rows in parts.items():
        f = critic_eval.value_report(rows)
        figures |= {part: len(rows), f"{part}_successes": f["successes"], f"return_corr_{part}": f["return_corr"],
                    **{f"{part}_{k}": f[k] for k in ("auc_v0", "auc_v0_ceiling", "auc_mean_v")}}
        if rows:
            print(f"{part:>8}: {critic_eval.describe(f)}")
            tracker.scalars(step, eval={f"{part}_{k}": f[k] for k in ("auc_v0", "auc_mean_v", "return_corr")})
    common.write_json(out / "eval.json", figures)


if __name__ == "__main__":
    common.run_stage(main)
