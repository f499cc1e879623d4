"""How large tools/report.py's page gets and how it responds at a 7B run's size: N trajectories of S steps, made
by repeating a real run's scored trajectories (new ids, steps cycled up to S), opened in headless Chromium.

    python bench/report_scale.py runs/evolve-sciworld                     # 5,000 trajectories of 20 steps
    python bench/report_scale.py RUN --trajectories 500 --steps 10

Prints the page's size against the scored JSONL it shows, the time to write it, and in the browser the time
from navigation to the first page of trajectories drawn, to the next page, to a filter and to another dataset.
"""
from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tools"), str(ROOT)]
import report  # noqa: E402
from common import read_jsonl  # noqa: E402
from browser import Browser  # noqa: E402

READY = "document.body.dataset.ready === '1'"


@dataclass
class Args:
    run: tyro.conf.Positional[Path]
    """a finished evolve.sh run whose iteration 1 has critic/scored.jsonl (its trajectories are repeated)"""
    trajectories: int = 5000
    steps: int = 20
    """steps per trajectory: each source trajectory's steps repeated up to this many"""
    seed: int = 0


def synthetic_run(source: Path, folder: Path, n: int, steps: int, seed: int) -> Path:
    """A run folder with one iteration whose scored data holds n trajectories of `steps` steps each."""
    rng = random.Random(seed)
    trajs = read_jsonl(source / "1" / "critic" / "scored.jsonl")
    (folder / "1" / "critic").mkdir(parents=True)
    settings = (source / "settings.txt").read_text().splitlines()
    (folder / "settings.txt").write_text("\n".join("ITERS          1" if line.startswith("ITERS ") else line
                                                   for line in settings) + "\n")
    (folder / "1" / "critic" / "args.json").write_text((source / "1" / "critic" / "args.json").read_text())
    with open(folder / "1" / "critic" / "scored.jsonl", "w") as f:
        for i in range(n):
            t = rng.choice(trajs)
            cycled = [dict(t["steps"][j % len(t["steps"])]) for j in range(steps)]
            for s in cycled:  # values of their own, so the plots and colours are not a few repeated points
                s["value"], s["q"], s["advantage"] = (s["value"] + rng.gauss(0, 0.1), s.get("q", 0.0) + rng.gauss(0, 0.1),
                                                      s["advantage"] + rng.gauss(0, 0.1))
            more = [{"role": role, "content": s[field]} for s in cycled[len(t["steps"]):]  # the transcript goes on
                    for role, field in (("assistant", "text"), ("user", "observation"))]
            f.write(json.dumps({**t, "id": f"{t['id']}/copy{i}", "steps": cycled, "messages": t["messages"] + more})
                    + "\n")
    return folder


def timed(b: Browser, action: str) -> float:
    start = time.perf_counter()
    b.evaluate(action)
    b.wait_for(READY)
    return time.perf_counter() - start


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = synthetic_run(args.run, Path(tmp) / "run", args.trajectories, args.steps, args.seed)
        start = time.perf_counter()
        page = report.main(report.Args(run))
        write_s = time.perf_counter() - start
        jsonl = (run / "1" / "critic" / "scored.jsonl").stat().st_size
        with Browser() as b:
            start = time.perf_counter()
            b.open(page)
            b.wait_for(READY)
            load_s = time.perf_counter() - start
            next_s = timed(b, "document.getElementById('next').click()")
            filter_s = timed(b, "(() => { const s = document.getElementById('f-source'); s.value = 'policy';"
                                "s.dispatchEvent(new Event('change')); })()")
            shown = b.evaluate("document.getElementById('page-info').textContent")
            errors = list(b.errors)
        size = page.stat().st_size
    print(f"| trajectories × steps | page | scored.jsonl | page / jsonl | write | open to first page | next page "
          f"| filter |\n|---|---|---|---|---|---|---|---|\n| {args.trajectories} × {args.steps} | {size / 1e6:.1f} MB "
          f"| {jsonl / 1e6:.1f} MB | {size / jsonl:.3f}x | {write_s:.1f} s | {load_s:.2f} s | {1000 * next_s:.0f} ms "
          f"| {1000 * filter_s:.0f} ms |")
    print(f"after the filter: {shown}; console errors: {len(errors)}" + (f" ({errors[:3]})" if errors else ""))


if __name__ == "__main__":
    main(tyro.cli(Args))
