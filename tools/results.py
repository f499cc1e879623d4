"""The results of an evolve.sh run as the paper reports them: a table (RUN/results.md) and a plot
(RUN/results.png, like its Figure 3) of BC, Iter 1, Iter 2 ... on seen and unseen tasks (or on the sets that
EVAL_TASKS names).

    python tools/results.py runs/evolve-sciworld 2

Reads RUN/<iter>/eval/<set>.summary.json (collect.py's evaluation summaries) and, for the
environment steps each policy cost to train, RUN/<iter>/collect/self.summary.json; writes the same figures as
TensorBoard curves over the iterations into RUN/loop/.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict:
    if not path.exists():
        sys.exit(f"{path}: missing; has this stage of the run finished?")
    return json.loads(path.read_text())


def parse_settings(text: str) -> dict[str, str]:
    """settings.txt's lines ("NAME   value") as a dict; a value may be empty or hold spaces."""
    return dict((line.split(None, 1) + [""])[:2] for line in text.splitlines() if line.strip())


# ENV_DATA (python -m envs data ENV) as the results say it: the stand-ins are named as such
DATA_NAMES = {"official": "ALFWorld's official games", "generated": "our generated games, not ALFWorld's",
              "real": "the real WebShop", "mini": "our mini shop, not WebShop", "scienceworld": "ScienceWorld"}


def eval_sets(settings: dict[str, str]) -> list[str]:
    """The names of a run's evaluation sets: EVAL_TASKS' (NAME=FILE, or FILE named by its stem), else seen and
    unseen (ETO's splits)."""
    names = [item.split("=", 1)[0] if "=" in item else Path(item).stem
             for item in settings.get("EVAL_TASKS", "").split()]
    return names or ["seen", "unseen"]


def train_env_steps(run: Path, iters: int) -> list[int]:
    """The environment steps the policy of each iteration 0..iters cost to train: the rollouts of iterations
    1..it (sft plays none)."""
    steps, total = [], 0
    for it in range(iters + 1):
        collected = run / str(it) / "collect" / "self.summary.json"
        if it and (collected.exists() or not (run / str(it) / "sft").exists()):
            total += load(collected)["env_steps"]
        steps.append(total)
    return steps


def policy_rows(run: Path, iters: int) -> list[dict]:
    """BC's and each evaluated iteration's evaluation summaries, with the env steps its training cost."""
    settings = parse_settings((run / "settings.txt").read_text())
    rows, names = [], eval_sets(settings)
    for it, train_steps in enumerate(train_env_steps(run, iters)):
        if it not in (0, iters) and not (run / str(it) / "eval").exists():
            continue  # EVAL=last: BC and the last iteration only
        sets = {s: load(run / str(it) / "eval" / f"{s}.summary.json") for s in names}
        name = "BC" if it == 0 else f"Iter {it}"
        first = sets[names[0]]
        if first.get("rerank_with"):  # VARIANT=no_pi: the BC policy, the critic choosing among sampled answers
            name += f" (BC + critic's pick of {first['candidates']})"
        rows.append(dict(iteration=it, name=name, sets=sets, train_steps=train_steps,
                         data=DATA_NAMES.get(settings.get("ENV_DATA", ""), ""),
                         **({"expert": settings["EXPERT"]} if "EXPERT" in settings else {})))
    return rows


def table(rows: list[dict]) -> str:
    """The paper's table of the rows (markdown), with a note on what was measured."""
    names = list(rows[0]["sets"])
    lines = ["| policy | " + " | ".join(f"{s} reward ×100 | {s} success %" for s in names) +
             " | train env steps used |", "|---" * (2 + 2 * len(names)) + "|"]
    for r in rows:
        cells = " | ".join(f"{r['sets'][s]['reward_x100']:.1f} | {100 * r['sets'][s]['success_rate']:.1f}"
                           for s in names)
        lines.append(f"| {r['name']} | {cells} | {r['train_steps']} |")
    sets = rows[0]["sets"]
    counts = " and ".join(f"{sets[s]['episodes']} {s}" for s in names)
    data = f" ({rows[0]['data']})" if rows[0].get("data") else ""
    expert = f"; expert data: {rows[0]['expert'] or 'the planner, template thoughts'}" if "expert" in rows[0] else ""
    note = (f"\n{sets[names[0]]['env']}{data}{expert}: {counts} episodes per policy, greedy (a critic's pick: "
            "among answers sampled at the rollout temperature); reward is the final score averaged over episodes.\n")
    return "\n".join(lines) + "\n" + note


def main(run: Path, iters: int) -> None:
    rows = policy_rows(run, iters)
    first = next(iter(rows[0]["sets"].values()))
    text = table(rows)
    (run / "results.md").write_text(text)
    print(text)
    write_curves(run, rows)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no results.png")
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    x = range(len(rows))
    for ax, metric, label in ((axes[0], "reward_x100", "mean reward ×100"), (axes[1], "success_rate", "success %")):
        for split, marker in zip(rows[0]["sets"], ("o-", "s--", "^:", "d-.")):
            ys = [r["sets"][split][metric] * (100 if metric == "success_rate" else 1) for r in rows]
            ax.plot(x, ys, marker, label=split)
        ax.set_xticks(list(x), [r["name"].split(" (")[0] for r in rows])
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Q-Evolve on {first['env']} ({run.name})")
    fig.tight_layout()
    tmp = run / "results.png.tmp"
    fig.savefig(tmp, format="png", dpi=120)
    tmp.rename(run / "results.png")
    print(f"wrote {run / 'results.md'} and {run / 'results.png'}")


def write_curves(run: Path, rows: list[dict]) -> None:
    """The same figures as TensorBoard curves over the iterations, in RUN/loop/ (rewritten each time), beside
    the stages' own curves: `tensorboard --logdir RUN`."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter
    shutil.rmtree(run / "loop", ignore_errors=True)
    writer = SummaryWriter(str(run / "loop"))
    for r in rows:
        for split, summary in r["sets"].items():
            writer.add_scalar(f"eval/{split}_reward_x100", summary["reward_x100"], r["iteration"])
            writer.add_scalar(f"eval/{split}_success_pct", 100 * summary["success_rate"], r["iteration"])
        writer.add_scalar("charts/train_env_steps", r["train_steps"], r["iteration"])
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print("usage: python tools/results.py RUN ITERS   (an evolve.sh run folder and its number of iterations)")
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    main(Path(sys.argv[1]), int(sys.argv[2]))
