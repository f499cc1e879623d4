"""Where an evolve.sh run's time went: minutes per stage and iteration, from its `.done` markers.

    python tools/stage_times.py runs/evolve-sciworld

evolve.sh writes each stage's own wall time into its marker (`seconds N`), so a resumed run counts only the
time its stages ran. An older marker without it is timed from the marker before it (which then includes any
pause between them).
"""
from __future__ import annotations

import sys
from pathlib import Path

KINDS = ("expert", "bc", "eval", "collect", "relabel", "critic", "bppo", "sft", "rft")


def stage_seconds(run: Path) -> dict[tuple[int, str], float]:
    markers = sorted((p for p in run.glob("*/*/.done") if p.parent.parent.name.isdigit()),
                     key=lambda p: p.stat().st_mtime)
    start = (run / "settings.txt").stat().st_mtime if (run / "settings.txt").exists() else None
    times, last = {}, start
    for marker in markers:
        words = marker.read_text().split()
        mtime = marker.stat().st_mtime
        if len(words) == 2 and words[0] == "seconds":
            seconds = float(words[1])
        else:  # NaN where there is nothing to time it from (a marker older than the run's last start)
            seconds = mtime - last if last is not None and mtime >= last else float("nan")
        times[int(marker.parent.parent.name), marker.parent.name] = seconds
        last = mtime
    return times


def table(run: Path) -> str:
    times = stage_seconds(run)
    if not times:
        sys.exit(f"{run}: no .done markers (is it an evolve.sh run folder?)")
    iters = sorted({it for it, _ in times})
    kinds = [k for k in KINDS if any(kind == k for _, kind in times)]
    kinds += sorted({kind for _, kind in times} - set(kinds))
    lines = ["| stage | " + " | ".join("BC" if it == 0 else f"iter {it}" for it in iters) + " | total |",
             "|---" * (len(iters) + 2) + "|"]
    for kind in kinds:
        row = [times.get((it, kind)) for it in iters]
        lines.append(f"| {kind} | " + " | ".join("" if s is None else f"{s / 60:.1f}" for s in row)
                     + f" | {sum(s for s in row if s is not None and s == s) / 60:.1f} |")
    column = [sum(s for (i, _), s in times.items() if i == it and s == s) / 60 for it in iters]
    lines.append("| **all** | " + " | ".join(f"{m:.1f}" for m in column) + f" | **{sum(column):.1f}** |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/stage_times.py RUN")
    print(f"minutes per stage of {sys.argv[1]}:\n" + table(Path(sys.argv[1])))
