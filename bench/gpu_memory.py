"""Peak memory of every stage on a 7B-shaped model: the 24 GB budget, measured rather than estimated.

Builds a model of Llama-2-7B's shape (32 layers, hidden 4096, MLP 11008) from its config with random weights
(nothing is downloaded; the tokenizer is the default model's, so the vocabulary is 49152 instead of 32000,
+70M parameters), writes synthetic trajectories of --tokens tokens, and runs the stage scripts themselves on
them, one process each: bc.py, collect.py (the real ScienceWorld, --num-envs KV caches growing to the same
length), critic.py, bppo.py. On CUDA the base is 4-bit nf4, as the stages default to. Prints, per stage,
the peak of torch.cuda.max_memory_allocated (on CPU: peak RSS) and the stage's own throughput.

    python bench/gpu_memory.py                                  # on a GPU: the 7B table for docs/scale.md
    python bench/gpu_memory.py --shape tiny --tokens 512 --num-envs 2 --max-steps 2    # CPU check (a test)
    python bench/gpu_memory.py --shape smollm2-135m --load-in-4bit True --bf16 --tokens 1024   # nf4 on a CPU
    python bench/gpu_memory.py --shape smollm2-135m --load-in-4bit False --bf16 --tokens 1024  # against fp32 + bf16

--shape smollm2-135m takes the default model itself (trained weights) instead of a random one.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import chat  # noqa: E402
import common  # noqa: E402
import models  # noqa: E402
import relabel  # noqa: E402

SHAPES = {  # config fields changed on the default model's (Llama-architecture) config
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
# Run a stage script in this process, then report its peak memory on the last line.
PEAK = """import json, resource, runpy, sys, time, torch
script, sys.argv = sys.argv[1], sys.argv[1:]
t0 = time.time()
runpy.run_path(script, run_name="__main__")
cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
print("PEAK " + json.dumps({"cuda": cuda, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "seconds": time.time() - t0}))
"""


@dataclass
class Args:
    shape: str = "llama2-7b"
    """llama2-7b | tiny"""
    tokens: int = 2048
    """length of every synthetic trajectory"""
    num_envs: int = 8
    """collect.py's parallel environments (KV caches)"""
    max_steps: int = 10
    """collect.py episode length: with 128-token answers the caches reach about --tokens"""
    budget_gb: float = 22.0
    load_in_4bit: bool | None = None
    """every stage's --load-in-4bit (default: theirs, nf4 on CUDA only)"""
    bf16: bool = False
    """the training stages' --bf16 (bfloat16 autocast; evolve.sh's BF16=1)"""
    workdir: str | None = None
    """where the model (13 GB for 7B) and outputs go; default: a temporary folder"""


def build_model(shape: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    base = models.resolve_model(models.DEFAULT_MODEL)
    config = AutoConfig.from_pretrained(base)
    config.update(SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with common.atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)


def synthetic_trajectories(tok, n: int, tokens: int, steps: int = 8) -> list[dict]:
    """n schema-valid ScienceWorld-shaped trajectories of about `tokens` tokens each, half of them successes."""
    from envs.sciworld import SYSTEM_PROMPT
    words = "the a beaker of water on table kitchen door open thermometer reads degrees celsius".split()

    def make(i: int, obs_words: int) -> dict:
        obs = [" ".join(words[(i + t + k) % len(words)] for k in range(obs_words)) for t in range(steps + 1)]
        instruction = "Your task is to boil water. First, focus on the substance."
        messages = chat.first_messages(SYSTEM_PROMPT, instruction, obs[0])
        out = []
        for t in range(steps):
            text = chat.react(f"I should look at step {t}.", "look around")
            messages.append({"role": "assistant", "content": text})
            last = t == steps - 1
            out.append({"text": text, "action": "look around", "observation": obs[t + 1],
                        "env_reward": float(last and i % 2 == 0), "done": last, "format_ok": True, "valid": True})
            if not last:
                messages.append(chat.observation_message(obs[t + 1]))
        return {"id": f"sciworld/boil/{i}/synthetic", "env": "sciworld", "task": "boil", "variation": i,
                "split": "train", "source": "policy", "iteration": 1, "instruction": instruction,
                "initial_observation": obs[0], "messages": messages, "steps": out,
                "reward": float(i % 2 == 0), "success": i % 2 == 0}

    def length(obs_words: int) -> int:
        return len(chat.tokenize_chat(tok, make(0, obs_words)["messages"])[0])

    lo, hi = 1, 4 * tokens  # the longest observation that keeps the chat within `tokens`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= tokens else (lo, mid - 1)
    return [make(i, lo) for i in range(n)]


def measure(name: str, code: str, argv: list[str]) -> dict:
    """Run `code` (which prints a last line "PEAK {json}") in a fresh Python process; that JSON."""
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("PEAK "))


def run_stage(name: str, argv: list[str], rate_of) -> dict:
    print(f"--- {name}: {' '.join(argv)}", flush=True)
    peak = measure(name, PEAK, argv)
    return {"stage": name, **peak, "rate": rate_of(peak["seconds"])}


def last_metric(path: Path, key: str) -> float:
    return json.loads(path.read_text().splitlines()[-1])[key]


def main() -> None:
    args = tyro.cli(Args)
    if args.shape not in SHAPES and args.shape != models.DEFAULT_MODEL:
        raise SystemExit(f"--shape {args.shape}: use one of {', '.join(SHAPES)}, {models.DEFAULT_MODEL}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = work / f"model-{args.shape}"
        if args.shape == models.DEFAULT_MODEL:
            model_dir = Path(models.resolve_model(args.shape))
        elif not (model_dir / "config.json").exists():
            print(f"building a random {args.shape} model in {model_dir}", flush=True)
            build_model(args.shape, model_dir)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        trajs = synthetic_trajectories(tok, 4, args.tokens)
        n_tokens = len(chat.tokenize_chat(tok, trajs[0]["messages"])[0])
        common.write_jsonl(work / "train.jsonl", trajs[:2])
        common.write_jsonl(work / "held.jsonl", trajs[2:3])
        common.write_jsonl(work / "hybrid.jsonl", [relabel.label_trajectory(t) for t in trajs])

        m = args.shape if args.shape == models.DEFAULT_MODEL else str(model_dir)
        quant = [] if args.load_in_4bit is None else ["--load-in-4bit", str(args.load_in_4bit)]
        train = quant + (["--bf16"] if args.bf16 else [])
        rows = [
            run_stage("bc", ["bc.py", "--data", str(work / "train.jsonl"), "--eval-data", str(work / "held.jsonl"),
                             "--model", m, "--epochs", "1", "--grad-accum", "2", "--out", str(work / "bc"), *train],
                      lambda sec: f"{last_metric(work / 'bc' / 'metrics.jsonl', 'tokens_per_s'):.0f} tokens/s"),
            run_stage("collect", ["collect.py", "--env", "sciworld", "--policy", str(work / "bc"),
                                  "--num-tasks", str(args.num_envs), "--num-envs", str(args.num_envs),
                                  "--max-steps", str(args.max_steps), "--temperature", "0.7",
                                  "--out", str(work / "collect.jsonl"), *quant],
                      lambda sec: f"{json.loads((work / 'collect.summary.json').read_text())['env_steps'] / sec:.2f} "
                                  "env steps/s, loading included"),
            run_stage("critic", ["critic.py", "--data", str(work / "hybrid.jsonl"), "--policy", str(work / "bc"),
                                 "--epochs", "1", "--grad-accum", "2", "--out", str(work / "critic"), *train],
                      lambda sec: f"{last_metric(work / 'critic' / 'metrics.jsonl', 'transitions_per_s'):.2f} "
                              "transitions/s"),
            run_stage("bppo", ["bppo.py", "--data", str(work / "critic" / "scored.jsonl"), "--policy",
                               str(work / "bc"), "--reference", str(work / "bc"), "--grad-accum", "2",
                               "--out", str(work / "bppo"), *train],
                      lambda sec: f"{last_metric(work / 'bppo' / 'metrics.jsonl', 'trajectories_per_s'):.2f} traj/s"),
        ]
        longest = max(len(chat.tokenize_chat(tok, t["messages"])[0])
                      for t in common.read_jsonl(work / "collect.jsonl"))

    on_gpu = rows[0]["cuda"] is not None
    unit = "peak GPU memory (max_memory_allocated)" if on_gpu else "peak RSS (CPU)"
    weights = {None: "the stages' default weights", True: "nf4 base", False: "unquantized base"}[args.load_in_4bit]
    print(f"\n{args.shape}, {weights}{', bf16 autocast in training' if args.bf16 else ''}, trajectories of "
          f"{n_tokens} tokens, collect: {args.num_envs} envs up to {longest} tokens, {unit}")
    print(f"| stage | {unit} | wall | throughput |\n|---|---|---|---|")
    over = []
    for r in rows:
        peak = r["cuda"] if on_gpu else r["rss"]
        print(f"| {r['stage']} | {peak / 2**30:.2f} GB | {r['seconds']:.0f} s | {r['rate']} |")
        if on_gpu and peak > args.budget_gb * 2**30:
            over.append(r["stage"])
    if over:
        sys.exit(f"over the {args.budget_gb} GB budget: {', '.join(over)}")


if __name__ == "__main__":
    main()
