"""Chats: the ReAct answer format, how an episode's chat opens (our short prompt or ETO's, the paper's), expert
records released elsewhere read as trajectories, and where a chat's action tokens are (the mask every training
stage trains and scores).
"""
from __future__ import annotations

import functools
import json
import re
import zlib
from pathlib import Path

from common import UserError

# ----------------------------------------------------------------------------- ReAct prompts
FORMAT_ERROR = "Invalid format. The input must contain 'Action: '."
# "Action: go to shelf 1", "ACTION: go to shelf 1" (AgentTuning), "Action:\nclick[Buy Now]" (the next line)
_ACTION_RE = re.compile(r"^[ \t]*action[ \t]*:[ \t]*(.*?)[ \t]*$"
                        r"(?:\n[ \t]*(?!(?:thought|observation)[ \t]*:)(\S.*?)[ \t]*$)?",
                        re.MULTILINE | re.IGNORECASE)


def parse_action(text: str) -> str | None:
    """The first 'Action: ...' of a ReAct answer, in any case, with the command on the same line or the next;
    None when there is none (a format error)."""
    m = _ACTION_RE.search(text)
    return (m[1] or m[2] or None) if m else None


def react(thought: str, action: str) -> str:
    return f"Thought: {thought}\nAction: {action}"


def first_messages(system_prompt: str, instruction: str, observation: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt},
            {"role": "user", "content": f"Task: {instruction}\n\nObservation: {observation}"}]


def observation_message(observation: str, sep: str = " ") -> dict:
    return {"role": "user", "content": f"Observation:{sep}{observation}"}


PROMPTS = ("short", "eto")


class Prompt:
    """How an episode's chat opens and how it shows each observation, the same in expert data and rollouts.

    short: our system prompt (the adapter's), then one user turn with the task and the first observation.
    eto:   ETO's protocol, which the paper follows (data/eto/): ETO's instruction as a user turn, "OK", ETO's
           one-shot example as user / assistant turns, then the task: ALFWorld's first observation (which
           ends with the task), ScienceWorld's task description alone, WebShop's first page. Observations
           are "Observation: ..." ("Observation:\n..." on WebShop), as ETO's wrappers write them."""

    def __init__(self, style: str, env: str, system_prompt: str):
        if style not in PROMPTS:
            raise UserError(f"--prompt {style!r}: use one of {', '.join(PROMPTS)}")
        self.style, self.env, self.system_prompt = style, env, system_prompt
        if style == "eto":
            self.instruction = (ETO_DIR / f"prompt_instructions_{env}_inst.txt").read_text()

    def first(self, instruction: str, observation: str) -> list[dict]:
        if self.style == "short":
            return first_messages(self.system_prompt, instruction, observation)
        task = instruction if self.env == "sciworld" else observation
        return [{"role": "user", "content": self.instruction}, {"role": "assistant", "content": "OK"},
                *eto_example(self.env), {"role": "user", "content": task}]

    def observation(self, observation: str) -> dict:
        return observation_message(observation, "\n" if self.style == "eto" and self.env == "webshop" else " ")


def strip_observation(text: str) -> str:
    return text.removeprefix("Observation:").strip()


# ----------------------------------------------------------------------------- expert data from elsewhere
# Speaker names of the public agent data sets: ETO / AgentGym / AgentTuning ("from"/"value") and OpenAI-style
# ("role"/"content").
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ENV_NAMES = {"alfworld": "alfworld", "webshop": "webshop", "sciworld": "sciworld", "scienceworld": "sciworld"}
ETO_DIR = Path(__file__).resolve().parent / "data" / "eto"


def from_conversation(record: dict, path: str, env: str | None = None) -> dict:
    """An expert trajectory from a conversation released elsewhere: ETO's `*_sft.json`, AgentGym's AgentTraj,
    AgentTuning's AgentInstruct ({"id" or "item_id", "conversations": [{"from", "value"}]}), or OpenAI-style
    {"messages": [{"role", "content"}]}.

    The turns before the task are prompt, not steps: the instruction, the answers that act on nothing (its "OK"
    acknowledgement) and ETO's one-shot example. Every later answer is a step, whose observation is the turn
    after it; the trajectory ends with the record's reward (1 when it has none: expert data)."""
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("field 'conversations': expected a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if speaker not in SPEAKERS or not isinstance(content, str):
            raise ValueError(f"field 'conversations[{i}]': expected {{from: human|gpt|system, value: string}} "
                             "or {role: user|assistant|system, content: string}")
        messages.append({"role": SPEAKERS[speaker], "content": content})
    traj_id = str(record.get("id", record.get("item_id", "")))
    env = next((ENV_NAMES[n] for n in ENV_NAMES if traj_id.lower().startswith(n)), None) or \
        next((ENV_NAMES[n] for n in ENV_NAMES if n in Path(path).name.lower()), None) or env
    if env is None:
        raise ValueError(f"record {traj_id!r}: cannot tell its environment from the id or the file name; "
                         "pass --env")
    first = prompt_length(messages, env)
    reward = record.get("reward", 1.0)
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raise ValueError(f"field 'reward': expected a number, got {json.dumps(reward)[:60]}")
    steps = []
    for k in range(first, len(messages)):
        if messages[k]["role"] == "assistant":
            text = messages[k]["content"]
            nxt = messages[k + 1]["content"] if k + 1 < len(messages) else ""
            action = parse_action(text)
            steps.append({"text": text, "action": action, "observation": strip_observation(nxt),
                          "env_reward": 0.0, "done": False, "format_ok": action is not None, "valid": True})
    if not steps:
        raise ValueError("field 'conversations': no answer after the task's first turn")
    steps[-1].update(env_reward=float(reward), done=True)
    task_turn = strip_observation(messages[first - 1]["content"])
    return {"id": traj_id or f"{Path(path).stem}/{zlib.crc32(task_turn.encode()):08x}", "env": env,
            "task": traj_id, "variation": 0, "split": "train", "source": "expert", "iteration": 0,
            "instruction": task_turn, "initial_observation": task_turn, "messages": messages, "steps": steps,
            "reward": float(reward), "success": reward > 0}


def prompt_length(messages: list[dict], env: str) -> int:
    """How many leading messages are prompt: the last one is the task's first turn, before the first step.

    Skipped: system turns, the instruction and answers with no action ("OK"), then ETO's one-shot example
    for `env` if the conversation holds it (data/eto/prompt_icl_examples_*.json, the turns ETO's prompt
    builds from it)."""
    def first_act(k: int) -> int:  # the first answer that acts, from message k on
        while k < len(messages) and (messages[k]["role"] != "assistant" or parse_action(messages[k]["content"]) is None):
            k += 1
        return k

    k = first_act(0)
    icl = [m["content"].strip() for m in eto_example(env)]
    contents = [m["content"].strip() for m in messages]
    for start in range(k):
        after = first_act(start + len(icl))  # (a record may also be the example's own episode: then no match)
        if contents[start].endswith(icl[0]) and contents[start + 1:start + len(icl)] == icl[1:] and after < len(messages):
            k = after
            break
    if k == 0 or k >= len(messages) or messages[k - 1]["role"] != "user":
        raise ValueError("field 'conversations': no user turn before the first answer that acts")
    return k


def eto_example(env: str) -> list[dict]:
    """ETO's one-shot example for env, as alternating user / assistant messages (new dicts at every call)."""
    return [{"role": ("user", "assistant")[j % 2], "content": text} for j, text in enumerate(_eto_example_texts(env))]


@functools.cache
def _eto_example_texts(env: str) -> tuple[str, ...]:
    # ETO's files mix "role" and "from" keys; like ETO's prompt builder, the turn's position gives its role
    return tuple(m["content"] for m in json.loads((ETO_DIR / f"prompt_icl_examples_{env}_icl.json").read_text())[0])


# ----------------------------------------------------------------------------- action-token masks


class MaskError(UserError):
    pass


def chat_segments(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """The rendered chat cut at every message boundary and where each assistant answer starts; the flag
    marks the assistant answers (with the template's end-of-turn text).

    Each cut must be the template's own rendering of that prefix; a template that renders a prefix
    differently would misplace the action tokens, so we stop instead (MaskError)."""
    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, add_generation_prompt)
    pieces: list[tuple[str, bool]] = []
    done = 0

    def cut(prefix: str, is_answer: bool) -> None:
        nonlocal done
        if not full.startswith(prefix) or len(prefix) < done:
            raise MaskError("the chat template does not render the chat's prefixes as prefixes of the whole; "
                            "action tokens cannot be located (try another model's template)")
        pieces.append((full[done:len(prefix)], is_answer))
        done = len(prefix)

    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            cut(render(messages[:k], True), False)
        cut(render(messages[:k + 1]), m["role"] == "assistant")
    cut(full, False)
    return [(text, is_answer) for text, is_answer in pieces if text]


def tokenize_steps(tokenizer, traj: dict):
    """Token ids of a trajectory's chat and the [start, end) span of each step's answer: the last
    len(steps) assistant turns (earlier ones are the prompt's, e.g. ETO's "OK" and one-shot example).

    A chat that ends with an observation (an episode cut by the step cap, collect.py) ends with the
    generation prompt after it, as the policy would see it: its last token is where the critic reads the
    value of that final state."""
    final_state = ends_with_state(traj)
    ids, spans = tokenize_chat(tokenizer, traj["messages"], add_generation_prompt=final_state)
    return ids, spans[len(spans) - len(traj["steps"]):]


def ends_with_state(traj: dict) -> bool:
    """Whether the chat holds the state after the last step (its observation as a final user turn)."""
    return traj["messages"][-1]["role"] == "user"


def tokenize_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False):
    """Token ids of the whole chat and, for each assistant turn, its [start, end) token span.

    Segments (chat_segments) are tokenized one by one, so a turn's tokens never merge with its
    neighbours' and the spans are exact; this is also how collect.py feeds the chat to the model.
    A span is what the policy generates: the answer and its end-of-turn token (the template's first special
    token after the answer), not the text the template adds after that (SmolLM2's and Qwen's newline)."""
    special = set(tokenizer.all_special_ids)
    ids, spans = [], []
    for text, is_answer in chat_segments(tokenizer, messages, add_generation_prompt):
        start = len(ids)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if is_answer:
            end = next((i + 1 for i in range(start, len(ids)) if ids[i] in special), len(ids))
            spans.append((start, end))
    if len(spans) != sum(m["role"] == "assistant" for m in messages):
        raise MaskError("the chat template renders an assistant turn as nothing; its tokens cannot be located")
    return ids, spans
