"""Several processes (docs/scale.md): bc.py, critic.py and bppo.py under `accelerate launch` with 2 processes on
the CPU (gloo) take the same optimizer steps as one process and write one loadable checkpoint; so do bc.py and
bppo.py's full fine-tunings under an FSDP launch, their weights sharded; a killed 2-process run resumes (data
parallel and FSDP); collect.py's shards play every episode exactly once and merge into the one-process output on
WebShop (deterministic, greedy)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import common
import critic
import models
from conftest import ROOT, run_script

OPTIONS = ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
LAUNCH = ["accelerate", "launch", "--multi_gpu", *OPTIONS]
FSDP = ["accelerate", "launch", "--use_fsdp", "--fsdp_version", "2", *OPTIONS]


def launch(*argv: str, timeout: float = 600, launcher: list[str] = LAUNCH) -> str:
    proc = subprocess.run([*launcher, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def data(tiny_policy, tmp_path_factory):
    """Three WebShop demonstrations (an optimizer step of 3 splits unevenly over 2 processes), relabelled, and
    scored by a one-process critic."""
    d = tmp_path_factory.mktemp("dp")
    run_script("collect.py", "--env", "webshop", "--split", "train", "--num-tasks", "3", "--out", str(d / "expert.jsonl"))
    run_script("relabel.py", str(d / "expert.jsonl"), "--out", str(d / "hybrid.jsonl"))
    run_script("critic.py", "--data", str(d / "hybrid.jsonl"), "--policy", str(tiny_policy), "--out", str(d / "critic"))
    return {"expert": d / "expert.jsonl", "hybrid": d / "hybrid.jsonl", "scored": d / "critic" / "scored.jsonl",
            "policy": tiny_policy, "dir": d}


def argv(stage: str, data: dict, out: Path, epochs: int = 2) -> list[str]:
    step = ["--grad-accum", "3", "--epochs", str(epochs), "--out", str(out)]
    return {"bc": ["bc.py", "--data", str(data["expert"]), "--model", "tiny", "--save-every", "1"],
            "critic": ["critic.py", "--data", str(data["hybrid"]), "--policy", str(data["policy"])],
            "bppo": ["bppo.py", "--data", str(data["scored"]), "--policy",
                     str(data["policy"]), "--reference", str(data["policy"])]}[stage] + step


def weights(stage: str, out: Path) -> dict:
    if stage == "critic":
        return {**load_file(str(out / "heads.safetensors")), **load_file(str(out / "critic" / "adapter_model.safetensors"))}
    return load_file(str(out / "policy" / "adapter_model.safetensors"))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(got: dict, want: dict) -> None:
    """Weights trained by N processes against one process's: equal up to the order of float sums. Summed in
    another order a gradient differs in its last bits, and AdamW, which divides each gradient by its own running
    size, turns that into a visible difference where a gradient is a near-cancelling sum: on an AVX-512 Xeon one
    LoRA weight of 2048 came out 4e-6 apart (a hundredth of one step at BC's lr 5e-4). A lost or doubled share of
    a step moves nearly every weight by a large part of a step."""
    assert want.keys() <= got.keys()
    for k in want:
        diff = (got[k].float() - want[k].float()).abs()
        off = (diff > 1e-6 + 1e-5 * want[k].float().abs()).float().mean().item()
        assert diff.max() <= 2e-5 and off <= 0.01, f"{k}: max difference {diff.max():.2e}, {off:.1%} of it off"


@pytest.mark.parametrize("stage", ["bc", "critic", "bppo"])
def test_two_processes_take_the_steps_of_one(stage, data):
    one, two = data["dir"] / f"one-{stage}", data["dir"] / f"two-{stage}"
    run_script(*argv(stage, data, one))
    launch(*argv(stage, data, two))
    want, got = weights(stage, one), weights(stage, two)
    assert want.keys() == got.keys()
    assert_same_training(got, want)  # the same global batch and data order
    # process 0 alone logged: one line per step, the losses of the whole step
    a, b = metrics(one), metrics(two)
    assert [m["step"] for m in b] == [m["step"] for m in a] == [1, 2]
    for key in [k for k in a[0] if k.startswith(("loss", "kl_", "clip", "approx"))]:
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5, abs=1e-7)
    assert len(list(two.glob("events.out.tfevents.*"))) == 1
    assert not (two / "resume").exists()
    if stage == "critic":  # the checkpoint loads and scores as process 0 wrote it
        critic.load_critic(str(two))
        assert len(common.read_jsonl(two / "scored.jsonl")) == 3
    else:
        models.load_policy(str(two))


@pytest.fixture(scope="module")
def full(data):
    """Two full fine-tunings of the tiny model (one process): BC, and BC continued a step (π_old ≠ π_ref)."""
    bc, more = data["dir"] / "full-bc", data["dir"] / "full-more"
    run_script("bc.py", "--data", str(data["expert"]), "--model", "tiny", "--full-finetune", "--out", str(bc))
    run_script("bc.py", "--init", str(bc), "--data", str(data["expert"]), "--steps", "1", "--out", str(more))
    return {"bc": bc, "more": more}


def full_argv(stage: str, data: dict, full: dict, out: Path, epochs: int = 2) -> list[str]:
    step = ["--grad-accum", "3", "--epochs", str(epochs), "--save-every", "1", "--out", str(out)]
    return {"bc": ["bc.py", "--data", str(data["expert"]), "--model", "tiny", "--full-finetune", "--eval-frac", "0.34"],
            "bppo": ["bppo.py", "--data", str(data["scored"]), "--policy", str(full["more"]), "--reference",
                     str(full["bc"])]}[stage] + step


def full_weights(out: Path) -> dict:
    assert models.read_meta(out, "policy")["full_finetune"]
    return load_file(str(out / "policy" / "model.safetensors"))


@pytest.mark.parametrize("stage", ["bc", "bppo"])
def test_an_fsdp_full_finetuning_takes_the_steps_of_one_process(stage, data, full):
    """Weights, gradients and optimizer state sharded over 2 processes (bppo: π_ref a model of its own), an uneven
    split of each step (3 trajectories), BC's held-out NLL measured by both: one process's weights and metrics."""
    one, two = data["dir"] / f"one-full-{stage}", data["dir"] / f"fsdp-{stage}"
    run_script(*full_argv(stage, data, full, one))
    assert "FSDP: 3 units of weights sharded over 2 processes" in launch(*full_argv(stage, data, full, two),
                                                                          launcher=FSDP)
    want, got = full_weights(one), full_weights(two)
    assert set(want) <= set(got)  # FSDP's gathered state also names the head tied to the embeddings
    assert any(not torch.equal(want[k], load_file(str(full["more" if stage == "bppo" else "bc"] / "policy" /
                                                        "model.safetensors"))[k]) for k in want)  # it trained
    assert_same_training(got, want)
    a, b = metrics(one), metrics(two)
    assert [m["step"] for m in b] == [m["step"] for m in a] == [1, 2]
    for key in [k for k in a[0] if k.startswith(("loss", "kl_", "clip", "approx"))]:
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5, abs=1e-7)
    if stage == "bc":
        assert json.loads((two / "eval.json").read_text()) == pytest.approx(json.loads((one / "eval.json").read_text()))
    model, _, _ = models.load_policy(str(two))
    assert model.lm_head.weight is model.get_input_embeddings().weight  # loads as the model it was


def test_a_killed_fsdp_run_resumes_to_the_uninterrupted_result(data, full, tmp_path):
    """The resume state gathers the shards of weights and AdamW moments; resumed, each process takes its shard."""
    whole, out = tmp_path / "whole", tmp_path / "fsdp"
    run_script(*full_argv("bc", data, full, whole, epochs=4))
    proc = subprocess.Popen([*FSDP, *full_argv("bc", data, full, out, epochs=4)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after_first_state(proc, out)
    assert "resuming from" in launch(*full_argv("bc", data, full, out, epochs=4), launcher=FSDP)
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    want, got = full_weights(whole), full_weights(out)
    assert_same_training(got, want)


def test_a_lora_adapter_under_an_fsdp_launch_trains_data_parallel(data, tmp_path):
    run_script(*argv("bc", data, tmp_path / "one"))
    proc = subprocess.run([*FSDP, *argv("bc", data, tmp_path / "two")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "a LoRA adapter trains data-parallel" in proc.stderr
    want, got = weights("bc", tmp_path / "one"), weights("bc", tmp_path / "two")
    assert_same_training(got, want)


def kill_after_first_state(proc: subprocess.Popen, out: Path) -> None:
    """Kill a launch (the launcher and its workers) once it wrote step 1's resume state (--save-every 1)."""
    state, deadline = out / "resume" / "state.pt", time.time() + 300
    while not state.exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first resume state"
        time.sleep(0.05)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers run in sessions of their own
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "qevolve.json").exists()


def descendants(pid: int) -> list[int]:
    """Every process below pid, as /proc tells it."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_result(data, tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "bc"
    run_script(*argv("bc", data, whole, epochs=5))
    proc = subprocess.Popen([*LAUNCH, *argv("bc", data, out, epochs=5)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_after_first_state(proc, out)
    assert "resuming from" in launch(*argv("bc", data, out, epochs=5))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5]
    want, got = weights("bc", whole), weights("bc", out)
    assert_same_training(got, want)


def test_collect_shards_play_every_episode_once_and_merge_into_the_one_process_output(data, tmp_path):
    play = ["collect.py", "--env", "webshop", "--policy", str(data["policy"]), "--split", "train", "--num-tasks", "3",
            "--samples-per-task", "2", "--max-steps", "3", "--max-new-tokens", "8", "--temperature", "0",
            "--num-envs", "2"]

    def episodes(path: Path) -> dict[str, dict]:
        trajs = common.read_jsonl(path)
        assert len({t["id"] for t in trajs}) == len(trajs)  # none twice
        return {t["id"]: t for t in trajs}

    run_script(*play, "--out", str(tmp_path / "one.jsonl"))
    one = episodes(tmp_path / "one.jsonl")
    assert len(one) == 6
    # under accelerate launch: each process a shard by its rank, the last to finish merges
    launch(*play, "--out", str(tmp_path / "launched.jsonl"))
    assert episodes(tmp_path / "launched.jsonl") == one
    assert sorted(p.name for p in tmp_path.glob("launched*")) == [
        "launched.args.json", "launched.jsonl", "launched.logs", "launched.summary.json", "launched.summary.md"]
    # by hand, one shard at a time: the first alone merges nothing; run again it plays nothing; the second merges
    sharded = tmp_path / "sharded.jsonl"
    first = run_script(*play, "--out", str(sharded), "--shard", "0/2").stdout
    assert "shard 0/2 done" in first and not sharded.exists()
    assert len(common.read_jsonl(tmp_path / "sharded.shard0of2.jsonl")) == 3
    assert "this run: 0 env steps" in run_script(*play, "--out", str(sharded), "--shard", "0/2").stdout
    run_script(*play, "--out", str(sharded), "--shard", "1/2")
    assert episodes(sharded) == one
    assert not list(tmp_path.glob("sharded.shard*"))
    summary = json.loads((tmp_path / "sharded.summary.json").read_text())
    assert summary["episodes"] == 6 and summary == json.loads((tmp_path / "one.summary.json").read_text())


@pytest.mark.parametrize("argv, message", [
    (["--policy", "expert", "--shard", "0/2"], "--shard: the expert's episodes are cheap"),
    (["--policy", "POLICY", "--shard", "2/2"], "--shard 2/2: expected I/N with 0 <= I < N"),
])
def test_bad_shards_are_refused(argv, message, data, tmp_path):
    argv = [str(data["policy"]) if a == "POLICY" else a for a in argv]
    proc = run_script("collect.py", "--env", "webshop", "--out", str(tmp_path / "x.jsonl"), *argv, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_nproc_launches_the_training_stages_and_the_policys_rollouts(tmp_path):
    def dry(**env) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "evolve.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "DRY_RUN": "1", "RUN": str(tmp_path / "r"), **env})
    lines = dry(NPROC="2").stdout.splitlines()
    stages = {line.split()[1].rstrip(":").split("/r/")[1]: line for line in lines if line.startswith("[dry]")}
    launched = {s for s, line in stages.items() if "accelerate launch --multi_gpu --num_processes 2 " in line}
    assert launched == set(stages) - {"0/expert", "1/relabel", "2/relabel"}
    assert all(" python " in stages[s] for s in ("0/expert", "1/relabel"))
    assert "NPROC" not in dry(NPROC="2").stdout.split("DRY_RUN=1")[0]  # no setting: the same run either way
    bad = dry(NPROC="two")
    assert bad.returncode == 2 and "NPROC=two: the number of processes" in bad.stderr
    fsdp = dry(NPROC="2", FSDP="1", FULL_FINETUNE="1").stdout
    assert "accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 " in fsdp and "--multi_gpu" not in fsdp
    assert "--full-finetune --lr 2e-5" in fsdp.split("/0/bc: ")[1].splitlines()[0]
    assert "FULL_FINETUNE   1" in fsdp and "BPPO_LR         2e-6" in fsdp
    assert "--full-finetune" not in fsdp.split("/1/bppo: ")[1].splitlines()[0]  # bppo goes on with the checkpoint
    assert dry(FSDP="yes").returncode == 2 and dry(FULL_FINETUNE="2").returncode == 2


def test_the_smoke_loop_with_two_processes(tmp_path):
    """FULL_FINETUNE=1 NPROC=2 FSDP=1 SMOKE=1 bash evolve.sh, one iteration (the paper's full fine-tuning, sharded;
    each stage's data-parallel LoRA path is tested above): every stage under the launcher finishes, BC and BPPO
    shard the whole model, each rollout is played once, and the loop reports as with one process."""
    run = tmp_path / "run"
    proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "SMOKE": "1", "NPROC": "2", "FSDP": "1", "FULL_FINETUNE": "1",
                               "ITERS": "1", "RUN": str(run)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [t["id"] for t in common.read_jsonl(run / "1" / "collect" / "self.jsonl")]
    assert len(ids) == len(set(ids)) == 2 * 2  # 2 tasks × 2 samples, played by 2 shards, merged
    assert sorted(p.name for p in (run / "1" / "collect" / "self.logs").iterdir()) == ["shard0of2", "shard1of2"]
    assert "| BC |" in proc.stdout and "| Iter 1 |" in proc.stdout and (run / "report.html").exists()
    assert proc.stdout.count("FSDP: 3 units of weights sharded over 2 processes") == 2  # bc, bppo
    assert models.read_meta(run / "1" / "bppo", "policy") == {"kind": "policy", "base_model": "tiny",
                                                              "full_finetune": True}


def test_a_deepspeed_launch_is_refused(data, tmp_path):
    proc = subprocess.run([sys.executable, *argv("bc", data, tmp_path / "o")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "ACCELERATE_USE_DEEPSPEED": "true"})
    assert proc.returncode == 2 and "a DeepSpeed launch" in proc.stderr and "Traceback" not in proc.stderr
