"""Memory of a BPPO update: bppo.py's shared base (π, π_old, π_ref as adapters of one base model, π_old and π_ref
log-probabilities precomputed) versus the plain way, three full models (base + adapter each) in memory; both
with gradient checkpointing (bppo.py's CPU default is off, whose activations would hide what the adapters save).

Each way runs in a fresh process; the figure is peak RSS above the process's RSS once torch, transformers and
peft are imported (what the method itself costs), with the total beside it.

    python bench/bppo_memory.py                    # default model, synthetic 1024-token trajectories
    python bench/bppo_memory.py --model tiny       # seconds; the test suite runs this
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Both ways start the same: imports, then the baseline RSS; they print peak RSS on their last line.
PRELUDE = """import json, resource, runpy, sys
import torch, transformers, peft
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
base_rss = rss()
"""
REPORT = """
print("PEAK " + json.dumps({"base": base_rss, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
SHARED = PRELUDE + """script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
""" + REPORT
SEPARATE = PRELUDE + """sys.path.insert(0, ".")
import bppo, chat, common, models
data, policy = sys.argv[1], sys.argv[2]
trajs = common.read_jsonl(data)
pi, tok, _ = models.load_policy(policy, trainable=True, grad_ckpt=True)
old, _, _ = models.load_policy(policy)
ref, _, _ = models.load_policy(policy)
opt = torch.optim.AdamW([p for p in pi.parameters() if p.requires_grad], lr=1e-5)
for t in trajs:
    ids, spans = chat.tokenize_steps(tok, t)
    ids = torch.tensor([ids]); attn = torch.ones_like(ids); mask = torch.zeros_like(ids); adv = torch.zeros(ids.shape)
    for (s, e), step in zip(spans, t["steps"]):
        mask[0, s:e], adv[0, s:e] = 1, step["advantage"]
    with torch.no_grad():
        lp_old = models.action_logprobs(old, ids, attn, mask)
        lp_ref = models.action_logprobs(ref, ids, attn, mask)
    lp = models.action_logprobs(pi, ids, attn, mask)
    loss = bppo.bppo_loss(lp, lp_old, adv, mask, 0.8, 0.4) + 0.05 * (bppo.kl_estimate(lp, lp_ref) * mask).sum() / mask.sum()
    loss.backward()
opt.step()
""" + REPORT


@dataclass
class Args:
    model: str = "smollm2-135m"
    tokens: int = 1024
    num_trajs: int = 4


def main() -> None:
    args = tyro.cli(Args)
    import common
    import models
    from peft import get_peft_model

    from gpu_memory import measure, synthetic_trajectories
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, tok = models.load_base(args.model)
        model = get_peft_model(model, models.lora_config(16, 32, 0.0), adapter_name="policy")
        models.save_policy(model, work / "policy", args.model)
        del model
        trajs = synthetic_trajectories(tok, args.num_trajs, args.tokens)
        for i, t in enumerate(trajs):  # advantages of both signs, as critic.py writes them
            t["steps"] = [{**s, "value": 0.0, "advantage": (-1.0) ** (i + k)} for k, s in enumerate(t["steps"])]
        common.write_jsonl(work / "scored.jsonl", trajs)
        shared = measure("bppo.py (shared base)", SHARED,
                         ["bppo.py", "--data", str(work / "scored.jsonl"), "--policy", str(work / "policy"),
                          "--reference", str(work / "policy"), "--grad-accum", str(args.num_trajs), "--grad-ckpt", "True",
                          "--out", str(work / "out")])
        separate = measure("three models", SEPARATE, [str(work / "scored.jsonl"), str(work / "policy")])

    def mb(x):
        return x / 2**20

    print(f"{args.model}, {args.num_trajs} trajectories of about {args.tokens} tokens, one BPPO step, CPU")
    print(f"{'way':<34} {'peak RSS above imports':>24} {'total peak RSS':>16}")
    for name, r in (("three models (π, π_old, π_ref)", separate), ("shared base, adapters (bppo.py)", shared)):
        print(f"{name:<34} {mb(r['peak'] - r['base']):>21.0f} MB {mb(r['peak']):>13.0f} MB")
    ratio = (shared["peak"] - shared["base"]) / (separate["peak"] - separate["base"])
    print(f"shared / separate: {ratio:.2f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
