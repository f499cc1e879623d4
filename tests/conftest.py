import os
import signal
import subprocess
import sys
import time
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


@pytest.fixture(scope="session")
def tiny_full_policy(sciworld_expert, tmp_path_factory) -> Path:
    """A full fine-tuning of the tiny model, as bc.py --full-finetune writes it (one epoch)."""
    out = tmp_path_factory.mktemp("tiny_full_policy")
    run_script("bc.py", "--data", str(sciworld_expert), "--model", "tiny", "--full-finetune", "--epochs", "1",
               "--lr", "1e-3", "--out", str(out))
    return out


def evolve(run: Path, **env) -> subprocess.Popen:
    """SMOKE=1 bash evolve.sh into run, with more settings; its output on stdout."""
    return subprocess.Popen(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "SMOKE": "1", "RUN": str(run), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> tuple[Path, str]:
    """The smoke loop killed in the middle of iteration 1's rollouts and run again to the end, as a user would
    after a crash: (RUN, the second run's output). test_evolve checks the loop, test_report its page."""
    run = tmp_path_factory.mktemp("smoke") / "run"
    proc = evolve(run)
    collecting = run / "1" / "collect" / "self.jsonl"
    deadline = time.time() + 600
    while not (collecting.exists() and collecting.read_text().count("\n") >= 1):  # mid-stage: episodes in flight
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "iteration 1 never started collecting"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "1" / "collect" / ".done").exists()
    proc = evolve(run)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return run, out
