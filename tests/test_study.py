"""tools/study.py: the bootstrap on hand-worked cases, and the runner end to end on the tiny model (two seeds of
Q-Evolve and RFT), resumed from its records."""
import json
import os
import subprocess
import sys

import numpy as np

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import study  # noqa: E402


def table_rows(text: str, heading: str) -> dict[str, str]:
    """The rows of the markdown table whose heading line starts with `heading`, by their first cell."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(heading)) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows[line.split(" | ")[0].removeprefix("| ")] = line
    return rows


def test_bootstrap_on_hand_worked_cases():
    rng = np.random.default_rng(1)
    # One seed, episodes 0 and 1: resampled means are 0, 0.5, 1 with chances 1/4, 1/2, 1/4, so the 95 % interval
    # runs from 0 to 1 around the mean 0.5.
    assert study.bootstrap([np.array([0.0, 1.0])], rng=rng) == (0.5, 0.0, 1.0)
    # Two seeds that each always score the same: only the draw of seeds varies (both 1, one each, both 0).
    assert study.bootstrap([np.array([1.0, 1.0]), np.array([0.0, 0.0])], rng=rng) == (0.5, 0.0, 1.0)
    # Nothing varies: no interval.
    assert study.bootstrap([np.full(5, 3.0), np.full(7, 3.0)], rng=rng) == (3.0, 3.0, 3.0)
    # 400 fair coin flips: the normal approximation gives 0.5 ± 1.96 · 0.5 / 20 = [0.451, 0.549].
    mean, low, high = study.bootstrap([np.repeat([0.0, 1.0], 200)], rng=rng)
    assert mean == 0.5 and abs(low - 0.451) < 0.006 and abs(high - 0.549) < 0.006
    # The same 400 flips split over 4 seeds whose rates differ (0.2 ... 0.8): the seeds' spread widens the interval.
    seeds = [np.repeat([0.0, 1.0], [100 - n, n]) for n in (20, 40, 60, 80)]
    mean, low, high = study.bootstrap(seeds, rng=rng)
    assert mean == 0.5 and high - low > 0.2


def test_paired_differences_match_tasks_within_a_seed():
    a = {1: {"t/1": {"reward": 100.0}, "t/2": {"reward": 0.0}, "t/3": {"reward": 50.0}}, 2: {"t/1": {"reward": 0.0}}}
    b = {1: {"t/2": {"reward": 100.0}, "t/1": {"reward": 100.0}}, 2: {"t/1": {"reward": 50.0}}, 3: {}}
    diffs = study.paired(a, b, "reward")  # t/3 has no partner; seed 3 none in a
    assert [d.tolist() for d in diffs] == [[0.0, -100.0], [-50.0]]


def test_a_variant_is_measured_against_the_bc_it_started_from(tmp_path):
    def policy(it, seen):  # one seen and one unseen task
        return {"iteration": it, "train_env_steps": 0, "seen": {"t/1": {"reward": seen, "success": 0.0}},
                "unseen": {"t/2": {"reward": 0.0, "success": 0.0}}}
    records = {("qevolve", 1): {"policies": [policy(0, 20.0), policy(1, 30.0)], "shared_stages": [],
                                "stage_seconds": {}},
               # sft's run trained its own BC (Q-Evolve's folder was gone): 50, and its policy 60 → Δ BC +10,
               # where against Q-Evolve's BC (20) it would read +40
               ("sft", 1): {"policies": [policy(0, 50.0), policy(1, 60.0)], "shared_stages": [], "stage_seconds": {}}}
    plan = study.Plan(seeds=[1], arms={"qevolve": {"VARIANT": "qevolve"}, "sft": {"VARIANT": "sft"}})
    text = study.report(records, plan, tmp_path, resamples=100, smoke=True)
    rows = table_rows(text, "| policy | seeds |")
    assert "+10.0 [+10.0, +10.0]" in rows["SFT (more BC)"] and "+10.0 [+10.0, +10.0]" in rows["Q-Evolve, iter 1"]
    assert "| 20.0 [20.0, 20.0] |" in rows["BC"]  # the BC row is still Q-Evolve's


def test_a_record_matches_its_settings_and_those_added_since_at_their_default():
    recorded = "ENV             sciworld\nTASKS           a b\nSEED            1"
    assert study.same_settings(recorded, recorded, {"SEED": "1"})
    assert not study.same_settings(recorded, recorded.replace("SEED            1", "SEED            2"), {})
    assert not study.same_settings(recorded, recorded.replace("a b", "a"), {})
    grown = recorded + "\nTRACK           0"  # a setting evolve.sh gained later, left at its default
    assert study.same_settings(recorded, grown, {"SEED": "1"})
    assert not study.same_settings(recorded, grown, {"SEED": "1", "TRACK": "0"})  # the study sets it: not recorded


def study_cmd(tmp_path, *extra):
    return subprocess.run([sys.executable, "tools/study.py", "--seeds", "2", "--variants", "qevolve", "rft",
                           "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"), *extra],
                          cwd=ROOT, env={**os.environ, "STUDY_SMOKE": "1"}, capture_output=True, text=True,
                          timeout=1500)


def test_study_runs_seeds_and_variants_shares_bc_and_resumes_from_its_records(tmp_path):
    proc = study_cmd(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out, runs = tmp_path / "out", tmp_path / "runs"
    for seed in (1, 2):
        # one BC per seed: rft's demonstrations, BC, its evaluation and iteration 1's rollouts (of BC, as Q-Evolve's)
        # are Q-Evolve's, linked; its own BC on expert data and successful rollouts is not
        rft = runs / f"rft-seed{seed}"
        assert all((rft / stage).is_symlink() for stage in ("0/expert", "0/bc", "0/eval", "1/collect"))
        assert (rft / "0" / "bc").resolve() == (runs / f"qevolve-seed{seed}" / "0" / "bc").resolve()
        assert not (rft / "1" / "rft").is_symlink() and (rft / "1" / "rft" / ".done").exists()
        rft_args = json.loads((rft / "1" / "rft" / "args.json").read_text())
        assert rft_args["successes_only"] and rft_args["init"] == str(rft / "0" / "bc")
        assert rft_args["data"] == [str(rft / "0/expert/train.jsonl"), str(rft / "1/collect/self.jsonl")]
        bc_args = json.loads((runs / f"qevolve-seed{seed}" / "0" / "bc" / "args.json").read_text())
        assert bc_args["seed"] == seed  # the seed reaches BC (its data order and LoRA init)
        for variant in ("qevolve", "rft"):
            rec = json.loads((out / "records" / f"{variant}-seed{seed}.json").read_text())
            assert rec["seed"] == seed and f"SEED            {seed}" in rec["settings"]
            assert [p["iteration"] for p in rec["policies"]] == [0, 1]
            # the record holds every evaluated episode, as the evaluation files do
            for policy in rec["policies"]:
                for split in ("seen", "unseen"):
                    lines = (runs / f"{variant}-seed{seed}" / str(policy["iteration"]) / "eval" / f"{split}.jsonl")
                    trajs = [json.loads(line) for line in lines.read_text().splitlines()]
                    assert len(policy[split]) == len(trajs) == 2
                    for t in trajs:
                        got = policy[split][f"{t['task']}/{t['variation']}"]
                        assert got["reward"] == 100 * t["reward"] and got["success"] == 100 * t["success"]
            assert rec["policies"][1]["train_env_steps"] > 0
        assert json.loads((out / "records" / f"rft-seed{seed}.json").read_text())["shared_stages"] == [
            "0/expert", "0/bc", "0/eval", "1/collect"]
    table = (out / "results.md").read_text()
    for row in ("| BC | 2 |", "| Q-Evolve, iter 1 | 2 |", "| RFT (BC on own successes) | 2 |",
                "| Q-Evolve, iter 1 minus RFT (BC on own successes) |"):
        assert row in table
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    for run in runs.iterdir():  # each run's page holds the study's table (evolve.sh wrote it without)
        page = (run / "report.html").read_text()
        assert "The study this run belongs to" in page and "Q-Evolve, iter 1 minus RFT" in page

    # A rerun (here without the runs: another machine) finds every run in the records and runs nothing.
    import shutil
    shutil.rmtree(runs)
    proc = study_cmd(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(": recorded in ") == 4 and "running" not in proc.stdout and not runs.exists()
    assert (out / "results.md").read_text() == table

    # A study of other settings must not overwrite these records: it stops, naming what differs.
    proc = study_cmd(tmp_path, "--set", "BPPO_LR=5e-5")
    assert proc.returncode != 0 and "records a run with other settings" in proc.stderr
    assert "BPPO_LR '1e-4' → '5e-5'" in proc.stderr and "Traceback" not in proc.stderr


def test_report_only_with_no_records_is_a_clear_error(tmp_path):
    proc = study_cmd(tmp_path, "--report-only")
    assert proc.returncode != 0 and "no records in" in proc.stderr and "Traceback" not in proc.stderr


def test_seed_level_t_interval_holm_and_bootstrap_p_on_hand_worked_cases():
    # three seeds whose mean differences are 1, 2, 3: mean 2, sd 1, se 1/√3; t(0.975, 2 df) = 4.303
    mean, low, high, p = study.seed_t([np.array([1.0, 1.0]), np.array([2.0]), np.array([4.0, 2.0])])
    half = 4.3027 / np.sqrt(3)
    assert mean == 2.0 and abs(low - (2 - half)) < 1e-3 and abs(high - (2 + half)) < 1e-3
    assert abs(p - 0.0742) < 1e-3  # two-sided, t = 2√3 on 2 df
    # Holm: 0.01 × 3, then 0.03 × 2, then 0.04 × 1 raised to the 0.06 before it
    assert np.allclose(study.holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    assert study.holm([0.5, 0.9]) == [1.0, 1.0]
    rng = np.random.default_rng(0)
    never_below = study.resampled_means([np.array([2.0, 3.0]), np.array([1.0])], 1000, rng)
    assert study.bootstrap_p(never_below) == 0.0  # no resampled mean at or below 0
    # one seed, episodes −1 and +1: a resampled mean is ≤ 0 with chance 3/4 and ≥ 0 with chance 3/4
    assert study.bootstrap_p(study.resampled_means([np.array([-1.0, 1.0])], 1000, rng)) == 1.0


def fake_record(arm: str, seed: int, rewards: dict[int, list[float]], diagnostics: dict | None = None) -> dict:
    """A record of one dev set whose policy at each iteration scored rewards (one per task)."""
    return {"arm": arm, "seed": seed, "sets": ["dev"], "shared_stages": [], "stage_seconds": {},
            "policies": [{"iteration": it, "train_env_steps": 10 * it, "diagnostics": diagnostics or {},
                          "dev": {f"t/{k}": {"reward": r, "success": float(r == 100), "steps": 4, "invalid": k % 2}
                                  for k, r in enumerate(rs)}} for it, rs in rewards.items()]}


def test_a_plans_report_pairs_each_arm_with_its_reference_and_tests_its_claims(tmp_path):
    plan = study.Plan(seeds=[1, 2], arms={"rft": {"VARIANT": "rft"}, "lam0": {"GAE_LAMBDA": "0"}},
                      labels={"lam0": "Q-Evolve, λ 0"}, versus="rft", primary="dev",
                      comparisons=[("lam0", "bc"), ("lam0", "rft")])
    diag = {"critic": {"return_corr_train": 0.5, "train_auc_v0": 0.8}, "advantage": {"mean": -0.2, "negative": 0.7},
            "bppo": {"max_approx_kl": 0.02, "mean_clip_frac": 0.01, "steps": 3, "last_kl_ref": 0.0}}
    records = {}
    for seed in (1, 2):  # BC 0 on both tasks; RFT +50 on the first; λ 0 +100 on both
        records["rft", seed] = fake_record("rft", seed, {0: [0, 0], 1: [50, 0]})
        records["lam0", seed] = fake_record("lam0", seed, {0: [0, 0], 1: [100, 100]}, diag)
    text = study.report(records, plan, tmp_path, resamples=200, smoke=True)
    main, invalid, versus, diagnostics, claims = (table_rows(text, heading) for heading in (
        "| policy | seeds |", "| policy | dev invalid", "| difference |", "| arm |", "| claim |"))
    rft = study.LABELS["rft"]  # an arm named for a variant, with no label of the plan's
    assert "| 2 | 100.0 [100.0, 100.0] |" in main["Q-Evolve, λ 0, iter 1"]
    assert "+100.0 [+100.0, +100.0]" in main["Q-Evolve, λ 0, iter 1"] and "+25.0 [" in main[rft]  # Δ BC
    assert invalid["BC"] == "| BC | 12.5 | 4.0 |"  # 1 of each seed's 8 steps (4 a task) rejected
    assert "+75.0 [" in versus[f"Q-Evolve, λ 0, iter 1 minus {rft}"]  # each arm minus the plan's reference
    assert "| 2 | +100.0 |" in claims["Q-Evolve, λ 0 minus BC"] and "| 2 | +75.0 |" in claims[f"Q-Evolve, λ 0 minus {rft}"]
    assert diagnostics["Q-Evolve, λ 0"] == "| Q-Evolve, λ 0 | 0.5 | 0.8 | -0.2 | 0.7 | 0.02 | 0.01 |"
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_a_plan_with_a_mistake_is_refused_in_one_line(tmp_path):
    for plan, message in (('{"seeds": [1], "arms": {"a": {}}, "comparisons": [["a", "b"]]}', "names an arm"),
                          ('{"seeds": [1], "arms": {"a": {}}, "versus": "z"}', "is none of its arms"),
                          ('{"seeds": [1], "arms": {"a": {}}, "colour": "red"}', "colour"),
                          ('{"seeds": [1], "arms": ', "Expecting value")):
        (tmp_path / "plan.json").write_text(plan)
        proc = subprocess.run([sys.executable, "tools/study.py", "--plan", str(tmp_path / "plan.json"),
                               "--out", str(tmp_path / "out"), "--report-only"], cwd=ROOT, capture_output=True,
                              text=True)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_detectable_difference_follows_the_power_formula():
    # 4 seeds of 50 tasks with differences ±20 (SD 20.2 within a seed) and equal seed means: no seed spread
    per_seed = [np.tile([20.0, -20.0], 25) for _ in range(4)]
    sd = per_seed[0].std(ddof=1)
    expected = (1.959964 + 0.841621) * sd / np.sqrt(200)
    assert abs(study.detectable(per_seed) - expected) < 1e-3
    # seeds that differ add their own variance; a stricter level needs a larger difference
    spread = [d + shift for d, shift in zip(per_seed, (-10.0, 0.0, 0.0, 10.0))]
    assert study.detectable(spread) > study.detectable(per_seed) < study.detectable(per_seed, alpha=0.025)
