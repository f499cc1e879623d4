"""Collect trajectories in a real text environment (paper §1.3), and evaluate a policy.

The policy plays each task of a split `--samples-per-task` times (the paper: 3 per training task); every
episode is kept, success or failure:

    python collect.py --env sciworld --policy runs/bc --split train --samples-per-task 3 --temperature 0.7 \
        --out data/iter1_self.jsonl
    python collect.py --env sciworld --policy runs/bc --split seen --temperature 0 --out runs/eval/bc_seen.jsonl

With `--policy expert` the environment's own expert plays instead (ScienceWorld's gold path, ALFWorld's
planner, WebShop's scripted purchase), each step with a short templated thought: ReAct expert data.

Speed: `--num-envs` episodes play in lock-step with one batched generate per turn (left padding), and each
conversation keeps its KV cache between turns, so a turn only prefills the new observation tokens
(bench/rollout_speed.py measures both against one-at-a-time full re-prefill).
An episode whose chat would outgrow `--max-length` ends there, so that every chat written here fits the
training stages (same limit). An episode that the step cap or that limit cut before its task ended is written
with `"truncated": true` and, when it fits, the observation after its last step as a final user turn: the
critic bootstraps from the value of that state, where an ended task bootstraps from 0.
Trajectories are appended one line per episode and flushed; a rerun with the same --out skips the ids
already written, so a killed run loses at most the episodes in flight.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import common
from envs import Task, TextEnv, make_env
from envs.sciworld import eto_task_name


@dataclass
class Args:
    env: str
    """sciworld | alfworld | webshop"""
    out: str
    """trajectory JSONL to append to (created if missing); the summary goes next to it"""
    policy: str = "expert"
    """'expert' (the environment's expert) or a policy checkpoint folder (bc.py / bppo.py output)"""
    split: str = "train"
    """train | seen (dev) | unseen (test)"""
    task_names: tuple[str, ...] = ()
    """keep only these task families (ScienceWorld tasks, ALFWorld task types, WebShop categories)"""
    num_tasks: int | None = None
    """play only the first N tasks of the split (default: all); with the expert, the first N it can finish"""
    samples_per_task: int = 1
    """episodes per task (the paper samples 3 per training task)"""
    max_steps: int | None = None
    """step cap per episode (default: the paper's, ScienceWorld 24 / ALFWorld 30 / WebShop 10; with --prompt eto
    ETO's: ALFWorld 40, WebShop 10, ScienceWorld 10-120 by task)"""
    prompt: Literal[common.PROMPTS] = "short"
    """short (our system prompt) | eto (ETO's instruction and one-shot example, the paper's protocol); expert
    data and the policy's rollouts must use the same"""
    temperature: float = 0.7
    """sampling temperature; 0 = greedy (evaluation)"""
    max_new_tokens: int = 128
    """longest answer per turn, in tokens"""
    max_length: int = 4096
    """longest chat in tokens (or the model's context if shorter): an episode whose next turn would not fit
    ends there, unfinished, as the training stages refuse longer chats (their --max-length, same default)"""
    num_envs: int = 8
    """environments played in lock-step, one batched generate per turn"""
    rerank_with: str | None = None
    """a critic checkpoint (critic.py output): at every step sample --candidates answers and play the one with
    the highest Q; the paper's "w/o PI" row (the critic only at test time) and a Best-of-N baseline"""
    candidates: int = 5
    """answers sampled per step with --rerank-with (at --temperature, which must be > 0)"""
    kv_cache: bool = True
    """keep each conversation's KV cache between turns (off: re-prefill the whole chat every turn)"""
    load_in_4bit: bool | None = None
    """4-bit nf4 base; default: on with CUDA, off on CPU"""
    iteration: int = 0
    """self-evolution iteration written into each trajectory (0 = expert / BC data)"""
    seed: int = 1
    threads: int | None = None
    """CPU threads for torch (default: torch's choice)"""


def trajectory(env: TextEnv, task: Task, traj_id: str, source: str, iteration: int, info: dict, obs0: str,
               messages: list[dict], steps: list[dict], reward: float, success: bool) -> dict:
    return {"id": traj_id, "env": env.name, "task": task.name, "variation": task.variation, "split": task.split,
            "source": source, "iteration": iteration, "instruction": info["instruction"],
            "initial_observation": obs0, "messages": messages, "steps": steps, "reward": reward, "success": success}


def env_step(env: TextEnv, text: str, t: int) -> tuple[dict, dict | None]:
    """One turn: parse the answer, act (or report a format error), return the step record."""
    action = common.parse_action(text)
    if action is None:  # no action: the project's format-error observation, and the turn counts
        obs, reward, done, info = common.FORMAT_ERROR, 0.0, t + 1 >= env.max_steps, None
    else:
        obs, reward, done, info = env.step(action)
    step = {"text": text, "action": action, "observation": obs, "env_reward": reward, "done": done,
            "format_ok": action is not None, "valid": bool(info and info["valid"])}
    return step, info


def step_cap(args: Args, env: TextEnv, task: Task, paper_cap: int) -> int:
    """--max-steps, else ETO's cap under --prompt eto (its task configs and ScienceWorld table), else the paper's."""
    if args.max_steps:
        return args.max_steps
    if args.prompt != "eto":
        return paper_cap
    if env.name == "sciworld":
        return eto_sciworld_caps()[task.name]
    return {"alfworld": 40, "webshop": 10}[env.name]


@functools.cache
def eto_sciworld_caps() -> dict[str, int]:
    table = json.loads((common.ETO_DIR / "data_sciworld_max_steps.json").read_text())
    return {eto_task_name(name): cap for name, cap in table.items()}


def play_expert(env: TextEnv, task: Task, traj_id: str, iteration: int, prompt: common.Prompt) -> dict | None:
    """One expert episode as a trajectory; None when the expert's path is longer than the step cap."""
    obs0, info = env.reset(task)
    if (env.expert_steps() or 0) > env.max_steps:
        return None  # no policy could match it within the cap either, so it is no demonstration
    messages = prompt.first(info["instruction"], obs0)
    steps, score, won = [], info.get("score", 0.0), False
    for t in range(env.max_steps):
        action = env.expert_action()
        if action is None:
            break
        text = common.react(env.think(action), action)
        messages.append({"role": "assistant", "content": text})
        step, step_info = env_step(env, text, t)
        score, won = step_info["score"], step_info["won"]
        steps.append(step)
        if step["done"]:
            break
        messages.append(prompt.observation(step["observation"]))
    if not steps:
        return None
    return trajectory(env, task, traj_id, "expert", iteration, info, obs0, messages, steps, score, won)


def chat_room(args: Args, model) -> int:
    """The most tokens a chat may hold before an answer: the length limit less one answer."""
    return common.length_limit(args.max_length, model) - args.max_new_tokens


class Conversation:
    """One episode in flight: its chat, its steps and the tokens the model has seen so far."""

    def __init__(self, env: TextEnv, task: Task, traj_id: str, tokenizer, room: int, limit: int,
                 prompt: common.Prompt):
        """room: chat_room(), the most tokens the chat may hold before the next answer; limit: the longest
        chat the training stages take (common.length_limit)."""
        self.env, self.task, self.traj_id, self.tok, self.prompt = env, task, traj_id, tokenizer, prompt
        self.room, self.limit = room, limit
        self.obs0, self.info = env.reset(task)
        self.messages = prompt.first(self.info["instruction"], self.obs0)
        self.steps: list[dict] = []
        self.score, self.won, self.done, self.ended = self.info.get("score", 0.0), False, False, False
        self.too_long = False  # cut because the chat reached the length limit
        self.ids = common.tokenize_chat(tokenizer, self.messages, add_generation_prompt=True)[0]
        if len(self.ids) > room:
            raise common.UserError(f"{task.key}: the first prompt has {len(self.ids)} tokens, more than the "
                                   f"{room} that leave room for an answer (--max-length less --max-new-tokens, "
                                   "or the model's context)")

    def suffix_ids(self, answer: str) -> list[int]:
        """Tokens after the answer's own tokens: end of turn, the observation, the next generation prompt.

        The answer stays as the model generated it (it is in the KV cache already); the text around it is
        tokenized segment by segment, as common.tokenize_chat does for training."""
        segments = common.chat_segments(self.tok, self.messages, add_generation_prompt=True)
        last = max(i for i, (_, is_answer) in enumerate(segments) if is_answer)
        piece = segments[last][0]
        for content in (answer, answer.strip()):
            if content and content in piece:
                tail = piece[piece.find(content) + len(content):]
                break
        else:
            tail = piece if not answer.strip() else None
        if tail is None:
            raise common.MaskError("the chat template changes the answer's text; use --no-kv-cache")
        texts = [tail] + [text for text, _ in segments[last + 1:]]
        return [i for text in texts if text for i in self.tok(text, add_special_tokens=False)["input_ids"]]

    def act(self, text: str) -> None:
        step, info = env_step(self.env, text, len(self.steps))
        if info:
            self.score, self.won = info["score"], info["won"]
        self.ended = bool(info and info["terminated"])  # the task itself ended (won or lost), not the step cap
        self.steps.append(step)
        self.messages.append({"role": "assistant", "content": text})
        self.messages.append(self.prompt.observation(step["observation"]))
        self.done = step["done"] or len(self.steps) >= self.env.max_steps

    def grow(self, tokens: list[int]) -> None:
        """Add the answer and the next observation's tokens; a chat that no longer leaves room for an answer
        ends here, cut like an episode at the step cap."""
        self.ids += tokens
        if len(self.ids) > self.room:
            self.done = self.too_long = True

    def result(self, iteration: int) -> dict:
        """The finished episode. An ended task's chat ends with the last answer; a cut episode's keeps the
        state after it (the last observation and the generation prompt) if the training stages can read it."""
        self.steps[-1]["done"] = True
        if self.ended or len(common.tokenize_chat(self.tok, self.messages, add_generation_prompt=True)[0]) > self.limit:
            self.messages.pop()
        traj = trajectory(self.env, self.task, self.traj_id, "policy", iteration, self.info, self.obs0,
                          self.messages, self.steps, self.score, self.won)
        return traj | {"truncated": not self.ended}


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):], mask[b, width - len(r):] = torch.tensor(r), 1
    return ids, mask


class Reranker:
    """The critic as a test-time selector (paper Table 3, "w/o PI"; also Best-of-N): of the candidate answers
    the policy samples at a step, the agent plays the one with the highest Q(s_t, a).

    The critic's adapter is loaded onto the policy's model (they share the base model), and Q is read where
    critic.py reads it in training: at the candidate's end-of-turn token, after the chat so far."""

    def __init__(self, checkpoint: str, model, base_model: str):
        from critic import load_heads
        meta = common.read_meta(checkpoint, "critic")
        if meta["base_model"] != base_model:
            raise common.UserError(f"--rerank-with {checkpoint}: a critic on {meta['base_model']}, the policy is on "
                                   f"{base_model}")
        model.load_adapter(str(Path(checkpoint) / "critic"), adapter_name="critic", is_trainable=False)
        model.set_adapter("policy")
        self.model, self.heads = model, load_heads(checkpoint, model.config.hidden_size).to(model.device)

    @torch.no_grad()
    def q_values(self, tok, messages: list[dict], texts: list[str]) -> list[float]:
        """Q of each candidate answer after the chat `messages` (which ends with the current observation)."""
        rows = []
        for text in texts:
            ids, spans = common.tokenize_chat(tok, messages + [{"role": "assistant", "content": text}])
            rows.append(ids[:spans[-1][1]])  # up to the answer's end-of-turn token, where Q is read
        ids, mask = left_pad(rows, tok.pad_token_id)
        dev = self.model.device
        self.model.set_adapter("critic")
        try:  # positions from the mask, as in generate, so a left-padded row reads what it reads unpadded
            hidden = self.model.get_decoder()(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                              position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(dev)).last_hidden_state
        finally:
            self.model.set_adapter("policy")
        return self.heads.q(hidden[:, -1].float()).squeeze(-1).tolist()

    def pick(self, tok, messages: list[dict], texts: list[str]) -> int:
        """Index of the candidate with the highest Q (the first of equal ones); each distinct text scored once."""
        distinct = list(dict.fromkeys(texts))
        score = dict(zip(distinct, self.q_values(tok, messages, distinct)))
        return max(range(len(texts)), key=lambda k: (score[texts[k]], -k))


@torch.no_grad()
def play_policy(convs: list[Conversation], model, tok, args: Args, reranker: Reranker | None = None):
    """Play the conversations in lock-step until all are done; yields each finished one.

    With a reranker, every turn samples --candidates answers per conversation (the rows of one generate call)
    and plays the one the critic's Q prefers; the cache keeps only the chosen rows."""
    # End of turn: the tokenizer's EOS and the model's own (Llama-3's <|eot_id|> is only in the latter).
    configured = model.generation_config.eos_token_id
    stop = sorted({tok.eos_token_id, *(configured if isinstance(configured, list) else [configured])} - {None})
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, pad_token_id=tok.pad_token_id,
               eos_token_id=stop, return_dict_in_generate=True)
    if args.temperature > 0:
        gen.update(temperature=args.temperature, top_k=0, top_p=1.0)
    n_cand = args.candidates if reranker else 1
    dev = model.device
    ids, mask = left_pad([c.ids for c in convs], tok.pad_token_id)
    cache = None
    while convs:
        if cache is not None and n_cand > 1:
            cache.batch_repeat_interleave(n_cand)
        out = model.generate(input_ids=ids.repeat_interleave(n_cand, 0).to(dev),
                             attention_mask=mask.repeat_interleave(n_cand, 0).to(dev), cache=cache, **gen)
        new = out.sequences[:, ids.shape[1]:].cpu()
        rows = [new[k].tolist() for k in range(len(new))]
        ends = [next((i for i, token in enumerate(row) if token in stop), len(row)) for row in rows]
        texts = [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, ends)]
        chosen = list(range(len(convs)))  # the row each conversation plays
        if reranker:
            chosen = [b * n_cand + reranker.pick(tok, conv.messages, texts[b * n_cand:(b + 1) * n_cand])
                      for b, conv in enumerate(convs)]
        keep, next_rows, new_mask = [], [], torch.zeros(len(convs), new.shape[1], dtype=torch.long)
        for b, (conv, k) in enumerate(zip(convs, chosen)):
            row, n, text = rows[k], ends[k], texts[k]
            new_mask[b, :n] = 1  # the answer's tokens; its end-of-turn and the padding after it are masked out
            conv.act(text)
            if not conv.done:
                suffix = conv.suffix_ids(text)
                conv.grow(row[:n] + suffix)
            if conv.done:
                yield conv
                continue
            keep.append(b)
            next_rows.append(suffix)
        convs = [convs[b] for b in keep]
        if not convs:
            break
        if args.kv_cache:
            # The cache holds every token but the last sampled one; feed that one and the suffix, with holes
            # (masked) where answers ended early. Positions come from the mask, so they stay contiguous.
            index = torch.tensor(keep)
            out.cache.batch_select_indices(torch.tensor(chosen)[index].to(dev))
            block, block_mask = left_pad(next_rows, tok.pad_token_id)
            ids = torch.cat([ids[index], new[torch.tensor(chosen)[index]], block], 1)
            mask = torch.cat([mask[index], new_mask[index], block_mask], 1)
            cache = out.cache
        else:  # the same tokens, prefilled from scratch: ETO's evaluation loop
            ids, mask = left_pad([c.ids for c in convs], tok.pad_token_id)


def summarize(trajs: list[dict], args: Args) -> dict:
    n = max(len(trajs), 1)
    return {"env": args.env, "split": args.split, "policy": args.policy, "rerank_with": args.rerank_with,
            "candidates": args.candidates if args.rerank_with else 1, "episodes": len(trajs),
            "reward_x100": 100 * sum(t["reward"] for t in trajs) / n,
            "success_rate": sum(t["success"] for t in trajs) / n,
            "mean_steps": sum(len(t["steps"]) for t in trajs) / n,
            "env_steps": sum(len(t["steps"]) for t in trajs), "cut": sum(t.get("truncated", False) for t in trajs)}


def main() -> None:
    args = tyro.cli(Args)
    if args.threads:
        torch.set_num_threads(args.threads)
    common.seed_everything(args.seed)
    out = Path(args.out)
    done_ids = {t["id"] for t in common.read_jsonl(out, allow_empty=True)} if out.exists() else set()
    if args.rerank_with and (args.policy == "expert" or args.temperature <= 0 or args.candidates < 2):
        raise common.UserError("--rerank-with: needs a policy checkpoint, --temperature > 0 and --candidates >= 2 "
                               "(greedy decoding would give the critic one candidate to choose from)")
    reranker = None
    if args.policy != "expert":
        model, tok, base_model = common.load_policy(args.policy, args.load_in_4bit)
        if args.rerank_with:
            reranker = Reranker(args.rerank_with, model, base_model)
        model.eval()
    envs = [make_env(args.env) for _ in range(1 if args.policy == "expert" else args.num_envs)]
    prompt, paper_cap = common.Prompt(args.prompt, args.env, envs[0].system_prompt), envs[0].max_steps
    tasks = envs[0].tasks(args.split)
    if args.task_names:
        known = sorted({t.name for t in tasks})
        if unknown := [n for n in args.task_names if n not in known]:
            raise common.UserError(f"--task-names {' '.join(unknown)}: not in {args.env} {args.split}; "
                                   f"its families are: {' '.join(known)}")
        tasks = [t for t in tasks if t.name in args.task_names]
    out.parent.mkdir(parents=True, exist_ok=True)
    common.write_json(out.with_suffix(".args.json"), vars(args))

    target = min(args.num_tasks or len(tasks), len(tasks))
    source = "expert" if args.policy == "expert" else "policy"
    todo = [(task, f"{task.key}/{source}{k}") for task in tasks[:target] for k in range(args.samples_per_task)]
    written, steps, skipped, too_long, t0 = 0, 0, 0, 0, time.time()
    bar = tqdm(total=len(todo), desc=f"{args.env} {args.split}", unit="episode")
    bar.update(sum(i in done_ids for _, i in todo))

    def record(traj: dict) -> None:
        nonlocal written, steps
        common.append_jsonl(out, traj)
        written, steps = written + traj["success"], steps + len(traj["steps"])
        bar.update()
        bar.set_postfix(success=f"{written}/{bar.n}", steps_per_s=f"{steps / (time.time() - t0):.1f}")

    pending = [(task, i) for task, i in todo if i not in done_ids]
    if args.policy == "expert":
        extra = iter(tasks[target:])  # tasks to take the place of those the expert cannot finish
        while pending:
            task, traj_id = pending.pop(0)
            envs[0].max_steps = step_cap(args, envs[0], task, paper_cap)
            traj = play_expert(envs[0], task, traj_id, args.iteration, prompt)
            if traj is None or not traj["success"]:
                skipped += traj is None
                if traj is not None:
                    print(f"expert failed: {traj_id} (reward {traj['reward']:.2f})")
                if traj is None and args.num_tasks and (task := next(extra, None)):
                    pending.append((task, f"{task.key}/expert0"))
                bar.update()
                continue
            record(traj)
    else:
        room, limit = chat_room(args, model), common.length_limit(args.max_length, model)
        for start in range(0, len(pending), args.num_envs):
            wave = pending[start:start + args.num_envs]
            for env, (task, _) in zip(envs, wave):
                env.max_steps = step_cap(args, env, task, paper_cap)
            convs = [Conversation(env, task, i, tok, room, limit, prompt) for env, (task, i) in zip(envs, wave)]
            for conv in play_policy(convs, model, tok, args, reranker):
                record(conv.result(args.iteration))
                too_long += conv.too_long
    bar.close()
    for env in envs:
        env.close()

    ids = {i for _, i in todo}
    trajs = [t for t in common.read_jsonl(out, allow_empty=True) if t["id"] in ids or source == "expert"]
    summary = summarize(trajs, args)
    common.write_json(out.with_suffix(".summary.json"), summary)
    agent = args.policy + (f" + {args.rerank_with}'s pick of {args.candidates}" if args.rerank_with else "")
    row = (f"| {agent} | {args.env} {args.split} | {summary['reward_x100']:.1f} | "
           f"{100 * summary['success_rate']:.1f} | {summary['mean_steps']:.1f} | {summary['env_steps']} |")
    out.with_suffix(".summary.md").write_text("| policy | env split | reward ×100 | success % | steps | env steps |\n"
                                              "|---|---|---|---|---|---|\n" + row + "\n")
    elapsed = time.time() - t0
    print(f"{len(trajs)} trajectories in {out}; this run: {steps} env steps at {steps / elapsed:.1f} steps/s")
    if too_long:
        print(f"{too_long} episodes ended early: their chat reached --max-length {args.max_length} "
              "(or the model's context)")
    if skipped:
        print(f"skipped {skipped} tasks whose expert path is longer than the step cap (--max-steps)")
    print(row)


if __name__ == "__main__":
    common.run_stage(main)
