"""The task lists of the lifespan study (docs/results.md), written to data/tasks/ from ETO's splits (data/eto/)
and ScienceWorld's own variation splits, so that anyone can check how each list was made:

    python tools/tasksets.py            # rewrites data/tasks/lifespan-*.txt (the same files every time)

ScienceWorld has 125 variations of each of the three lifespan families: train 0-61, dev 62-92, test 93-124.
ETO's splits use some of them: its train list holds 83 / 83 / 78 (dev variations among them), its dev list 10 of
each family's dev variations (18 of those 30 also in its train list), its test list the test variations 93-102.

- lifespan-dev.txt      development set (50): ETO's 30 dev tasks and the 20 dev variations in no ETO split.
                        Phase A chooses on these and nothing else.
- lifespan-pool.txt     training pool (226): ETO's train tasks of the families minus every development task.
                        Rollouts draw fresh tasks from it each iteration (collect.py --round).
- lifespan-demos.txt    demonstrations (30): the first 10 tasks of each family in the pool whose expert path fits
                        the default loop's 12-step cap, the families in turn.
- lifespan-confirm.txt  confirmation set (66): the test variations 103-124, in no ETO split, untouched until
                        phase B (primary).
- lifespan-eto-unseen.txt  ETO's 30 test tasks, variations 93-102 (phase B's secondary set).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from envs.sciworld import ETO_DIR, SPLIT_FILES, eto_task_name  # noqa: E402

FAMILIES = ("lifespan-longest-lived", "lifespan-shortest-lived", "lifespan-longest-lived-then-shortest-lived")
OUT = ROOT / "data" / "tasks"
DEMOS_PER_FAMILY, DEMO_CAP = 10, 12


def eto(split: str) -> list[tuple[str, int]]:
    pairs = json.loads((ETO_DIR / SPLIT_FILES[split]).read_text())
    return [(eto_task_name(n), int(v)) for n, v in pairs if eto_task_name(n) in FAMILIES]


def sets(expert_steps) -> dict[str, list[tuple[str, int]]]:
    """Every list, each in a fixed order (family, then variation; the demonstrations' families in turn).
    expert_steps(family, variation): the length of the expert's path, for the demonstrations' cap."""
    train, dev, test = eto("train"), eto("seen"), eto("unseen")
    used = set(train) | set(dev) | set(test)
    sw_dev = [(f, v) for f in FAMILIES for v in range(62, 93)]  # ScienceWorld's dev variations
    development = sorted(set(dev) | {t for t in sw_dev if t not in used}, key=key)
    pool = sorted(set(train) - set(development), key=key)
    demos = {f: [] for f in FAMILIES}
    for f, v in pool:
        if len(demos[f]) < DEMOS_PER_FAMILY and expert_steps(f, v) <= DEMO_CAP:
            demos[f].append((f, v))
    interleaved = [demos[f][k] for k in range(DEMOS_PER_FAMILY) for f in FAMILIES]
    confirm = [(f, v) for f in FAMILIES for v in range(103, 125)]
    assert not set(confirm) & used and not set(development) & set(pool)
    return {"dev": development, "pool": pool, "demos": interleaved, "confirm": confirm,
            "eto-unseen": sorted(test, key=key)}


def key(task: tuple[str, int]) -> tuple[int, int]:
    return FAMILIES.index(task[0]), task[1]


HEADERS = {
    "dev": "development set: ETO's 30 dev tasks of the lifespan families and the 20 ScienceWorld dev variations "
           "(62-92) in no ETO split",
    "pool": "training pool: ETO's train tasks of the lifespan families minus every task of lifespan-dev.txt",
    "demos": f"demonstrations: the first {DEMOS_PER_FAMILY} pool tasks of each family whose expert path fits "
             f"{DEMO_CAP} steps, the families in turn",
    "confirm": "confirmation set: ScienceWorld's test variations 103-124 of the lifespan families, in no ETO split",
    "eto-unseen": "ETO's test tasks of the lifespan families (variations 93-102)",
}


def main() -> None:
    from envs import make_env
    env = make_env("sciworld")

    def expert_steps(family: str, variation: int) -> int:
        env.reset(env.task(family, variation, "train"))
        return env.expert_steps()

    OUT.mkdir(parents=True, exist_ok=True)
    for name, tasks in sets(expert_steps).items():
        path = OUT / f"lifespan-{name}.txt"
        lines = [f"# {HEADERS[name]} ({len(tasks)} tasks; written by tools/tasksets.py from data/eto/, "
                 "which is ETO's release)", *(f"{f}/{v}" for f, v in tasks)]
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path}: {len(tasks)} tasks")
    env.close()


if __name__ == "__main__":
    main()
