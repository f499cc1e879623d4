"""End to end: evolve.sh's whole loop (SMOKE=1: the tiny model, two ScienceWorld tasks) on the real ScienceWorld,
killed in the middle of a stage and run again."""
import os
import signal
import subprocess
import time
from collections import Counter

import common
from conftest import ROOT


def evolve(run, **env) -> subprocess.Popen:
    return subprocess.Popen(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "SMOKE": "1", "RUN": str(run), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_smoke_loop_survives_a_kill_and_reports(tmp_path):
    run = tmp_path / "run"
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
    assert "[done] " + str(run / "0" / "bc") in out  # finished stages are not run again

    for it in (1, 2):
        ids = Counter(t["id"] for t in common.read_jsonl(run / str(it) / "collect" / "self.jsonl"))
        assert len(ids) == 2 * 2 and max(ids.values()) == 1  # 2 tasks × 2 samples, none twice, none lost
        scored = common.read_jsonl(run / str(it) / "critic" / "scored.jsonl")
        assert all("advantage" in s for t in scored for s in t["steps"])
        assert common.read_meta(run / str(it) / "bppo", "policy")["base_model"] == "tiny"
    table = (run / "results.md").read_text()
    for name in ("| BC |", "| Iter 1 |", "| Iter 2 |"):
        assert name in table and name in out
    assert (run / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_smoke_loop_with_etos_prompt(tmp_path):
    """PROMPT=eto: ETO's instruction, "OK" and one-shot example open every chat, in BC data and rollouts alike,
    and only the answers after the task are steps (trained, scored, updated)."""
    run = tmp_path / "run"
    proc = evolve(run, PROMPT="eto", ITERS="1")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    instruction = (ROOT / "data" / "eto" / "prompt_instructions_sciworld_inst.txt").read_text()
    example = common.eto_example("sciworld")
    for path in ("0/expert/train.jsonl", "1/collect/self.jsonl", "1/critic/scored.jsonl", "1/eval_seen/episodes.jsonl"):
        for t in common.read_jsonl(run / path):
            head = t["messages"][:3 + len(example)]
            assert head[:2] == [{"role": "user", "content": instruction}, {"role": "assistant", "content": "OK"}]
            assert head[2:2 + len(example)] == example and head[-1]["content"] == t["instruction"]
            answers = [m["content"] for m in t["messages"] if m["role"] == "assistant"]
            assert [s["text"] for s in t["steps"]] == answers[1 + len(example) // 2:] and len(t["steps"]) <= 3
    assert "PROMPT          eto" in (run / "settings.txt").read_text() and "| Iter 1 |" in out
