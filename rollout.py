"""How a policy plays episodes: one episode's conversation, the engine that plays many of them on one model,
and ETO's one-episode loop, the reference the engine must match.

The engine (bench/rollout_speed.py measures it against the reference on this machine):
- continuous batching: as many episodes as environments are in flight; when one ends, its slot takes the next
  task, and when an answer ends its slot acts and goes on at once: no slot waits for the longest episode of a
  wave, nor for the longest answer of a turn;
- the prompt prefix every episode shares (the system prompt; with --prompt eto also ETO's one-shot example) is
  prefilled once, and its keys and values are copied into each new episode's row;
- each row keeps its KV cache between turns and prefills only its new tokens (end of turn, observation, next
  generation prompt), tokenized once (Conversation.suffix_ids), in a forward of its own: on a CPU a forward costs
  what its padded width costs, and a new episode's prompt is ten times an observation;
- the decode feeds one token per row, all rows in one forward: the weights, read once, serve every row;
- the cache is a buffer with spare room written in place: transformers' DynamicCache concatenates, which copies
  the whole cache at every decoded token (a third of a decode step at 800 cached tokens, 2 CPU cores);
- positions a row does not use (another row's prefill, an old episode) are masked holes, compacted away once
  they are worth a copy of the cache;
- environments that allow it reset and step side by side in threads (ScienceWorld: one JVM each).

What stays on the table (docs/speed.md): a row's prefill leaves holes in every other row, which the decode reads
until a compaction; writing it into the row's own free positions needs explicit 4-D masks (or paged attention, as
vLLM has). Guessing tokens ahead from the chat (prompt-lookup speculative decoding) was tried: 1.6× fewer decode
forwards, each 1.5× dearer on this CPU, so no gain.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from transformers.cache_utils import Cache, DynamicLayer

import chat
import common
import models
from envs import Task, TextEnv

if not torch.cuda.is_available():
    # A block of new tokens on a masked cache: without this, transformers copies every layer's keys and values
    # to repeat them over the query heads (grouped-query attention); torch's CPU attention takes them as they are.
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


def trajectory(env: TextEnv, task: Task, traj_id: str, source: str, iteration: int, info: dict, obs0: str,
               messages: list[dict], steps: list[dict], reward: float, success: bool) -> dict:
    return {"id": traj_id, "env": env.name, "task": task.name, "variation": task.variation, "split": task.split,
            "source": source, "iteration": iteration, "instruction": info["instruction"],
            "initial_observation": obs0, "messages": messages, "steps": steps, "reward": reward, "success": success}


def env_step(env: TextEnv, text: str, t: int) -> tuple[dict, dict | None]:
    """One turn: parse the answer, act (or report a format error), return the step record."""
    action = chat.parse_action(text)
    if action is None:  # no action: the project's format-error observation, and the turn counts
        obs, reward, done, info = chat.FORMAT_ERROR, 0.0, t + 1 >= env.max_steps, None
    else:
        obs, reward, done, info = env.step(action)
    step = {"text": text, "action": action, "observation": obs, "env_reward": reward, "done": done,
            "format_ok": action is not None, "valid": bool(info and info["valid"])}
    return step, info


class Conversation:
    """One episode in flight: its chat, its steps and the tokens the model has seen so far."""

    def __init__(self, env: TextEnv, task: Task, traj_id: str, tokenizer, room: int, limit: int,
                 prompt: chat.Prompt):
        """room: the most tokens the chat may hold before the next answer (limit less one answer); limit: the
        longest chat the training stages take (models.length_limit)."""
        self.env, self.task, self.traj_id, self.tok, self.prompt = env, task, traj_id, tokenizer, prompt
        self.room, self.limit = room, limit
        self.obs0, self.info = env.reset(task)
        self.messages = prompt.first(self.info["instruction"], self.obs0)
        self.steps: list[dict] = []
        self.score, self.won, self.done, self.ended = self.info.get("score", 0.0), False, False, False
        self.too_long = False  # cut because the chat reached the length limit
        self.ids = chat.tokenize_chat(tokenizer, self.messages, add_generation_prompt=True)[0]
        if len(self.ids) > room:
            raise common.UserError(f"{task.key}: the first prompt has {len(self.ids)} tokens, more than the "
                                   f"{room} that leave room for an answer (--max-length less --max-new-tokens, "
                                   "or the model's context)")

    def suffix_ids(self, answer: str) -> list[int] | None:
        """Tokens after the answer's own tokens: end of turn, the observation, the next generation prompt; None
        when the chat template changes the answer's text (the chat must then be prefilled anew).

        The answer stays as the model generated it (it is in the KV cache already); the text around it is
        tokenized segment by segment, as chat.tokenize_chat does for training."""
        segments = chat.chat_segments(self.tok, self.messages, add_generation_prompt=True)
        last = max(i for i, (_, is_answer) in enumerate(segments) if is_answer)
        piece = segments[last][0]
        for content in (answer, answer.strip()):
            if content and content in piece:
                tail = piece[piece.find(content) + len(content):]
                break
        else:
            tail = piece if not answer.strip() else None
        if tail is None:
            return None
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
        if self.ended or len(chat.tokenize_chat(self.tok, self.messages, add_generation_prompt=True)[0]) > self.limit:
            self.messages.pop()
        traj = trajectory(self.env, self.task, self.traj_id, "policy", iteration, self.info,
                          self.obs0, self.messages, self.steps, self.score, self.won)
        return traj | {"truncated": not self.ended}


def left_pad(rows: list[list[int]], pad_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max([width] + [len(r) for r in rows])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):], mask[b, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def stop_tokens(model, tok) -> list[int]:
    """End of turn: the tokenizer's EOS and the model's own (Llama-3's <|eot_id|> is only in the latter)."""
    configured = model.generation_config.eos_token_id
    return sorted({tok.eos_token_id, *(configured if isinstance(configured, list) else [configured])} - {None})


def for_rollouts(model, merge: bool = True):
    """The policy as the engine runs it: on an unquantized model the LoRA adapter is merged into the weights
    (one matmul per projection instead of three; the same function up to float rounding). A 4-bit base is left
    as it is: merging into nf4 weights would round the adapter away."""
    if merge and not getattr(model, "is_loaded_in_4bit", False) and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.eval()


class BufferLayer(DynamicLayer):
    """One layer's keys and values, [rows, kv heads, capacity, head dim], appended in place (capacity doubles)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.is_initialized, self.device = True, keys.device
        self.kbuf, self.vbuf = keys, values
        self.advance(keys.shape[-2])

    def advance(self, length: int) -> None:
        """The first `length` positions are in use: keys and values are views of them."""
        self.length = length
        self.keys, self.values = self.kbuf[:, :, :length], self.vbuf[:, :, :length]

    def reserve(self, n: int) -> None:
        if n > self.kbuf.shape[-2]:
            for name in ("kbuf", "vbuf"):
                old = getattr(self, name)
                new = old.new_zeros(old.shape[:2] + (max(n, 2 * old.shape[-2]), old.shape[-1]))
                new[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, new)
            self.advance(self.length)

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self.kbuf[:, :, self.length:end], self.vbuf[:, :, self.length:end] = key_states, value_states
        self.advance(end)
        return self.keys, self.values

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace both buffers' used part by fn(used part) (row selection, compaction), in place when the rows
        stay (no new buffer to allocate: what lies past the used part is old, finite, and masked)."""
        for name, used in (("kbuf", self.keys), ("vbuf", self.values)):
            result, buf = fn(used), getattr(self, name)
            if result.shape[0] == buf.shape[0] and result.shape[2] <= buf.shape[2]:
                buf[:, :, :result.shape[2]] = result
            else:
                setattr(self, name, result)
        self.advance(result.shape[2])


class RowLayer(DynamicLayer):
    """One row of a BufferLayer as a batch of one, whose new keys and values go to that row's positions from
    `start` on: a forward of one row's new tokens, without padding, leaving the other rows as they are."""

    def __init__(self, src: BufferLayer, row: int, start: int):
        super().__init__()
        self.is_initialized, self.device = True, src.kbuf.device
        self.src, self.row, self.start = src, row, start
        self.keys, self.values = src.kbuf[row:row + 1, :, :start], src.vbuf[row:row + 1, :, :start]

    def update(self, key_states, value_states, *args, **kwargs):
        end, r = self.start + key_states.shape[-2], self.row
        self.src.kbuf[r, :, self.start:end], self.src.vbuf[r, :, self.start:end] = key_states[0], value_states[0]
        self.keys, self.values = self.src.kbuf[r:r + 1, :, :end], self.src.vbuf[r:r + 1, :, :end]
        return self.keys, self.values


class Engine:
    """Plays episodes on the rows of one batch, one slot per environment (see the module docstring).

    A slot's new tokens are prefilled in a forward of its row alone (on a CPU a forward costs what its padded
    width costs, and new tokens range from a 20-token observation to a whole first prompt); the rows in the
    middle of an answer decode together, one token each per forward. With a reranker, each slot holds
    `candidates` rows that sample their own answer; when all have ended, the critic's pick is played and its
    row copied over the others."""

    def __init__(self, model, tok, max_new_tokens: int, temperature: float, reranker=None, candidates: int = 1):
        self.model, self.tok = model, tok
        self.max_new, self.temperature, self.reranker = max_new_tokens, temperature, reranker
        self.n = candidates if reranker else 1
        self.stop = set(stop_tokens(model, tok))
        self.dev = model.device
        # where the time goes (bench/rollout_speed.py prints it)
        self.stats = dict(prefill_s=0.0, prefill_forwards=0, prefill_tokens=0, decode_s=0.0, decode_forwards=0,
                          answer_tokens=0)

    # ------------------------------------------------------------------ the batch: cache, mask, positions
    # mask[r, j] = 1 where row r's position j holds one of its tokens (else a hole); seen[r] = how many it holds,
    # which is also the position the row's next token takes.
    def _start(self, first: list[Conversation]) -> None:
        """The shared prefix (the longest common start of the first conversations, less their last token),
        prefilled once; the batch starts empty."""
        prefix = first[0].ids[:-1]
        for conv in first[1:]:
            prefix = prefix[:self._common(prefix, conv.ids)]
        self.prefix = prefix
        cfg = self.model.config
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.prefix_kv = []
        if prefix:
            out = self.model(input_ids=torch.tensor([prefix], device=self.dev), use_cache=True, logits_to_keep=1)
            self.prefix_kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        rows = len(first) * self.n
        dtype = self.model.get_input_embeddings().weight.dtype  # the compute dtype, also under a 4-bit base
        empty = torch.zeros(rows, cfg.num_key_value_heads, 0, dim, dtype=dtype, device=self.dev)
        self.kv = Cache(layers=[BufferLayer(empty, empty.clone()) for _ in range(cfg.num_hidden_layers)])
        self.mask = torch.zeros(rows, 0, dtype=torch.long)
        self.seen = torch.zeros(rows, dtype=torch.long)

    def _common(self, prefix: list[int], ids: list[int]) -> int:
        """How much of `prefix` starts `ids`, leaving at least ids' last token to prefill (for its logits)."""
        n = 0
        while n < min(len(prefix), len(ids) - 1) and ids[n] == prefix[n]:
            n += 1
        return n

    def _enter(self, slot: int, conv: Conversation) -> tuple[int, list[int]]:
        """Start `conv` in `slot`: its rows forget their last episode. Returns its first block: how many tokens of
        the shared prefix to copy, and the tokens to prefill after them."""
        rows = slice(slot * self.n, (slot + 1) * self.n)
        self.mask[rows], self.seen[rows] = 0, 0
        n = self._common(self.prefix, conv.ids)
        return n, conv.ids[n:]

    def _prefill(self, blocks: dict[int, tuple[int, list[int]]]) -> dict[int, torch.Tensor]:
        """Give each row in `blocks` its block (n, tokens): the shared prefix's first n keys and values, copied,
        then the tokens, prefilled in a forward of that row alone. The blocks start at the same position of the
        batch (holes after the shorter ones, and in the other rows); rows of one slot share a block, prefilled
        once and copied. Returns the logits after each row's last token."""
        t0, layers, start = time.time(), self.kv.layers, self.mask.shape[1]
        width = max(n + len(tokens) for n, tokens in blocks.values())
        for layer in layers:
            layer.reserve(start + width)
        new = torch.zeros(len(self.seen), width, dtype=torch.long)
        logits = {}
        for r, (n, tokens) in sorted(blocks.items()):
            end = start + n + len(tokens)
            new[r, :n + len(tokens)] = 1
            if r % self.n and r - 1 in blocks:  # a candidate row: the same block as its slot's first row
                for layer in layers:
                    layer.kbuf[r, :, start:end], layer.vbuf[r, :, start:end] = (
                        layer.kbuf[r - 1, :, start:end], layer.vbuf[r - 1, :, start:end])
                logits[r] = logits[r - 1]
                continue
            for layer, (k, v) in zip(layers, self.prefix_kv if n else []):
                layer.kbuf[r, :, start:start + n], layer.vbuf[r, :, start:start + n] = k[0, :, :n], v[0, :, :n]
            attn = torch.cat([self.mask[r], new[r, :n + len(tokens)]])[None]
            pos = (self.seen[r] + n + torch.arange(len(tokens)))[None]
            out = self.model(input_ids=torch.tensor([tokens], device=self.dev), attention_mask=attn.to(self.dev),
                             position_ids=pos.to(self.dev), use_cache=True, logits_to_keep=1,
                             cache=Cache(layers=[RowLayer(layer, r, start + n) for layer in layers]))
            logits[r] = out.logits[0, -1].float().cpu()
            self.stats["prefill_forwards"] += 1
            self.stats["prefill_tokens"] += len(tokens)
        for layer in layers:
            layer.advance(start + width)
        self.mask, self.seen = torch.cat([self.mask, new], 1), self.seen + new.sum(1)
        self.stats["prefill_s"] += time.time() - t0
        return logits

    def _decode(self, tokens: list[int | None]) -> torch.Tensor:
        """Feed each row its token (None: a row that is done, fed a masked pad), all rows in one forward;
        the logits after it."""
        t0 = time.time()
        ids = torch.tensor([[self.tok.pad_token_id if t is None else t] for t in tokens])
        fed = torch.tensor([[t is not None] for t in tokens], dtype=torch.long)
        attn = torch.cat([self.mask, fed], 1)
        out = self.model(input_ids=ids.to(self.dev), attention_mask=attn.to(self.dev),
                         position_ids=self.seen[:, None].to(self.dev), cache=self.kv, use_cache=True, logits_to_keep=1)
        self.mask, self.seen = attn, self.seen + fed[:, 0]
        self.stats["decode_s"] += time.time() - t0
        self.stats["decode_forwards"] += 1
        return out.logits[:, -1].float().cpu()

    def _select(self, rows: list[int]) -> None:
        if rows == list(range(len(self.seen))):
            return
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.kv.layers:
            layer.apply(lambda t: t[index.to(t.device)])
        self.mask, self.seen = self.mask[index], self.seen[index]

    def _compact(self) -> None:
        """Move each row's tokens to the right end of a cache as wide as the longest row (holes dropped), once
        the holes are worth a copy of the cache: every decode forward reads the whole cache, holes included (8 rows
        of 1000 tokens are 0.37 GB, 22 ms of a 100 ms forward), and each prefill leaves holes in the other rows."""
        if not len(self.seen):
            return
        width = int(self.seen.max())
        if self.mask.shape[1] <= width + 64 + width // 4:
            return
        # each row's used positions in order, right-aligned; the slots to their left point at position 0, masked
        order = torch.sort(self.mask * torch.arange(1, self.mask.shape[1] + 1), dim=1, stable=True).indices
        index = order[:, order.shape[1] - width:]
        mask = torch.gather(self.mask, 1, index)
        for layer in self.kv.layers:
            layer.apply(lambda t: torch.gather(t, 2, index.to(t.device)[:, None, :, None].expand(
                t.shape[0], t.shape[1], width, t.shape[3])))
        self.mask = mask

    # ------------------------------------------------------------------ one turn, and the whole play
    def _next_tokens(self, logits: torch.Tensor) -> list[int]:
        if self.temperature <= 0:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits / self.temperature, -1)
        return torch.multinomial(probs, 1).squeeze(-1).tolist()

    @torch.no_grad()
    def play(self, envs: list[TextEnv], episodes: Iterable[Callable[[TextEnv], Conversation]]
             ) -> Iterator[Conversation]:
        """Play `episodes` (each a function that starts its Conversation on the environment it is given) on as many
        slots as `envs`: a slot whose episode ends takes the next one. Yields each finished conversation.

        Every iteration samples one token for each row in the middle of an answer and feeds it (one decode
        forward for all rows). A slot whose answer has ended acts on it at once (the critic's pick first, with a
        reranker), and its next tokens (end of turn and observation, or a new episode's prompt) are prefilled
        before the next decode, so no slot waits for the longest answer of the others.
        Environments that allow it (TextEnv.parallel: ScienceWorld's, each in its own JVM) reset and step side by
        side in threads; which slot takes which episode, and so every sample drawn, does not depend on timing."""
        episodes, n = iter(episodes), self.n
        with ThreadPoolExecutor(len(envs) if all(env.parallel for env in envs) else 1) as pool:
            def start(free: list[TextEnv]) -> list[Conversation]:  # the next episodes, one per free environment
                return list(pool.map(lambda job: job[1](job[0]), list(zip(free, episodes))))

            convs = start(envs)
            if not convs:
                return
            self._start(convs)
            blocks = {s: self._enter(s, c) for s, c in enumerate(convs)}  # slot -> the block it prefills next
            rows = len(convs) * n
            logits, answers, live, unfed = [None] * rows, [[] for _ in range(rows)], [False] * rows, [False] * rows
            while convs:
                if blocks:  # these slots' rows prefill their new tokens, then start an answer
                    prefilled = self._prefill({s * n + j: b for s, b in blocks.items() for j in range(n)})
                    for r, row_logits in prefilled.items():
                        logits[r], answers[r], live[r], unfed[r] = row_logits, [], True, False
                    blocks = {}
                    self._compact()
                feed: list[int | None] = [None] * len(live)
                for r, token in enumerate(self._next_tokens(torch.stack(logits))):
                    if not live[r]:
                        continue
                    if token in self.stop:
                        live[r] = False
                        continue
                    answers[r].append(token)
                    if len(answers[r]) == self.max_new:
                        live[r], unfed[r] = False, True
                    else:
                        feed[r] = token
                if any(t is not None for t in feed):
                    decoded = self._decode(feed)
                    for r, t in enumerate(feed):
                        if t is not None:
                            logits[r] = decoded[r]
                ready = [s for s in range(len(convs)) if not any(live[s * n:(s + 1) * n])]  # answers ended just now
                if not ready:
                    continue
                texts = {s * n + j: self.tok.decode(answers[s * n + j], skip_special_tokens=True)
                         for s in ready for j in range(n)}
                self.stats["answer_tokens"] += sum(len(answers[r]) for r in texts)
                chosen = {s: s * n for s in ready}  # the row each conversation plays
                if self.reranker:
                    chosen = {s: s * n + self.reranker.pick(self.tok, convs[s].messages,
                                                            [texts[s * n + j] for j in range(n)]) for s in ready}
                list(pool.map(lambda s: convs[s].act(texts[chosen[s]]), ready))
                ended = []
                for s in ready:
                    conv, k = convs[s], chosen[s]
                    suffix = None if conv.done else conv.suffix_ids(texts[k])
                    if not conv.done:
                        conv.grow(answers[k] + (suffix or []))
                    if conv.done:
                        ended.append(s)
                        yield conv
                    elif suffix is None:  # the template rewrote the answer: this chat is prefilled anew
                        conv.ids = chat.tokenize_chat(self.tok, conv.messages, add_generation_prompt=True)[0]
                        blocks[s] = None
                    else:
                        blocks[s] = 0, answers[k][-1:] * unfed[k] + suffix
                fresh = start([convs[s].env for s in ended])
                for s, conv in zip(ended, fresh):
                    convs[s], blocks[s] = conv, None  # entered below, once the rows are selected
                gone = set(ended[len(fresh):])
                if n > 1 or gone:  # the pick's row copied over its siblings; slots with no episode left closed
                    keep = [s for s in range(len(convs)) if s not in gone]
                    index = [chosen[s] if s in chosen else s * n + j for s in keep for j in range(n)]
                    self._select(index)
                    logits, answers = [logits[r] for r in index], [answers[r] for r in index]
                    live, unfed = [live[r] for r in index], [unfed[r] for r in index]
                    blocks = {keep.index(s): b for s, b in blocks.items() if s not in gone}
                    convs = [convs[s] for s in keep]
                for s, b in list(blocks.items()):
                    if b is None:
                        blocks[s] = self._enter(s, convs[s])


def play_one(env: TextEnv, task: Task, traj_id: str, model, tok, prompt: chat.Prompt, max_new_tokens: int,
             max_length: int = 4096) -> dict:
    """ETO's evaluation loop, the reference: one episode at a time, the whole chat prefilled again every turn
    with transformers' generate, greedy. The engine plays the same episodes (tests, bench/rollout_speed.py)."""
    limit = models.length_limit(max_length, model)
    conv = Conversation(env, task, traj_id, tok, limit - max_new_tokens, limit, prompt)
    stop = stop_tokens(model, tok)
    with torch.no_grad():
        while not conv.done:
            ids = torch.tensor([conv.ids], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=stop)
            answer = out[0, ids.shape[1]:].tolist()
            answer = answer[:next((i for i, t in enumerate(answer) if t in stop), len(answer))]
            text = tok.decode(answer, skip_special_tokens=True)
            conv.act(text)
            if not conv.done:
                conv.grow(answer)  # the length check only; the next prompt is the chat tokenized anew
                conv.ids = chat.tokenize_chat(tok, conv.messages, add_generation_prompt=True)[0]
    return conv.result(0)


class Reranker:
    """The critic as a test-time selector (paper Table 3, "w/o PI"; also Best-of-N): of the candidate answers
    the policy samples at a step, the agent plays the one with the highest Q(s_t, a).

    The critic's adapter is loaded onto the policy's model (they share the base model), and Q is read where
    critic.py reads it in training: at the candidate's end-of-turn token, after the chat so far."""

    def __init__(self, checkpoint: str, model, base_model: str):
        from critic import load_heads
        meta = models.read_meta(checkpoint, "critic")
        if meta["base_model"] != base_model:
            raise common.UserError(f"--rerank-with {checkpoint}: a critic on {meta['base_model']}, the policy is on "
                                   f"{base_model}")
        if models.is_full_finetune(model):  # the critic's adapter belongs on the base weights, not on these
            raise common.UserError(f"--rerank-with {checkpoint}: the policy is a full fine-tuning; reranking loads "
                                   "the critic's adapter onto a LoRA policy's base model")
        model.load_adapter(str(Path(checkpoint) / "critic"), adapter_name="critic", is_trainable=False)
        model.set_adapter("policy")
        self.model, self.heads = model, load_heads(checkpoint, model.config.hidden_size).to(model.device)

    @torch.no_grad()
    def q_values(self, tok, messages: list[dict], texts: list[str]) -> list[float]:
        """Q of each candidate answer after the chat `messages` (which ends with the current observation)."""
        rows = []
        for text in texts:
            ids, spans = chat.tokenize_chat(tok, messages + [{"role": "assistant", "content": text}])
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
