"""End to end: evolve.sh's whole loop (SMOKE=1: the tiny model, two ScienceWorld tasks) on the real ScienceWorld,
killed in the middle of a stage and run again."""
import json
import os
import subprocess
from collections import Counter

import chat
import common
import models
from conftest import ROOT, evolve, tensorboard_scalars


def test_smoke_loop_survives_a_kill_and_reports(smoke_run):
    run, out = smoke_run  # killed in the middle of iteration 1's rollouts, then run again to the end
    assert "[done] " + str(run / "0" / "bc") in out  # finished stages are not run again

    for it in (1, 2):
        ids = Counter(t["id"] for t in common.read_jsonl(run / str(it) / "collect" / "self.jsonl"))
        assert len(ids) == 2 * 2 and max(ids.values()) == 1  # 2 tasks × 2 samples, none twice, none lost
        scored = common.read_jsonl(run / str(it) / "critic" / "scored.jsonl")
        assert all("advantage" in s for t in scored for s in t["steps"])
        assert models.read_meta(run / str(it) / "bppo", "policy")["base_model"] == "tiny"
    table = (run / "results.md").read_text()
    for name in ("| BC |", "| Iter 1 |", "| Iter 2 |"):
        assert name in table and name in out
    assert (run / "results.png").read_bytes()[:4] == b"\x89PNG"
    # where the time went: each stage's marker holds its own seconds (the killed collect's only its second run)
    assert all((run / "1" / stage / ".done").read_text().startswith("seconds ") for stage in ("collect", "bppo"))
    assert "minutes per stage of" in out and "| critic |  |" in out and "| **all** |" in out
    # `tensorboard --logdir RUN` shows the loop: the evaluations over the iterations, each stage's own curves
    loop = tensorboard_scalars(run / "loop")
    assert [step for step, _ in loop["eval/unseen_reward_x100"]] == [0, 1, 2]
    assert all("losses/loss" in tensorboard_scalars(run / str(it) / "bppo") for it in (1, 2))
    assert "losses/loss_q" in tensorboard_scalars(run / "1" / "critic")


def test_smoke_loop_with_etos_prompt(tmp_path):
    """PROMPT=eto: ETO's instruction, "OK" and one-shot example open every chat, in BC data and rollouts alike,
    and only the answers after the task are steps (trained, scored, updated)."""
    run = tmp_path / "run"
    proc = evolve(run, PROMPT="eto", ITERS="1")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    instruction = (ROOT / "data" / "eto" / "prompt_instructions_sciworld_inst.txt").read_text()
    example = chat.eto_example("sciworld")
    for path in ("0/expert/train.jsonl", "1/collect/self.jsonl", "1/critic/scored.jsonl", "1/eval/seen.jsonl"):
        for t in common.read_jsonl(run / path):
            head = t["messages"][:3 + len(example)]
            assert head[:2] == [{"role": "user", "content": instruction}, {"role": "assistant", "content": "OK"}]
            assert head[2:2 + len(example)] == example and head[-1]["content"] == t["instruction"]
            answers = [m["content"] for m in t["messages"] if m["role"] == "assistant"]
            assert [s["text"] for s in t["steps"]] == answers[1 + len(example) // 2:] and len(t["steps"]) <= 3
    assert "PROMPT          eto" in (run / "settings.txt").read_text() and "| Iter 1 |" in out


def dry_run(**env) -> str:
    proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


DEPARTURE_FLAGS = ("--refit-rounds", "--heldout-frac", "--eval-frac", "--normalize-adv", "--max-grad-norm", "--clip-values")


def test_departures_are_explicit_flags_on_the_cpu_and_absent_at_paper_scale(tmp_path):
    """Every departure from the paper reaches a stage only as a flag on its command line: the CPU default names
    each one, DEPARTURES=none and PRESET=7b none of them (the stages' own defaults are the paper's)."""
    cpu = dry_run(RUN=str(tmp_path / "cpu"))
    assert "DEPARTURES      exact_fit heldout grad_clip value_clip" in cpu
    commands = {line.split(":")[0].split("/")[-1]: line for line in cpu.splitlines() if "/1/" in line}
    assert "--refit-rounds 20 --heldout-frac 0.1 --max-grad-norm 1.0 --clip-values" in commands["critic"]
    assert "--max-grad-norm 1.0" in commands["bppo"] and "--normalize-adv" not in commands["bppo"]
    with_norm = dry_run(RUN=str(tmp_path / "n"), DEPARTURES="adv_norm")  # measured harmful, off by default
    assert "--normalize-adv" in next(line for line in with_norm.splitlines() if "/1/bppo" in line)
    assert "--eval-frac 0.1" in next(line for line in cpu.splitlines() if "/0/bc" in line)
    assert not (tmp_path / "cpu").exists()  # a dry run writes nothing
    for paper in (dry_run(RUN=str(tmp_path / "p"), DEPARTURES="none"),
                  dry_run(RUN=str(tmp_path / "7b"), PRESET="7b", ENV="webshop", STANDIN="1")):
        stages = [line for line in paper.splitlines() if line.startswith("[dry]")]
        assert stages and not any(flag in line for line in stages for flag in DEPARTURE_FLAGS)
    assert "DEPARTURES      none" in paper and "ITERS           3" in paper  # the paper's 3 WebShop iterations
    assert "/3/bppo" in paper and "/4/" not in paper
    proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", "DEPARTURES": "clip"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "DEPARTURES: clip is none of" in proc.stderr


def test_task_lists_reach_the_stages_and_each_iteration_draws_its_own(tmp_path):
    """DEMO_TASKS, TRAIN_TASKS and EVAL_TASKS replace ETO's splits: the expert plays the demonstrations' list, each
    iteration's rollouts its own round of the pool, each evaluation the named sets; GAE_LAMBDA and adv_center
    reach the critic and BPPO."""
    lists = {"DEMO_TASKS": "data/tasks/lifespan-demos.txt", "TRAIN_TASKS": "data/tasks/lifespan-pool.txt",
             "EVAL_TASKS": "dev=data/tasks/lifespan-dev.txt confirm=data/tasks/lifespan-confirm.txt"}
    out = dry_run(RUN=str(tmp_path / "r"), GAE_LAMBDA="0", DEPARTURES="value_clip adv_center", **lists)
    stage = {line.split(":")[0].split("/r/")[-1]: line for line in out.splitlines() if line.startswith("[dry]")}
    assert "--task-file train=data/tasks/lifespan-demos.txt --num-tasks 18" in stage["0/expert"]
    for it in (1, 2):
        assert f"--task-file train=data/tasks/lifespan-pool.txt --num-tasks 12 --round {it} " in stage[f"{it}/collect"]
        assert "--task-file dev=data/tasks/lifespan-dev.txt confirm=data/tasks/lifespan-confirm.txt" in stage[f"{it}/eval"]
        assert "--gae-lambda 0" in stage[f"{it}/critic"] and "--center-adv" in stage[f"{it}/bppo"]
    assert "EVAL_TASKS      dev=data/tasks/lifespan-dev.txt confirm=data/tasks/lifespan-confirm.txt" in out
    plain = dry_run(RUN=str(tmp_path / "p"))  # without lists: ETO's splits, as before
    assert "--task-file" not in plain and "--round" not in plain and "--split seen unseen" in plain


def test_paper_scale_runs_on_the_real_environment_or_says_what_is_missing(tmp_path):
    """PRESET=7b: the paper's step caps; without ALFWorld's official games (or a working WebShop) one line saying
    what is missing and how to get it, unless STANDIN=1 accepts our stand-in, which the settings then name;
    the planner's template thoughts are named a departure unless EXPERT gives released trajectories."""
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    for name, extra in (("alfworld", {}), ("webshop", {})):
        proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**env, "DRY_RUN": "1", "PRESET": "7b",
                                                                    "ENV": name, **extra},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
        assert f"PRESET=7b ENV={name}: " in proc.stderr and "STANDIN=1" in proc.stderr
    assert "ALFWORLD_DATA" in subprocess.run(["python", "-m", "envs", "data", "alfworld", "--why"], cwd=ROOT, env=env,
                                             capture_output=True, text=True).stdout
    standin = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**env, "DRY_RUN": "1", "PRESET": "7b",
                                                                   "ENV": "alfworld", "STANDIN": "1"},
                             capture_output=True, text=True, timeout=60)
    assert standin.returncode == 0 and "ENV_DATA        generated" in standin.stdout
    assert "MAX_STEPS       30" in standin.stdout and "--max-steps 30" in standin.stdout
    assert "template thoughts, a departure" in standin.stderr
    official = dry_run(PRESET="7b", ENV="alfworld", ALFWORLD_DATA=str(ROOT / "tests" / "data" / "alfworld"))
    assert "ENV_DATA        official" in official
    for name, cap in (("sciworld", 24), ("webshop", 10)):
        assert f"MAX_STEPS       {cap}" in dry_run(PRESET="7b", ENV=name, STANDIN="1")
    assert "--max-steps" not in dry_run(PROMPT="eto")  # ETO's caps come with its prompt alone
    released = str(ROOT / "tests" / "data" / "expert_files" / "eto_style_sciworld_messages.json")
    proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", "PRESET": "7b",
                                                                "EXPERT": released}, capture_output=True, text=True)
    assert "template thoughts" not in proc.stderr and f"EXPERT          {released}" in proc.stdout
    assert f"tools/import_expert.py {released} --env sciworld --out" in proc.stdout


def test_the_smoke_loop_from_released_expert_trajectories(tmp_path):
    """EXPERT=FILE: BC and the hybrid data take a released file's trajectories (ETO-style ScienceWorld records)."""
    run = tmp_path / "run"
    released = ROOT / "tests" / "data" / "expert_files" / "eto_style_sciworld_messages.json"
    proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "SMOKE": "1", "RUN": str(run),
                                                                "EXPERT": str(released), "PROMPT": "eto",
                                                                "ITERS": "1", "MAX_STEPS": "3"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expert = common.read_jsonl(run / "0" / "expert" / "train.jsonl")
    assert [t["id"] for t in expert] == [r["id"] for r in json.loads(released.read_text())][:2]
    hybrid = common.read_jsonl(run / "1" / "relabel" / "hybrid.jsonl")
    assert {t["id"] for t in hybrid if t["source"] == "expert"} == {t["id"] for t in expert}
    assert json.loads((run / "0" / "bc" / "args.json").read_text())["data"] == [str(run / "0/expert/train.jsonl")]
    assert (run / "1" / "bppo" / ".done").exists() and "| Iter 1 |" in (run / "results.md").read_text()


def test_variants_seed_and_last_only_evaluation(tmp_path):
    """The baselines continue BC for BPPO's number of steps at its learning rate and batch (sft on the expert data,
    rft also on the successful rollouts); SEED reaches every stage; EVAL=last evaluates BC and the last policy."""
    def stages(**env):
        out = dry_run(RUN=str(tmp_path / "r"), **env)
        return {line.split(":")[0].removeprefix("[dry]").strip().removeprefix(str(tmp_path / "r") + "/"): line
                for line in out.splitlines() if line.startswith("[dry]")}

    qevolve = stages(SEED="7")
    random_stages = [line for stage, line in qevolve.items() if "relabel" not in stage]  # relabel.py has no randomness
    assert len(random_stages) == 11 and all(line.endswith("--seed 7") or " --seed 7 " in line for line in random_stages)
    assert {"0/eval", "1/eval", "2/eval"} <= set(qevolve)
    # 18 demonstrations + 12 tasks × 2 samples = 42 trajectories: BPPO takes ceil(42 / 4) = 11 steps an iteration
    same = "--steps 11 --lr 1e-4 --schedule constant --grad-accum 4"
    sft = stages(VARIANT="sft", EVAL="last")
    assert sorted(sft) == ["0/bc", "0/eval", "0/expert", "1/sft", "2/eval", "2/sft"]
    assert f"bc.py --init {tmp_path}/r/1/sft --data {tmp_path}/r/0/expert/train.jsonl {same}" in sft["2/sft"]
    rft = stages(VARIANT="rft")
    assert sorted(rft) == ["0/bc", "0/eval", "0/expert", "1/collect", "1/eval", "1/rft", "2/collect", "2/eval",
                           "2/rft"]
    assert (f"--init {tmp_path}/r/1/rft --data {tmp_path}/r/0/expert/train.jsonl {tmp_path}/r/2/collect/self.jsonl "
            f"--successes-only {same}") in rft["2/rft"]
    assert f"--policy {tmp_path}/r/1/rft" in rft["2/collect"]
    # TRACK=1: every stage but relabel also logs to W&B, grouped by the run; tracking is no setting
    tracked = stages(SEED="7", TRACK="1")
    assert all((" --track" in line) == ("relabel" not in stage) for stage, line in tracked.items())
    assert "TRACK" not in dry_run(TRACK="1").split("DRY_RUN=1")[0]
    for bad, message in (({"VARIANT": "ppo"}, "VARIANT=ppo: use qevolve"), ({"EVAL": "some"}, "EVAL=some: use")):
        proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", **bad},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr


def test_smoke_loop_without_policy_improvement(tmp_path):
    """VARIANT=no_pi (Table 3's "w/o PI"): no BPPO; the BC policy with the critic's pick of CANDIDATES sampled
    answers per step is evaluated like every row."""
    run = tmp_path / "run"
    proc = evolve(run, VARIANT="no_pi", ITERS="1", CANDIDATES="3")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert not (run / "1" / "bppo").exists()
    args = json.loads((run / "1" / "eval" / "seen.args.json").read_text())
    assert args["policy"] == str(run / "0" / "bc") and args["rerank_with"] == str(run / "1" / "critic")
    assert args["candidates"] == 3 and args["temperature"] > 0
    assert "| Iter 1 (BC + critic's pick of 3) |" in (run / "results.md").read_text()


def test_stage_times_from_the_markers(tmp_path):
    # Seconds written by evolve.sh count as they are; an old empty marker is timed from the one before it.
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import stage_times
    run = tmp_path / "run"
    for it, stage, text, mtime in ((0, "bc", "seconds 600\n", 1000), (0, "eval", "", 1090),
                                   (1, "collect", "seconds 120", 1300), (1, "critic", "", 1480)):
        (run / str(it) / stage).mkdir(parents=True)
        (run / str(it) / stage / ".done").write_text(text)
        os.utime(run / str(it) / stage / ".done", (mtime, mtime))
    times = stage_times.stage_seconds(run)
    assert times == {(0, "bc"): 600, (0, "eval"): 90, (1, "collect"): 120, (1, "critic"): 180}
    table = stage_times.table(run)
    assert "| bc | 10.0 |  | 10.0 |" in table and "| critic |  | 3.0 | 3.0 |" in table
    assert "| **all** | 11.5 | 5.0 | **16.5** |" in table
