import os
import subprocess
import sys
from pathlib import Path

import hypothesis  # noqa: F401  imported up front: its plugin's late import at the summary trips a CPython 3.11 AST bug when -k skips test_fuzz
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub, here or in CI


def run_script(*argv: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run one of the project's scripts as a user would, from the repo root."""
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard events in folder, as TensorBoard reads them (a resumed run's purged
    steps dropped): {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="session")
def sciworld():
    from envs import make_env
    env = make_env("sciworld")
    yield env
    env.close()


@pytest.fixture(scope="session")
def sciworld_expert(tmp_path_factory) -> Path:
    """Expert trajectories of two short ScienceWorld train tasks, written by collect.py itself."""
    out = tmp_path_factory.mktemp("data") / "sw_expert.jsonl"
    run_script("collect.py", "--env", "sciworld", "--split", "train", "--num-tasks", "2", "--out", str(out))
    return out


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A policy checkpoint on the tiny model, as bc.py writes it (untrained LoRA: fast, deterministic)."""
    from peft import get_peft_model

    import common
    import models
    out = tmp_path_factory.mktemp("tiny_policy")
    model, _ = models.load_base("tiny")
    common.seed_everything(0)  # LoRA's A matrices are random: the same checkpoint in every session
    model = get_peft_model(model, models.lora_config(8, 16, 0.0), adapter_name="policy")
    models.save_policy(model, out, "tiny")
    return out
