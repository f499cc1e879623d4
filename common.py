"""What every stage shares: clear errors for people, the trajectory schema and its JSONL files, run folders
(arguments, atomic writes, seeds), resumable training and metrics tracking.

Models and checkpoints are in models.py, chats (ReAct prompts and parsing, expert records released elsewhere,
action-token masks) in chat.py, environment adapters in envs/.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
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
# One trajectory per JSONL line. Later stages add per-step fields (aux_reward, rules, value, q, advantage)
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
                from chat import from_conversation  # here, not above: chat.py builds on this module
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
    if not main_process():
        return
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
                tensor.copy_(_shard_like(state["tensors"][name], tensor))
        self.optimizer.load_state_dict(state["optimizer"])
        for param, moments in self.optimizer.state.items():  # FSDP: sharded as their parameter is
            for k, v in moments.items():
                moments[k] = _shard_like(v, param) if torch.is_tensor(v) and v.dim() else v
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
        self.last_saved = step
        params = self.tensors()
        sharded = any(_is_sharded(v) for v in params.values())
        if not sharded and not main_process():  # the processes hold the same weights: one writes them
            return
        tensors = {k: _whole(v) for k, v in params.items()}  # FSDP: gathered, every process taking part
        optimizer = self.optimizer.state_dict()
        if sharded:
            optimizer["state"] = {i: {k: _whole(v) if torch.is_tensor(v) else v for k, v in moments.items()}
                                  for i, moments in optimizer["state"].items()}
        if not main_process():  # FSDP: process 0 writes what all gathered
            return
        with atomic_dir(self.dir) as tmp:
            torch.save({"args": self.args, "tensors": tensors, "optimizer": optimizer,
                        "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                        "torch_rng": torch.get_rng_state(), "progress": progress},
                       tmp / "state.pt")
            self.save_checkpoint(tmp, tensors if sharded else None)

    def check_finite(self, logs: dict, step: int) -> None:
        """Stop on a NaN or inf loss, before the optimizer writes it into the weights."""
        bad = sorted(k for k, v in logs.items() if not math.isfinite(v))
        if bad:
            kept = f"{self.dir} keeps the state of step {self.last_saved}" if self.last_saved else "nothing was saved"
            raise UserError(f"non-finite {', '.join(bad)} at optimizer step {step + 1}; stopped before the "
                            f"update ({kept}). Try a lower --lr (delete {self.dir} to start over with it)")

    def done(self) -> None:
        """The stage wrote its final checkpoint: the resume state is no longer needed."""
        if main_process():
            shutil.rmtree(self.dir, ignore_errors=True)


# ----------------------------------------------------------------------------- data-parallel processes
def _is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


def _whole(tensor):
    """A tensor on the CPU; a tensor FSDP shards is gathered whole first (every process must call this)."""
    return (tensor.full_tensor() if _is_sharded(tensor) else tensor).detach().cpu()


def _shard_like(value, like):
    """`value`, a whole tensor, cut into this process's shard when `like` is sharded by FSDP."""
    if not _is_sharded(like):
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements)


def main_process() -> bool:
    """Whether this is process 0 of a data-parallel launch (or the only process): the one that writes."""
    return os.environ.get("RANK", "0") == "0"


class Workers:
    """The processes of a data-parallel launch (`accelerate launch --multi_gpu --num_processes N`, or torchrun).
    Every process holds the whole model and data and walks the same optimizer steps in the same order (same
    seed); each computes the gradient of its share of a step's trajectories, and the shares' gradients are summed
    before the update, so N processes take exactly the steps one process takes (docs/scale.md). Process 0 alone
    writes checkpoints, resume state, metrics and printed output. Under plain `python` there is one process and
    every method hands back what it was given. Under an FSDP launch a full fine-tuning's weights are sharded too.

        workers = Workers(); model = workers.shard(model)
        for j in workers.share(group): ...; (loss / whole_group_size).backward()
        workers.sum_grads(params); logs = workers.sum(logs, ("loss",))
    """

    def __init__(self) -> None:
        self.size, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.main = self.rank == 0
        self.sharded = None  # the model whose weights FSDP shards (shard), else None
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
            raise UserError("a DeepSpeed launch: the stages shard a full fine-tuning with FSDP instead "
                            "(accelerate launch --use_fsdp; docs/scale.md)")
        if self.size > 1:
            import torch
            import torch.distributed as dist
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per process
            if not dist.is_initialized():
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            if not self.main:
                sys.stdout = open(os.devnull, "w")  # would repeat process 0's; errors still reach stderr

    def shard(self, model):
        """Under an FSDP launch (`accelerate launch --use_fsdp`, an accelerate config with distributed_type FSDP)
        a full fine-tuning's weights, gradients and optimizer state are sharded over the processes with torch's
        FSDP2: each decoder layer a unit, the rest (embeddings, final norm, LM head) the root's. A LoRA model
        (its base frozen) stays whole on every process and trains data-parallel."""
        import models
        if self.size == 1 or os.environ.get("ACCELERATE_USE_FSDP", "").lower() not in ("1", "true"):
            return model
        if not models.is_full_finetune(model):
            print("FSDP launch: a LoRA adapter trains data-parallel (FSDP shards full fine-tunings)", file=sys.stderr)
            return model
        import types
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true"
        layers = model.get_decoder().layers
        for layer in layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=True)  # outside a pass every weight is its shard
        for unit in [*layers, model]:  # summed as sum_grads sums: each process's loss is its share of the step
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
        # The stages' pass is models.action_logprobs (decoder, then the LM head at the action tokens), not
        # forward(): FSDP gathers the root's weights (embeddings, norm, head) around it as around a forward.
        model.sharded_logprobs = types.MethodType(models.token_logprobs, model)
        register_fsdp_forward_method(model, "sharded_logprobs")
        self.sharded = model
        print(f"FSDP: {len(layers) + 1} units of weights sharded over {self.size} processes")
        return model

    def share(self, items: list):
        """This process's share of one optimizer step's items: every size-th, from its rank on. Under FSDP every
        process must run as many forward and backward passes (each gathers weights with the others): a shorter
        share is made up with passes that change nothing."""
        mine = items[self.rank::self.size]
        yield from mine
        if self.sharded is not None:
            for _ in range(-(-len(items) // self.size) - len(mine)):
                self._idle_pass()

    def _idle_pass(self) -> None:
        """A forward and backward pass through every weight with a zero loss (FSDP's collectives; no gradient)."""
        import torch
        import models
        ids = torch.zeros(1, 2, dtype=torch.long, device=models.device())
        (models.action_logprobs(self.sharded, ids, torch.ones_like(ids), torch.ones_like(ids)).sum() * 0).backward()

    def full_weights(self, model) -> dict | None:
        """FSDP: the sharded model's whole state dict on process 0 (every process must call it); else None."""
        if self.sharded is None:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def sum_grads(self, params: list) -> None:
        """Each parameter's gradient summed over the processes (one all-reduce of them all, flattened); under
        FSDP the backward pass has already summed each shard's gradient."""
        if self.size == 1 or self.sharded is not None:
            return
        import torch
        import torch.distributed as dist
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # an empty share: none
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = chunk.view_as(p).clone()

    def sum(self, values: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """Per-process partial sums of `keys` (a logged loss, token counts), summed over the processes."""
        if self.size == 1:
            return {k: values.get(k, 0.0) for k in keys}
        import torch
        import torch.distributed as dist
        total = torch.tensor([float(values.get(k, 0.0)) for k in keys], dtype=torch.float64)
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def finish(self) -> bool:
        """The processes' shared work is over; True for process 0, which goes on to write the results."""
        if self.size > 1:
            import torch.distributed as dist
            dist.barrier()
            dist.destroy_process_group()
        return self.main


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

    def __init__(self, jsonl: str | os.PathLike, tb_dir: str | os.PathLike, args, resumed_step: int = 0,
                 on: bool | None = None):
        self.on = main_process() if on is None else on  # of data-parallel processes, process 0 logs
        if not self.on:
            return
        path = Path(jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.exists() else []
        path.write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= resumed_step))
        self.file = open(path, "a")
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
        if not self.on:
            return
        self.scalars(step, **groups)
        self.file.write(json.dumps({"step": step, **{k: v for g in groups.values() for k, v in g.items()}}) + "\n")
        self.file.flush()

    def scalars(self, step: int, **groups: dict[str, float]) -> None:
        """TensorBoard (and W&B) only: end-of-run figures that have their own file (eval.json, summaries)."""
        if not self.on:
            return
        for group, values in groups.items():
            for name, value in values.items():
                self.tb.add_scalar(f"{group}/{name}", value, step)
        self.tb.flush()  # a killed run keeps its curve up to its last step, like metrics.jsonl

    def close(self) -> None:
        if not self.on:
            return
        self.file.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
