"""Does the loop improve the agent? K seeds of Q-Evolve and its baselines on one task set, every policy evaluated
greedily on every seen and unseen task, reported as mean ± 95 % bootstrap interval and paired against BC.

    python tools/study.py                          # the default: 3 seeds × qevolve, sft, rft, no_pi
    python tools/study.py --seeds 1 --variants qevolve rft
    python tools/study.py --report-only            # the table and plot from the records alone
    STUDY_SMOKE=1 python tools/study.py --out /tmp/study   # the tiny model, two seeds of two variants, minutes
    python tools/study.py --variants qevolve --set BPPO_LR=5e-5 --runs runs/study-lr --out docs/study-lr \
        --share-with runs/study                    # another setting, reusing the default study's BC

Each run is `VARIANT=<v> SEED=<k> bash evolve.sh` with NUM_EVAL=0 (every task of the families) under
runs/study/<v>-seed<k>/. Runs of one seed share the stages whose commands are the same as Q-Evolve's (its BC, BC's
evaluation, iteration 1's rollouts and critic): they are linked, not run again. A finished run leaves a small
record in OUT/records/<v>-seed<k>.json (its settings, per-episode outcomes, env steps, stage times; no
checkpoints); a rerun skips every run recorded with the same settings, so a study stopped on one machine goes on
on another from a clone of the repository. OUT/results.md and OUT/results.png are written from the records, and
each run still on this machine gets its RUN/report.html with the study's table (tools/report.py).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import report as run_report  # noqa: E402
from results import parse_settings, train_env_steps  # noqa: E402
from stage_times import stage_seconds  # noqa: E402

Variant = Literal["qevolve", "sft", "rft", "no_pi", "no_rr", "no_wiql", "no_gae", "awr"]
LABELS = {"qevolve": "Q-Evolve", "sft": "SFT (more BC)", "rft": "RFT (BC on own successes)",
          "no_pi": "w/o PI (BC + critic's pick)", "no_rr": "w/o RR", "no_wiql": "w/o WIQL", "no_gae": "w/o GAE",
          "awr": "AWR instead of BPPO"}
SPLITS = ("seen", "unseen")
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


# ----------------------------------------------------------------------------- statistics


def bootstrap(per_seed: list[np.ndarray], resamples: int = 10_000, level: float = 0.95,
              rng: np.random.Generator | None = None) -> tuple[float, float, float]:
    """(mean, low, high): the mean of the seeds' mean values and its percentile interval under a two-level
    bootstrap: draw K seeds with replacement, then each drawn seed's episodes with replacement.

    Resampling seeds carries the run-to-run spread (training, sampling) into the interval; resampling episodes
    the spread over tasks. With one seed it is the ordinary bootstrap over episodes."""
    rng = rng or np.random.default_rng(0)
    k = len(per_seed)
    drawn = rng.integers(k, size=(resamples, k))
    slot_means = np.empty((resamples, k))
    for slot in range(k):
        for s, values in enumerate(per_seed):
            rows = np.flatnonzero(drawn[:, slot] == s)
            if rows.size:
                picks = rng.integers(len(values), size=(rows.size, len(values)))
                slot_means[rows, slot] = values[picks].mean(axis=1)
    means = slot_means.mean(axis=1)
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


def run_env(variant: str, seed: int, args: Args) -> dict[str, str]:
    env = {**(SMOKE if args.smoke else STUDY), **PER_VARIANT.get(variant, {})}
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep or not key.isupper():
            sys.exit(f"--set {kv!r}: expected an evolve.sh setting as KEY=VALUE")
        env[key] = value
    run = Path(args.runs).resolve() / f"{variant}-seed{seed}"  # evolve.sh runs in the repository's root
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
    """Link the run's first stages to those of a base run (Q-Evolve of the same seed) while their commands are the
    same and the base's are finished: the same command on the same inputs makes the same output (up to
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
    """An evaluation file as {task key: {reward ×100, success %, steps}}."""
    out = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        out[f"{t['task']}/{t['variation']}"] = {"reward": 100 * t["reward"], "success": 100 * t["success"],
                                                 "steps": len(t["steps"])}
    return out


def make_record(variant: str, seed: int, env: dict, settings: str, shared: list[str], minutes: float) -> dict:
    run = Path(env["RUN"])
    iters = int(parse_settings(settings)["ITERS"])
    policies = []
    for it, train_steps in enumerate(train_env_steps(run, iters)):
        if (run / str(it) / "eval").is_dir():
            policies.append({"iteration": it, "train_env_steps": train_steps,
                             **{s: read_outcomes(run / str(it) / "eval" / f"{s}.jsonl") for s in SPLITS}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"variant": variant, "seed": seed, "settings": settings, "shared_stages": shared,
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


def run_one(variant: str, seed: int, env: dict, bases: list[Path], settings: str, stages: list) -> dict:
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
            sys.exit(f"{variant} seed {seed} failed (exit {proc.returncode}); see {run / 'evolve.log'}. "
                     "Run the study again to resume it.")
    return make_record(variant, seed, env, settings, shared, (time.time() - start) / 60)


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


def gather(records: dict[tuple[str, int], dict], variant: str, iteration: int) -> dict[str, dict]:
    """{split: {seed: outcomes}, "steps": {seed: train env steps}} of the variant's policy after `iteration`, one per
    seed. "bc" takes iteration 0 of each seed's Q-Evolve record, else of any run of that seed; a variant's own
    iteration 0 is the BC its runs started from (their own where they could not share Q-Evolve's)."""
    row = {s: {} for s in (*SPLITS, "steps")}
    prefer = "qevolve" if variant == "bc" else variant
    for (v, seed), rec in sorted(records.items(), key=lambda kv: (kv[0][0] != prefer, kv[0][1])):
        p = next((p for p in rec["policies"] if p["iteration"] == iteration), None)
        if (v == variant or variant == "bc") and p and seed not in row["steps"]:
            for s in SPLITS:
                row[s][seed] = p[s]
            row["steps"][seed] = p["train_env_steps"]
    return row


def policy_rows(records: dict[tuple[str, int], dict], variants: tuple[str, ...]) -> list[tuple[str, str, dict]]:
    """(variant, name, gather's outcomes): BC once (each seed's own), then Q-Evolve's iterations, then each other
    variant's last policy."""
    rows = [("bc", "BC", gather(records, "bc", 0))]
    for variant in variants:
        iters = sorted({p["iteration"] for (v, _), r in records.items() if v == variant for p in r["policies"]} - {0})
        for it in iters if variant == "qevolve" else iters[-1:]:
            name = f"{LABELS[variant]}, iter {it}" if variant == "qevolve" else LABELS[variant]
            rows.append((variant, name, gather(records, variant, it)))
    return [r for r in rows if r[2]["seen"]]


def fmt(mean: float, low: float, high: float, sign: bool = False) -> str:
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]" if sign else f"{mean:.1f} [{low:.1f}, {high:.1f}]"


def report(records: dict[tuple[str, int], dict], variants: tuple[str, ...], out: Path, resamples: int,
           smoke: bool) -> str:
    rows = policy_rows(records, variants)
    bc = rows[0][2]
    rng = np.random.default_rng(0)
    stats = []
    for variant, name, outcomes in rows:
        r = {"variant": variant, "name": name, "seeds": len(outcomes["seen"])}
        own_bc = gather(records, variant, 0)  # a run is measured against the BC it started from
        for s in SPLITS:
            r[s] = {m: bootstrap(values(outcomes[s], m), resamples, rng=rng) for m in ("reward", "success")}
            r[s]["delta"] = (bootstrap(paired(outcomes[s], {**bc[s], **own_bc[s]}, "reward"), resamples, rng=rng)
                             if variant != "bc" else None)
            r[s]["episodes"] = sum(len(o) for o in outcomes[s].values())
        r["train_env_steps"] = round(float(np.mean(list(outcomes["steps"].values()))))
        stats.append(r)

    lines = [f"# Study: {', '.join(variants)} over seeds", "",
             "Reward ×100 and success % on every seen and unseen task, greedy: mean over seeds [95 % interval, "
             "two-level bootstrap over seeds and episodes]. Δ BC: the paired difference in reward ×100 to the BC "
             "policy of the same seed, task by task.", "",
             "| policy | seeds | seen reward ×100 | seen success % | unseen reward ×100 | unseen success % "
             "| Δ BC seen | Δ BC unseen | train env steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in stats:
        delta = [fmt(*r[s]["delta"], sign=True) if r[s]["delta"] else "" for s in SPLITS]
        lines.append(f"| {r['name']} | {r['seeds']} | {fmt(*r['seen']['reward'])} | {fmt(*r['seen']['success'])} "
                     f"| {fmt(*r['unseen']['reward'])} | {fmt(*r['unseen']['success'])} | {delta[0]} | {delta[1]} "
                     f"| {r['train_env_steps']} |")
    last = next((row for row in reversed(rows) if row[0] == "qevolve"), None)
    others = [row for row in rows if row[0] not in ("bc", "qevolve")]
    if last and others:
        lines += ["", "Q-Evolve's last policy minus each baseline, paired by seed and task (reward ×100):", "",
                  "| Q-Evolve minus | seen | unseen |", "|---|---|---|"]
        for _, name, outcomes in others:
            cells = [fmt(*bootstrap(paired(last[2][s], outcomes[s], "reward"), resamples, rng=rng), sign=True)
                     for s in SPLITS]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    n_seen, n_unseen = (max(len(o) for o in bc[s].values()) for s in SPLITS)
    lines += ["", f"{n_seen} seen and {n_unseen} unseen tasks per policy and seed; "
              f"minutes per run (its own stages, shared ones not counted): " + ", ".join(
                  f"{v} {np.mean([own_minutes(rec) for (vv, _), rec in records.items() if vv == v]):.0f}"
                  for v in variants if any(vv == v for vv, _ in records)) +
              (" (STUDY_SMOKE: the tiny model, not a result)" if smoke else "") + "."]
    text = "\n".join(lines) + "\n"
    write_atomic(out / "results.md", text)
    plot(stats, out / "results.png")
    return text


def own_minutes(rec: dict) -> float:
    shared = set(rec["shared_stages"])
    return sum(s for k, s in rec["stage_seconds"].items() if k not in shared and s == s) / 60


def plot(stats: list[dict], path: Path) -> None:
    """Each split's reward and success with their intervals, and the paired difference to BC that the claims rest on."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [1, 1, 0.9]})
    x = np.arange(len(stats))
    names = [r["name"].split(" (")[0].replace(", ", "\n") for r in stats]  # "RFT (BC on own successes)" → "RFT"

    def points(ax, xs, triples, fmt, label):
        means = np.array([t[0] for t in triples])
        err = np.array([[m - t[1], t[2] - m] for m, t in zip(means, triples)]).T
        ax.errorbar(xs, means, yerr=err, fmt=fmt, capsize=3, label=label)

    for ax, split in zip(axes, SPLITS):
        for k, (metric, fmt, label) in enumerate((("reward", "o", "reward ×100"), ("success", "s", "success %"))):
            points(ax, x + (k - 0.5) * 0.2, [r[split][metric] for r in stats], fmt, label)
        ax.axhline(stats[0][split]["reward"][0], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{split} tasks")
    axes[1].sharey(axes[0])
    axes[0].set_ylabel("mean over seeds, 95 % interval")
    ax = axes[2]
    for k, (split, fmt) in enumerate(zip(SPLITS, ("o", "s"))):
        points(ax, x[1:] + (k - 0.5) * 0.2, [r[split]["delta"] for r in stats[1:]], fmt, split)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title("reward ×100 minus BC's, paired by task")
    for ax, start in zip(axes, (0, 0, 1)):
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
    variants = tuple(dict.fromkeys(("qevolve",) + args.variants)) if "qevolve" in args.variants else args.variants
    out, records_dir = Path(args.out), Path(args.out) / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    plan = [(v, seed) for seed in range(1, args.seeds + 1) for v in variants]
    records = {}
    for n, (variant, seed) in enumerate(plan, 1):
        env = run_env(variant, seed, args)
        settings, stages = dry_run(env)
        path = records_dir / f"{variant}-seed{seed}.json"
        if path.exists():
            rec = json.loads(path.read_text())
            if same_settings(rec["settings"], settings, env):
                print(f"[study {n}/{len(plan)}] {variant} seed {seed}: recorded in {path}")
                records[variant, seed] = rec
                continue
            changed = ", ".join(changed_settings(rec["settings"], settings))
            sys.exit(f"{path} records a run with other settings than this study's ({changed}): "
                     "give another study its own --out and --runs, or delete the record to run it again")
        if args.report_only:
            continue
        print(f"[study {n}/{len(plan)}] {variant} seed {seed}: running in {env['RUN']} "
              f"(log: {env['RUN']}/evolve.log)", flush=True)
        bases = [Path(d).resolve() / f"qevolve-seed{seed}" for d in (args.runs, args.share_with) if d]
        rec = run_one(variant, seed, env, bases, settings, stages)
        write_atomic(path, json.dumps(rec, indent=1) + "\n")
        records[variant, seed] = rec
        print(f"[study {n}/{len(plan)}] {variant} seed {seed}: done in {rec['minutes']:.0f} min, recorded in {path}",
              flush=True)
    if not records:
        sys.exit(f"no records in {records_dir}: nothing to report")
    print(report(records, variants, out, args.resamples, args.smoke))
    print(f"wrote {out / 'results.md'} and {out / 'results.png'}")
    # the runs still on this machine: their pages (evolve.sh wrote them without the study) get its intervals
    for variant, seed in records:
        run = Path(run_env(variant, seed, args)["RUN"])
        if (run / "settings.txt").exists():
            run_report.main(run_report.Args(run, study=out))


if __name__ == "__main__":
    main()
