"""Does the loop improve the agent? K seeds of Q-Evolve and its baselines on one task set, every policy evaluated
greedily on every seen and unseen task, reported as mean ± 95 % bootstrap interval and paired against BC.

    python tools/study.py                          # the default: 3 seeds × qevolve, sft, rft, no_pi
    python tools/study.py --seeds 1 --variants qevolve rft
    python tools/study.py --report-only            # the table and plot from the records alone
    STUDY_SMOKE=1 python tools/study.py --out /tmp/study   # the tiny model, two seeds of two variants, minutes
    python tools/study.py --variants qevolve --set BPPO_LR=5e-5 --runs runs/study-lr --out docs/study-lr \
        --share-with runs/study                    # another setting, reusing the default study's BC
    python tools/study.py --plan docs/study-phaseA/plan.json    # a study written down as a plan (below)

Each run is `VARIANT=<v> SEED=<k> bash evolve.sh` with NUM_EVAL=0 (every task of the families) under
runs/study/<arm>-seed<k>/, an arm being a variant (the default study) or a plan's named set of settings. Runs of
one seed share the stages whose commands are the same as an earlier arm's (BC, BC's evaluation, iteration 1's
rollouts and critic): they are linked, not run again. A finished run leaves a small record in
OUT/records/<arm>-seed<k>.json (its settings, per-episode reward, success, steps and invalid actions, env steps,
stage times, the critic's and BPPO's diagnostics; no checkpoints); a rerun skips every run recorded with the same
settings, so a study stopped on one machine goes on on another from a clone of the repository. OUT/results.md and
OUT/results.png are written from the records, and each run still on this machine gets its RUN/report.html with
the study's table (tools/report.py).

A plan (JSON) fixes a study before it runs, for pre-registration:
    {"title": "...", "seeds": [101, 102], "settings": {"DEMO_TASKS": "data/tasks/lifespan-demos.txt", ...},
     "arms": {"rft": {"VARIANT": "rft"}, "lam0": {"VARIANT": "qevolve", "GAE_LAMBDA": "0"}, ...},
     "labels": {"lam0": "Q-Evolve, λ = 0"}, "versus": "rft", "primary": "dev",
     "comparisons": [["lam0", "bc"], ["lam0", "rft"]]}
`settings` go to every run, each arm's on top; `versus`: every arm is also paired against this arm;
`comparisons`: the family of claims, each arm's last policy minus another's (or "bc") on the `primary` set,
reported with a seed-level t interval and Holm-adjusted p-values besides the bootstrap interval.

Interval: a two-level bootstrap (resample seeds, then the episodes of each drawn seed), percentile 95 %.
A paired difference is taken per (seed, task) before resampling, so task difficulty cancels out.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import report as run_report  # noqa: E402
from results import eval_sets, parse_settings, train_env_steps  # noqa: E402
from stage_times import stage_seconds  # noqa: E402

Variant = Literal["qevolve", "sft", "rft", "no_pi", "no_rr", "no_wiql", "no_gae", "awr"]
LABELS = {"qevolve": "Q-Evolve", "sft": "SFT (more BC)", "rft": "RFT (BC on own successes)",
          "no_pi": "w/o PI (BC + critic's pick)", "no_rr": "w/o RR", "no_wiql": "w/o WIQL", "no_gae": "w/o GAE",
          "awr": "AWR instead of BPPO"}
# Every task of the trained families, greedy. Q-Evolve evaluates each iteration (the paper's Figure 3); the
# others BC and their last policy. no_pi's agent is BC with iteration 1's critic choosing among sampled answers
# (the paper's "w/o PI"): its second iteration would collect and evaluate with CANDIDATES answers per step, 5x the
# decoding, for a row the paper reports once.
STUDY = {"NUM_EVAL": "0", "EVAL": "last"}
PER_VARIANT = {"qevolve": {"EVAL": "every"}, "no_pi": {"ITERS": "1"}}
SMOKE = {**STUDY, "SMOKE": "1", "NUM_EVAL": "2", "ITERS": "1"}  # the tiny model: two tasks a split, one iteration


@dataclass
class Args:
    variants: tuple[Variant, ...] = ("qevolve", "sft", "rft", "no_pi")
    """the loop's variants (evolve.sh's VARIANT); qevolve runs first in each seed, the others share its stages"""
    seeds: int = 3
    """seeds 1..K of each variant (evolve.sh's SEED: BC's data order and init, sampling)"""
    out: str = "docs/study"
    """results.md, results.png and records/ (one small JSON per finished run, kept in the repository)"""
    runs: str = "runs/study"
    """the runs' folders (checkpoints, rollouts); may be deleted once recorded"""
    share_with: str | None = None
    """the runs folder of another study whose Q-Evolve runs this one may also share stages with (besides its own);
    e.g. a study of other BPPO settings reuses the default study's BC"""
    set: tuple[str, ...] = ()
    """extra evolve.sh settings for every run, KEY=VALUE (part of the runs' settings, so of their records)"""
    report_only: bool = False
    """write results.md and results.png from the records; run nothing"""
    smoke: bool = os.environ.get("STUDY_SMOKE") == "1"
    """the tiny model on two tasks, one iteration (STUDY_SMOKE=1): the runner end to end in minutes"""
    resamples: int = 10_000
    """bootstrap resamples"""
    plan: Path | None = None
    """a study plan (JSON; see the module's docstring) in place of --variants, --seeds and --set"""


@dataclass
class Plan:
    """What a study runs and how it is analysed: arms × seeds, each arm a set of evolve.sh settings."""
    seeds: list[int]
    arms: dict[str, dict[str, str]]
    settings: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    title: str = ""
    versus: str | None = None
    primary: str | None = None
    comparisons: list[tuple[str, str]] = field(default_factory=list)

    def label(self, arm: str) -> str:
        return "BC" if arm == "bc" else self.labels.get(arm) or LABELS.get(arm, arm)

    def variant(self, arm: str) -> str:
        return self.arms[arm].get("VARIANT", self.settings.get("VARIANT", "qevolve"))


def make_plan(args: Args) -> Plan:
    """The plan of --plan, or the one --variants, --seeds and --set describe (each variant an arm of its name)."""
    if args.plan is None:
        variants = tuple(dict.fromkeys(("qevolve",) + args.variants)) if "qevolve" in args.variants else args.variants
        settings = {}
        for kv in args.set:
            key, sep, value = kv.partition("=")
            if not sep or not key.isupper():
                sys.exit(f"--set {kv!r}: expected an evolve.sh setting as KEY=VALUE")
            settings[key] = value
        return Plan(list(range(1, args.seeds + 1)), {v: {"VARIANT": v} for v in variants}, settings)
    try:
        raw = json.loads(args.plan.read_text())
        plan = Plan(**raw)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        sys.exit(f"--plan {args.plan}: {e}")
    names = set(plan.arms) | {"bc"}
    for a, b in plan.comparisons:
        if a not in names or b not in names:
            sys.exit(f"--plan {args.plan}: comparison {a} − {b} names an arm the plan does not have")
    if plan.versus and plan.versus not in plan.arms:
        sys.exit(f"--plan {args.plan}: versus {plan.versus!r} is none of its arms")
    return plan


# ----------------------------------------------------------------------------- statistics


def bootstrap(per_seed: list[np.ndarray], resamples: int = 10_000, level: float = 0.95,
              rng: np.random.Generator | None = None) -> tuple[float, float, float]:
    """(mean, low, high): the mean of the seeds' mean values and its percentile interval under a two-level
    bootstrap: draw K seeds with replacement, then each drawn seed's episodes with replacement.

    Resampling seeds carries the run-to-run spread (training, sampling) into the interval; resampling episodes
    the spread over tasks. With one seed it is the ordinary bootstrap over episodes."""
    return interval(per_seed, resampled_means(per_seed, resamples, rng or np.random.default_rng(0)), level)


def resampled_means(per_seed: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` means of the two-level bootstrap: K seeds drawn with replacement, then each drawn seed's
    episodes with replacement, the mean of the K slots' means."""
    k = len(per_seed)
    drawn = rng.integers(k, size=(resamples, k))
    slot_means = np.empty((resamples, k))
    for slot in range(k):
        for s, values in enumerate(per_seed):
            rows = np.flatnonzero(drawn[:, slot] == s)
            if rows.size:
                picks = rng.integers(len(values), size=(rows.size, len(values)))
                slot_means[rows, slot] = values[picks].mean(axis=1)
    return slot_means.mean(axis=1)


def interval(per_seed: list[np.ndarray], means: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(mean of the seeds' means, low, high): the percentile interval of resampled means."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(np.mean([v.mean() for v in per_seed])), float(low), float(high)


def paired(a: dict[int, dict], b: dict[int, dict], metric: str) -> list[np.ndarray]:
    """Per seed, a − b on each task both evaluated (a and b: {seed: {task key: outcome}})."""
    diffs = []
    for seed in sorted(set(a) & set(b)):
        keys = sorted(set(a[seed]) & set(b[seed]))
        diffs.append(np.array([a[seed][k][metric] - b[seed][k][metric] for k in keys]))
    return diffs


def values(outcomes: dict[int, dict], metric: str) -> list[np.ndarray]:
    return [np.array([o[metric] for _, o in sorted(outcomes[seed].items())]) for seed in sorted(outcomes)]


# ----------------------------------------------------------------------------- runs and their records


def run_env(arm: str, seed: int, plan: Plan, args: Args) -> dict[str, str]:
    variant = plan.variant(arm)
    env = {**(SMOKE if args.smoke else STUDY), **PER_VARIANT.get(variant, {}), **plan.settings, **plan.arms[arm]}
    run = Path(args.runs).resolve() / f"{arm}-seed{seed}"  # evolve.sh runs in the repository's root
    return {**env, "VARIANT": variant, "SEED": str(seed), "RUN": str(run)}


def dry_run(env: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """evolve.sh's settings (as settings.txt holds them) and its stages as (folder, command), both with the run's
    folder written RUN so that two runs compare."""
    proc = subprocess.run(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, **env, "DRY_RUN": "1"},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"evolve.sh refused the settings {env}:\n{proc.stderr}")
    run = env["RUN"]
    lines = proc.stdout.replace(run, "RUN").splitlines()
    settings = "\n".join(line for line in lines[1:] if not line.startswith(("[dry]", "DRY_RUN")))
    stages = [tuple(line.removeprefix("[dry]").strip().split(": ", 1)) for line in lines if line.startswith("[dry]")]
    return settings, stages


def link_shared(env: dict[str, str], stages: list[tuple[str, str]], bases: list[Path]) -> tuple[Path | None, list[str]]:
    """Link the run's first stages to those of a base run (another arm of the same seed) while their commands are
    the same and the base's are finished: the same command on the same inputs makes the same output (up to
    ScienceWorld's unseeded randomness: one draw of the same distribution, which is all a seed is). Of several
    bases, the one that shares the most. A base's commands are remade from its settings.txt (every setting)."""
    run = Path(env["RUN"])
    best, best_stages = None, []
    for base in bases:
        if not (base / "settings.txt").exists() or base.resolve() == run.resolve():
            continue
        _, base_stages = dry_run({**parse_settings((base / "settings.txt").read_text()), "RUN": str(base)})
        same = []
        for (folder, command), base_stage in zip(stages, base_stages):
            rel = folder.removeprefix("RUN/")
            own = run / rel
            if (folder, command) != base_stage or not (base / rel / ".done").exists() or \
                    (own.exists() and not own.is_symlink()):  # run here before: its own, not shared
                break
            same.append(rel)
        if len(same) > len(best_stages):
            best, best_stages = base, same
    for rel in best_stages:
        link = run / rel
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath((best / rel).resolve(), link.parent.resolve()), target_is_directory=True)
    return best, best_stages


def read_outcomes(path: Path) -> dict[str, dict]:
    """An evaluation file as {task key: {reward ×100, success %, steps, invalid}}; invalid counts the steps whose
    action the environment rejected or that held no action."""
    out = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        out[f"{t['task']}/{t['variation']}"] = {"reward": 100 * t["reward"], "success": 100 * t["success"],
                                                 "steps": len(t["steps"]),
                                                 "invalid": sum(not s["valid"] for s in t["steps"])}
    return out


def diagnostics(run: Path, it: int) -> dict:
    """What the critic and the policy update of iteration `it` did, from their own outputs: V's ranking and fit
    (the critic's eval.json), the process rewards' mean and share below zero over the scored data, and BPPO's
    largest approximate KL to π_old, mean clip fraction and last KL to π_ref."""
    d, out = run / str(it), {}
    if (d / "critic" / "eval.json").exists():
        ev = json.loads((d / "critic" / "eval.json").read_text())
        out["critic"] = {k: ev.get(k) for k in ("return_corr_train", "train_auc_v0", "return_corr_heldout",
                                                "heldout_auc_v0")}
    if (d / "critic" / "scored.jsonl").exists():
        adv = [s["advantage"] for line in (d / "critic" / "scored.jsonl").read_text().splitlines()
               for s in json.loads(line)["steps"]]
        out["advantage"] = {"mean": float(np.mean(adv)), "negative": float(np.mean(np.array(adv) < 0))}
    metrics = d / "bppo" / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        get = lambda key: [r[key] for r in rows if key in r]  # noqa: E731
        if get("approx_kl"):
            out["bppo"] = {"steps": len(get("approx_kl")), "max_approx_kl": max(get("approx_kl")),
                           "mean_clip_frac": float(np.mean(get("clip_frac"))), "last_kl_ref": get("kl_ref")[-1]}
    return out


def make_record(arm: str, variant: str, seed: int, env: dict, settings: str, shared: list[str],
                minutes: float) -> dict:
    run = Path(env["RUN"])
    parsed = parse_settings(settings)
    iters, sets = int(parsed["ITERS"]), eval_sets(parsed)
    policies = []
    for it, train_steps in enumerate(train_env_steps(run, iters)):
        if (run / str(it) / "eval").is_dir():
            policies.append({"iteration": it, "train_env_steps": train_steps, "diagnostics": diagnostics(run, it),
                             **{s: read_outcomes(run / str(it) / "eval" / f"{s}.jsonl") for s in sets}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"arm": arm, "variant": variant, "seed": seed, "settings": settings, "sets": sets,
            "shared_stages": shared,
            "stage_seconds": {f"{it}/{kind}": s for (it, kind), s in sorted(stage_seconds(run).items())},
            "minutes": round(minutes, 1), "commit": commit.stdout.strip() or None,
            "machine": machine(), "policies": policies}


def machine() -> str:
    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def run_one(arm: str, variant: str, seed: int, env: dict, bases: list[Path], settings: str, stages: list) -> dict:
    run = Path(env["RUN"])
    run.mkdir(parents=True, exist_ok=True)
    base, shared = link_shared(env, stages, bases)
    if shared:
        print(f"  shares with {base}: {', '.join(shared)}", flush=True)
    start = time.time()
    with open(run / "evolve.log", "a") as log:  # the stages' own output; the stage lines also go to the screen
        proc = subprocess.Popen(["bash", "evolve.sh"], cwd=ROOT, env={**os.environ, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith(("[run]", "[done]")):
                print(f"  {time.strftime('%H:%M')} {line.split(':')[0].strip()}", flush=True)
        if proc.wait() != 0:
            sys.exit(f"{arm} seed {seed} failed (exit {proc.returncode}); see {run / 'evolve.log'}. "
                     "Run the study again to resume it.")
    return make_record(arm, variant, seed, env, settings, shared, (time.time() - start) / 60)


def same_settings(recorded: str, current: str, env: dict[str, str]) -> bool:
    """Whether a record holds the run these settings would make. A setting evolve.sh gained after the record was
    written counts as at its default (a new setting must keep the old behaviour by default), unless the study
    sets it."""
    old, new = parse_settings(recorded), parse_settings(current)
    return all(new.get(k) == v for k, v in old.items()) and not any(k in env for k in new.keys() - old.keys())


def changed_settings(recorded: str, current: str) -> list[str]:
    old, new = parse_settings(recorded), parse_settings(current)
    return [f"{k} {old.get(k, '(none)')!r} → {new.get(k, '(none)')!r}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ----------------------------------------------------------------------------- report


def gather(records: dict[tuple[str, int], dict], arm: str, iteration: int) -> dict[str, dict]:
    """{set: {seed: outcomes}, "steps": {seed: train env steps}} of the arm's policy after `iteration`, one per
    seed. "bc" takes iteration 0 of each seed's first arm's record (the one the others share BC with); an arm's
    own iteration 0 is the BC its runs started from (their own where they could not share another arm's)."""
    row = {"steps": {}}
    for (a, seed), rec in records.items():  # in the plan's order
        p = next((p for p in rec["policies"] if p["iteration"] == iteration), None)
        if (a == arm or arm == "bc") and p and seed not in row["steps"]:
            for s in record_sets(rec):
                row.setdefault(s, {})[seed] = p[s]
            row["steps"][seed] = p["train_env_steps"]
    return row


def record_sets(rec: dict) -> list[str]:
    return rec.get("sets", ["seen", "unseen"])  # records written before EVAL_TASKS: ETO's splits


def policy_rows(records: dict[tuple[str, int], dict], plan: Plan) -> list[tuple[str, str, dict]]:
    """(arm, name, gather's outcomes): BC once (each seed's own), then each arm's evaluated iterations (Q-Evolve's
    every iteration where it evaluated them, the paper's Figure 3)."""
    rows = [("bc", "BC", gather(records, "bc", 0))]
    for arm in plan.arms:
        iters = sorted({p["iteration"] for (a, _), r in records.items() if a == arm for p in r["policies"]} - {0})
        for it in iters:
            name = plan.label(arm) + (f", iter {it}" if len(iters) > 1 or plan.variant(arm) == "qevolve" else "")
            rows.append((arm, name, gather(records, arm, it)))
    return [r for r in rows if r[2]["steps"]]


def fmt(mean: float, low: float, high: float, sign: bool = False) -> str:
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]" if sign else f"{mean:.1f} [{low:.1f}, {high:.1f}]"


def seed_t(per_seed: list[np.ndarray], level: float = 0.95) -> tuple[float, float, float, float]:
    """(mean, low, high, two-sided p against 0) of a seed-level t interval: one value per seed (its mean paired
    difference), K − 1 degrees of freedom; NaN bounds with fewer than 2 seeds."""
    from scipy import stats
    means = np.array([d.mean() for d in per_seed])
    k, mean = len(means), float(means.mean())
    if k < 2:
        return mean, float("nan"), float("nan"), float("nan")
    se = means.std(ddof=1) / np.sqrt(k)
    if se == 0:
        return mean, mean, mean, 0.0 if mean else 1.0
    half = float(stats.t.ppf(0.5 + level / 2, k - 1) * se)
    return mean, mean - half, mean + half, float(2 * stats.t.sf(abs(mean / se), k - 1))


def bootstrap_p(means: np.ndarray) -> float:
    """Two-sided bootstrap p against 0 from resampled means: twice the smaller share on either side of 0 (the
    smallest α at which the percentile interval at 1 − α excludes 0)."""
    return float(min(1.0, 2 * min((means <= 0).mean(), (means >= 0).mean())))


def detectable(per_seed: list[np.ndarray], alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference this design (its seeds and tasks) detects with the given power by a
    two-sided test at level alpha, from the spread it measured: the tasks' SD within a seed (pooled) and the
    seeds' own SD beyond what their tasks explain. (z_{1−α/2} + z_power) · √(σ_task²/(K·N) + σ_seed²/K)."""
    from scipy import stats
    k, n = len(per_seed), np.mean([len(d) for d in per_seed])
    var_task = np.mean([d.var(ddof=1) for d in per_seed if len(d) > 1])
    means = np.array([d.mean() for d in per_seed])
    var_seed = max(0.0, means.var(ddof=1) - var_task / n) if k > 1 else 0.0
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return float(z * np.sqrt(var_task / (k * n) + var_seed / k))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: the k-th smallest of m is multiplied by m − k + 1,
    then made non-decreasing; a claim holds at family-wise level α when its adjusted p ≤ α."""
    m, order = len(pvalues), np.argsort(pvalues)
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def report(records: dict[tuple[str, int], dict], plan: Plan, out: Path, resamples: int, smoke: bool) -> str:
    rows = policy_rows(records, plan)
    sets = next(record_sets(r) for r in records.values())
    bc = rows[0][2]
    rng = np.random.default_rng(0)
    stats = []
    for arm, name, outcomes in rows:
        r = {"arm": arm, "name": name, "seeds": len(outcomes["steps"])}
        own_bc = gather(records, arm, 0)  # a run is measured against the BC it started from
        for s in sets:
            r[s] = {m: bootstrap(values(outcomes[s], m), resamples, rng=rng) for m in ("reward", "success")}
            r[s]["delta"] = (bootstrap(paired(outcomes[s], {**bc[s], **own_bc.get(s, {})}, "reward"), resamples,
                                       rng=rng) if arm != "bc" else None)
            r[s]["episodes"] = sum(len(o) for o in outcomes[s].values())
            episodes = [o for seed in outcomes[s].values() for o in seed.values()]
            steps = sum(o.get("steps", 0) for o in episodes)
            counted = all("steps" in o for o in episodes)  # (every record this study writes counts both)
            r[s]["invalid"] = (100 * sum(o["invalid"] for o in episodes) / max(steps, 1)
                               if counted and all("invalid" in o for o in episodes) else None)
            r[s]["mean_steps"] = steps / max(len(episodes), 1) if counted else None
        r["train_env_steps"] = round(float(np.mean(list(outcomes["steps"].values()))))
        stats.append(r)

    title = plan.title or f"Study: {', '.join(plan.arms)} over seeds"
    lines = [f"# {title}", "",
             "Reward ×100 and success % on every task of each evaluation set, greedy: mean over seeds [95 % "
             "interval, two-level bootstrap over seeds and episodes]. Δ BC: the paired difference in reward ×100 to "
             "the BC policy of the same seed, task by task.", "",
             "| policy | seeds | " + " | ".join(f"{s} reward ×100 | {s} success %" for s in sets) + " | " +
             " | ".join(f"Δ BC {s}" for s in sets) + " | train env steps |", "|---" * (3 + 3 * len(sets)) + "|"]
    for r in stats:
        cells = " | ".join(f"{fmt(*r[s]['reward'])} | {fmt(*r[s]['success'])}" for s in sets)
        delta = " | ".join(fmt(*r[s]["delta"], sign=True) if r[s]["delta"] else "" for s in sets)
        lines.append(f"| {r['name']} | {r['seeds']} | {cells} | {delta} | {r['train_env_steps']} |")
    kinds = [("invalid", "invalid %"), ("mean_steps", "steps")]
    if all(r[s]["invalid"] is None for r in stats for s in sets):
        kinds = kinds[1:]  # records written before invalid actions were counted
    lines += ["", "Invalid actions (% of the evaluation's steps: rejected by the environment or no action) and "
              "steps per episode:" if len(kinds) == 2 else "Steps per episode:", "",
              "| policy | " + " | ".join(f"{s} {label}" for s in sets for _, label in kinds) + " |",
              "|---" * (1 + len(kinds) * len(sets)) + "|"]
    for r in stats:
        lines.append(f"| {r['name']} | " + " | ".join("" if r[s][k] is None else f"{r[s][k]:.1f}"
                                                     for s in sets for k, _ in kinds) + " |")
    # each arm's last policy against the reference: the plan's versus, else (the default study) Q-Evolve's
    last = {arm: (arm, name, o) for arm, name, o in rows}  # the last row of each arm is its last policy
    ref = plan.versus or ("qevolve" if "qevolve" in last else None)
    if ref in last and len(last) > 2:
        pairs = [(a, ref) for a in last if a not in ("bc", ref)] if plan.versus else \
            [(ref, a) for a in last if a not in ("bc", ref)]
        lines += ["", f"Last policies paired by seed and task (reward ×100):", "",
                  "| difference | " + " | ".join(sets) + " |", "|---" * (1 + len(sets)) + "|"]
        for a, b in pairs:
            cells = [fmt(*bootstrap(paired(last[a][2][s], last[b][2][s], "reward"), resamples, rng=rng), sign=True)
                     for s in sets]
            lines.append(f"| {last[a][1]} minus {last[b][1]} | " + " | ".join(cells) + " |")
    lines += diagnostics_table(records, plan)
    if plan.comparisons:
        lines += comparisons_table(records, plan, last, bc, sets, resamples, rng)
    n = " and ".join(f"{max(len(o) for o in bc[s].values())} {s}" for s in sets)
    minutes = ", ".join(f"{arm} {np.mean([own_minutes(rec) for (a, _), rec in records.items() if a == arm]):.0f}"
                        for arm in plan.arms if any(a == arm for a, _ in records))
    lines += ["", f"{n} tasks per policy and seed; minutes per run (its own stages, shared ones not counted): "
              f"{minutes}" + (" (STUDY_SMOKE: the tiny model, not a result)" if smoke else "") + "."]
    text = "\n".join(lines) + "\n"
    write_atomic(out / "results.md", text)
    plot(stats, sets, out / "results.png")
    return text


def diagnostics_table(records: dict[tuple[str, int], dict], plan: Plan) -> list[str]:
    """Per arm with a critic or BPPO, means over seeds and iterations of what they did (records' diagnostics)."""
    rows = []
    for arm in plan.arms:
        diags = [p.get("diagnostics", {}) for (a, _), r in records.items() if a == arm for p in r["policies"]
                 if p["iteration"] > 0]
        pick = lambda part, key: [d[part][key] for d in diags if d.get(part, {}).get(key) is not None]  # noqa: E731
        cells = [pick("critic", "return_corr_train"), pick("critic", "train_auc_v0"), pick("advantage", "mean"),
                 pick("advantage", "negative"), pick("bppo", "max_approx_kl"), pick("bppo", "mean_clip_frac")]
        if any(cells):
            rows.append(f"| {plan.label(arm)} | " + " | ".join(f"{np.mean(c):.3g}" if c else "" for c in cells) + " |")
    if not rows:
        return []
    return ["", "What the critic and the update did (means over seeds and iterations): V's correlation with the "
            "return and V₀'s AUC (successes above failures) on the critic's training data; the process rewards' "
            "mean and share below 0; BPPO's largest approximate KL to π_old and mean clip fraction:", "",
            "| arm | return corr | AUC V₀ | mean advantage | advantages < 0 | max approx-KL | clip fraction |",
            "|---|---|---|---|---|---|---|", *rows]


def comparisons_table(records, plan: Plan, last: dict, bc: dict, sets: list[str], resamples: int,
                      rng: np.random.Generator) -> list[str]:
    """The plan's family of claims on its primary set: each difference with its two-level bootstrap interval,
    a seed-level t interval, and the p-values of both, Holm-adjusted over the family."""
    primary = plan.primary or sets[0]
    diffs = []
    for a, b in plan.comparisons:
        ours = last[a][2][primary] if a in last else {}
        theirs = bc[primary] if b == "bc" else (last[b][2][primary] if b in last else {})
        diffs.append(paired(ours, theirs, "reward"))
    usable = [d for d in diffs if d]
    if len(usable) < len(diffs):
        return ["", "The comparisons wait for every arm's records."]
    means = [resampled_means(d, resamples, rng) for d in diffs]  # one resampling gives interval and p
    boot = [interval(d, m) for d, m in zip(diffs, means)]
    t = [seed_t(d) for d in diffs]
    p_boot = holm([bootstrap_p(m) for m in means])
    p_t = holm([x[3] for x in t])
    m = len(diffs)
    lines = ["", f"The claims, on the {primary} set (reward ×100, paired by seed and task; Holm over the "
             f"{m} comparisons). Detectable: the smallest true difference this design finds with 80 % power at "
             f"level 0.05 / {m} (Holm's first step), from the spread it measured:", "",
             "| claim | seeds | mean | 95 % bootstrap | 95 % seed-level t | Holm p (bootstrap) | Holm p (t) "
             "| detectable |", "|---|---|---|---|---|---|---|---|"]
    for (a, b), d, bo, tt, pb, pt in zip(plan.comparisons, diffs, boot, t, p_boot, p_t):
        lines.append(f"| {plan.label(a)} minus {plan.label(b)} | {len(d)} | {bo[0]:+.1f} | [{bo[1]:+.1f}, "
                     f"{bo[2]:+.1f}] | [{tt[1]:+.1f}, {tt[2]:+.1f}] | {pb:.3f} | {pt:.3f} "
                     f"| {detectable(d, 0.05 / m):.1f} |")
    return lines


def own_minutes(rec: dict) -> float:
    shared = set(rec["shared_stages"])
    return sum(s for k, s in rec["stage_seconds"].items() if k not in shared and s == s) / 60


def plot(stats: list[dict], sets: list[str], path: Path) -> None:
    """Each set's reward and success with their intervals, and the paired difference to BC that the claims rest on."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(sets)
    fig, axes = plt.subplots(1, n + 1, figsize=(5 * n + 4, 4), gridspec_kw={"width_ratios": [1] * n + [0.9]})
    x = np.arange(len(stats))
    names = [r["name"].split(" (")[0].replace(", ", "\n") for r in stats]  # "RFT (BC on own successes)" → "RFT"

    def points(ax, xs, triples, fmt, label):
        means = np.array([t[0] for t in triples])
        err = np.array([[m - t[1], t[2] - m] for m, t in zip(means, triples)]).T
        ax.errorbar(xs, means, yerr=err, fmt=fmt, capsize=3, label=label)

    for ax, split in zip(axes, sets):
        for k, (metric, fmt, label) in enumerate((("reward", "o", "reward ×100"), ("success", "s", "success %"))):
            points(ax, x + (k - 0.5) * 0.2, [r[split][metric] for r in stats], fmt, label)
        ax.axhline(stats[0][split]["reward"][0], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{split} tasks")
        if ax is not axes[0]:
            ax.sharey(axes[0])
    axes[0].set_ylabel("mean over seeds, 95 % interval")
    ax = axes[-1]
    for k, (split, fmt) in enumerate(zip(sets, ("o", "s", "^", "d"))):
        points(ax, x[1:] + (k - 0.5) * 0.2, [r[split]["delta"] for r in stats[1:]], fmt, split)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title("reward ×100 minus BC's, paired by task")
    for ax, start in zip(axes, [0] * n + [1]):
        ax.set_xticks(x[start:], names[start:], fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    tmp.replace(path)


# ----------------------------------------------------------------------------- the study


def main() -> None:
    args = tyro.cli(Args)
    plan = make_plan(args)
    out, records_dir = Path(args.out), Path(args.out) / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    todo = [(arm, seed) for seed in plan.seeds for arm in plan.arms]
    records = {}
    for n, (arm, seed) in enumerate(todo, 1):
        env = run_env(arm, seed, plan, args)
        settings, stages = dry_run(env)
        path = records_dir / f"{arm}-seed{seed}.json"
        if path.exists():
            rec = json.loads(path.read_text())
            if same_settings(rec["settings"], settings, env):
                print(f"[study {n}/{len(todo)}] {arm} seed {seed}: recorded in {path}")
                records[arm, seed] = rec
                continue
            changed = ", ".join(changed_settings(rec["settings"], settings))
            sys.exit(f"{path} records a run with other settings than this study's ({changed}): "
                     "give another study its own --out and --runs, or delete the record to run it again")
        if args.report_only:
            continue
        print(f"[study {n}/{len(todo)}] {arm} seed {seed}: running in {env['RUN']} "
              f"(log: {env['RUN']}/evolve.log)", flush=True)
        # the arms of this seed run before it, here or in --share-with's runs: the stages it may share
        bases = [Path(d).resolve() / f"{a}-seed{seed}" for d in (args.runs, args.share_with) if d for a in plan.arms]
        bases += [Path(args.share_with).resolve() / f"qevolve-seed{seed}"] if args.share_with else []
        rec = run_one(arm, plan.variant(arm), seed, env, bases, settings, stages)
        write_atomic(path, json.dumps(rec, indent=1) + "\n")
        records[arm, seed] = rec
        print(f"[study {n}/{len(todo)}] {arm} seed {seed}: done in {rec['minutes']:.0f} min, recorded in {path}",
              flush=True)
    if not records:
        sys.exit(f"no records in {records_dir}: nothing to report")
    records = {k: records[k] for k in sorted(records, key=lambda k: (list(plan.arms).index(k[0]), k[1]))}
    print(report(records, plan, out, args.resamples, args.smoke))
    print(f"wrote {out / 'results.md'} and {out / 'results.png'}")
    # the runs still on this machine: their pages (evolve.sh wrote them without the study) get its intervals
    for arm, seed in records:
        run = Path(run_env(arm, seed, plan, args)["RUN"])
        if (run / "settings.txt").exists():
            run_report.main(run_report.Args(run, study=out))


if __name__ == "__main__":
    main()
