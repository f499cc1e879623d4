"""Reliability across the loop: a wrong input costs one clear line and exit 2; a SIGKILL at a random point of a
training stage is undone by running the same command again (bit for bit the uninterrupted result); a NaN loss
stops training and keeps the last good state; ScienceWorld's JVM dying mid-collection costs one replay."""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file

import common
import models
from conftest import ROOT, run_script, tensorboard_scalars


@pytest.fixture(scope="module")
def files(sciworld_expert, tiny_policy, tmp_path_factory):
    """Real stage outputs on the tiny model, and broken copies of them."""
    d = tmp_path_factory.mktemp("faults")
    run_script("relabel.py", str(sciworld_expert), "--out", str(d / "hybrid.jsonl"))
    run_script("critic.py", "--data", str(d / "hybrid.jsonl"), "--policy", str(tiny_policy), "--out",
               str(d / "critic"), "--epochs", "1")
    good = [json.loads(line) for line in sciworld_expert.read_text().splitlines()]
    scored = [json.loads(line) for line in (d / "critic" / "scored.jsonl").read_text().splitlines()]

    def write(name, records):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in records))  # json.dumps writes NaN as NaN
        return str(d / name)

    no_valid = json.loads(json.dumps(good[0]))
    del no_valid["steps"][0]["valid"]
    inf_adv = json.loads(json.dumps(scored[0]))
    inf_adv["steps"][-1]["advantage"] = math.inf
    (d / "not_a_model").mkdir()
    (d / "empty.jsonl").write_text("\n")
    return {"expert": str(sciworld_expert), "hybrid": str(d / "hybrid.jsonl"), "scored": str(d / "critic" / "scored.jsonl"),
            "policy": str(tiny_policy), "critic": str(d / "critic"), "not_a_model": str(d / "not_a_model"),
            "missing": str(d / "missing.jsonl"), "empty": str(d / "empty.jsonl"), "out": str(d / "out"),
            "no_steps": write("no_steps.jsonl", [good[0], {**good[1], "steps": []}]),
            "mistyped": write("mistyped.jsonl", [{**good[0], "variation": "7"}]),
            "no_valid": write("no_valid.jsonl", [good[1], no_valid]),
            "nan_reward": write("nan_reward.jsonl", [json.loads(line) | {"reward": math.nan}
                                                     for line in open(d / "hybrid.jsonl")]),
            "inf_adv": write("inf_adv.jsonl", [inf_adv])}


# (case, argv with {placeholders} from `files`, what the one line must say)
BAD_INPUT = [
    ("bc: no such file", "bc.py --data {missing} --model tiny --out {out}", "{missing}: no such file"),
    ("bc: empty dataset", "bc.py --data {empty} --model tiny --out {out}", "{empty}: no trajectories in the file"),
    ("bc: trajectory without steps", "bc.py --data {no_steps} --model tiny --out {out}",
     "{no_steps}:2: field 'steps': a trajectory needs at least one step"),
    ("bc: mistyped field", "bc.py --data {mistyped} --model tiny --out {out}",
     "{mistyped}:1: field 'variation': expected int"),
    ("bc: not a model", "bc.py --data {expert} --model {not_a_model} --out {out}",
     "--model {not_a_model}: cannot load a causal LM"),
    ("bc: longer than the context", "bc.py --data {expert} --model tiny --max-length 64 --out {out}", "tokens > 64"),
    ("collect: no checkpoint", "collect.py --env sciworld --policy {missing} --out {out}/x.jsonl",
     "{missing}: not a policy checkpoint (no qevolve.json in it)"),
    ("collect: a critic, not a policy", "collect.py --env sciworld --policy {critic} --out {out}/x.jsonl",
     "{critic}: holds a 'critic' checkpoint, not a policy"),
    ("collect: first prompt longer than the context",
     "collect.py --env sciworld --policy {policy} --num-tasks 1 --max-length 200 --out {out}/x.jsonl",
     "the first prompt has"),
    ("relabel: missing step field", "relabel.py {no_valid} --out {out}/h.jsonl",
     "{no_valid}:2: missing field 'steps[0].valid'"),
    ("critic: not relabelled", "critic.py --data {expert} --policy {policy} --out {out}",
     "has no finite 'aux_reward'; relabel.py writes it"),
    ("critic: non-finite reward", "critic.py --data {nan_reward} --policy {policy} --out {out}",
     "{nan_reward}:1: field 'reward': nan is not a finite number"),
    ("critic: a critic as the policy", "critic.py --data {hybrid} --policy {critic} --out {out}",
     "holds a 'critic' checkpoint, not a policy"),
    ("critic: longer than the context", "critic.py --data {hybrid} --policy {policy} --max-length 64 --out {out}",
     "tokens > 64"),
    ("bppo: no advantages", "bppo.py --data {hybrid} --policy {policy} --reference {policy} --out {out}",
     "has no finite 'advantage'; critic.py writes it"),
    ("bppo: infinite advantage", "bppo.py --data {inf_adv} --policy {policy} --reference {policy} --out {out}",
     "has no finite 'advantage'"),
    ("bppo: a critic as the reference", "bppo.py --data {scored} --policy {policy} --reference {critic} --out {out}",
     "holds a 'critic' checkpoint, not a policy"),
    ("bppo: longer than the context",
     "bppo.py --data {scored} --policy {policy} --reference {policy} --max-length 64 --out {out}", "tokens > 64"),
]


@pytest.mark.parametrize("case,argv,message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_clear_line(files, case, argv, message):
    proc = run_script(*argv.format(**files).split(), check=False, timeout=300)
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and last.startswith("error: "), proc.stderr[-2000:]
    assert message.format(**files) in last, last


@pytest.mark.parametrize("argv,flag,choices", [
    ("collect.py --env minecraft --out x.jsonl", "--env", "sciworld"),
    ("collect.py --env sciworld --split test --out x.jsonl", "--split", "unseen"),
    ("critic.py --data x --policy y --process-reward td", "--process-reward", "q_minus_v"),
    ("bppo.py --data x --policy y --reference y --objective ppo", "--objective", "awr"),
])
def test_a_flag_outside_its_choices_is_refused_with_the_choices(argv, flag, choices):
    """Flags with a fixed set of values are Literal: tyro refuses others before anything runs, listing them."""
    proc = run_script(*argv.split(), check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    text = " ".join(proc.stderr.replace("│", " ").split())
    assert f"for argument '{flag}'" in text and choices in text, text


def stage_argv(stage: str, files: dict, out: Path) -> list[str]:
    common_flags = ["--out", str(out), "--epochs", "3", "--grad-accum", "1", "--save-every", "1", "--threads", "1"]
    return {"bc": ["bc.py", "--data", files["expert"], "--eval-data", files["expert"], "--model", "tiny"],
            "critic": ["critic.py", "--data", files["hybrid"], "--policy", files["policy"]],
            "bppo": ["bppo.py", "--data", files["scored"], "--policy", files["policy"], "--reference", files["policy"]],
            }[stage] + common_flags


def weights(stage: str, out: Path) -> dict:
    if stage == "critic":
        return {**load_file(str(out / "heads.safetensors")), **load_file(str(out / "critic" / "adapter_model.safetensors"))}
    return load_file(str(out / "policy" / "adapter_model.safetensors"))


@pytest.mark.parametrize("stage", ["bc", "critic", "bppo"])
def test_sigkill_at_a_random_step_then_rerun_gives_the_uninterrupted_result(files, stage, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_script(*stage_argv(stage, files, whole))
    steps = len((whole / "metrics.jsonl").read_text().splitlines())  # 2 trajectories x 3 epochs
    kill_after = random.Random(stage).randint(1, steps - 1)

    proc = subprocess.Popen([sys.executable, *stage_argv(stage, files, killed)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = killed / "metrics.jsonl", time.time() + 300
    state = killed / "resume" / "state.pt"  # written after each step's metrics line: kill once both are there
    while not (state.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after):
        assert proc.poll() is None and time.time() < deadline, f"{stage} ended before step {kill_after}"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "qevolve.json").exists()  # no final checkpoint from a killed run

    out = run_script(*stage_argv(stage, files, killed)).stdout
    assert "resuming from" in out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, steps + 1))
    # TensorBoard drops the killed run's events past its resume state: one point per step, as uninterrupted
    curves = tensorboard_scalars(killed)
    assert {tag: [s for s, _ in points] for tag, points in curves.items() if tag.startswith("losses/")} == \
        {tag: list(range(1, steps + 1)) for tag in tensorboard_scalars(whole) if tag.startswith("losses/")}
    want, got = weights(stage, whole), weights(stage, killed)
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
    assert not (killed / "resume").exists()
    models.read_meta(killed, "critic" if stage == "critic" else "policy")


def test_nan_loss_stops_and_keeps_the_last_good_state(files, tmp_path):
    out = tmp_path / "bc"
    argv = ["bc.py", "--data", files["expert"], "--eval-data", files["expert"], "--model", "tiny", "--out", str(out),
            "--grad-accum", "1", "--save-every", "1", "--lr", "1e30"]  # step 1 blows the weights up: step 2 is NaN
    proc = run_script(*argv, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert last.startswith("error: non-finite loss at optimizer step 2") and "keeps the state of step 1" in last
    assert not (out / "qevolve.json").exists()  # the NaN weights were never written as the result
    model, _, base = models.load_policy(str(out / "resume"))  # the last good state is a policy checkpoint
    assert base == "tiny" and all(p.isfinite().all() for p in model.parameters())
    # Rerunning with another learning rate must not silently mix two runs.
    proc = run_script(*argv[:-1], "1e-3", check=False)
    assert proc.returncode == 2 and "holds a run with other settings (lr)" in proc.stderr


def java_children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and "java" in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def test_collection_survives_the_jvm_dying(tmp_path):
    out = tmp_path / "expert.jsonl"
    proc = subprocess.Popen([sys.executable, "collect.py", "--env", "sciworld", "--split", "train", "--num-tasks", "6",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    jvms = java_children(proc.pid)
    assert jvms, "no JVM under collect.py"
    for pid in jvms:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    trajs = common.read_jsonl(out)
    assert len(trajs) == 6 and max(Counter(t["id"] for t in trajs).values()) == 1
    assert all(t["success"] for t in trajs)  # the replayed episode still wins
    assert "restarting it and replaying" in err or "JVM failed" in err
