"""Look inside an evolve.sh run: one HTML page with the results, each iteration's critic at a glance, every
trajectory step by step with its process reward, and the stages' training curves.

    python tools/report.py runs/evolve-sciworld                          # writes RUN/report.html
    python tools/report.py runs/study/qevolve-seed1 --study docs/study   # with the study's intervals

evolve.sh writes it at the end of a run, beside results.md. The page is one file that opens from disk, with no
server and nothing fetched: the plots are PNGs drawn by matplotlib, and each dataset's trajectories are
gzip-compressed JSON inside the page, decompressed by the browser only when that dataset is chosen and shown a
page at a time, so a 7B run's thousands of trajectories stay responsive (docs/report.md: sizes and timings).
"""
from __future__ import annotations

import base64
import gzip
import html
import io
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
import results  # noqa: E402
from common import UserError, read_jsonl, run_stage  # noqa: E402  (the trajectory schema; no torch)

TEMPLATE = Path(__file__).with_name("report_page.html")
GROUPS = {"expert": "#4c72b0", "policy, success": "#55a868", "policy, failure": "#c44e52"}
# each stage's curves, iterations overlaid: what its metrics.jsonl logs per optimizer step
CURVES = {"bc": ("loss",), "sft": ("loss",), "rft": ("loss",), "critic": ("loss_q", "loss_v"),
          "bppo": ("loss", "kl_ref", "approx_kl", "clip_frac")}
STAGE_TITLES = {"bc": "BC", "sft": "SFT (BC continued)", "rft": "RFT (BC on own successes)",
                "critic": "critic (weighted IQL)", "bppo": "BPPO"}


@dataclass
class Args:
    run: tyro.conf.Positional[Path]
    """an evolve.sh run folder (RUN)"""
    study: Path | None = None
    """a study's output folder (tools/study.py --out): its table and plot, with confidence intervals, join the page"""
    out: Path | None = None
    """where to write the page (default: RUN/report.html)"""
    page_size: int = 20
    """trajectories per page in the browser, at first"""
    screenshot: Path | None = None
    """also save a picture of the trajectory browser, the policy's first failed trajectory opened (needs Chromium)"""


def main(args: Args) -> Path:
    run = args.run
    if not (run / "settings.txt").exists():
        raise UserError(f"{run}: no settings.txt; is it a folder evolve.sh wrote?")
    if args.study and not (args.study / "results.md").exists():
        raise UserError(f"{args.study}: no results.md; is it a study's --out folder?")
    settings = results.parse_settings((run / "settings.txt").read_text())
    iters = int(settings.get("ITERS", "0"))
    datasets = collect_datasets(run, iters)
    sections = [results_section(run, iters, args.study), critic_section(run, iters, datasets),
                '<section id="trajectories"><h2>Trajectories</h2><div id="browser"></div></section>',
                training_section(run, iters), settings_section(settings)]
    meta = {"page_size": args.page_size, "default": default_dataset(datasets),
            "datasets": [{k: d[k] for k in ("key", "label", "n", "scale")} for d in datasets]}
    blobs = "\n".join(f'<script type="application/octet-stream" id="data-{d["key"]}">{pack(d["trajs"])}</script>'
                      for d in datasets)
    title = f"Q-Evolve run {run.resolve().name}: {settings.get('VARIANT', 'qevolve')} on {settings.get('ENV', '?')}"
    fill = {"TITLE": html.escape(title), "BODY": "\n".join(sections), "DATA": blobs,
            "META": json.dumps(meta).replace("</", "<\\/")}  # "</" would end the script element early
    page = re.sub(r"\{\{(TITLE|BODY|META|DATA)\}\}", lambda m: fill[m.group(1)], TEMPLATE.read_text())
    out = args.out or run / "report.html"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page)
    tmp.rename(out)
    n = sum(d["n"] for d in datasets)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {n} trajectories in {len(datasets)} datasets)")
    if args.screenshot:
        screenshot(out, args.screenshot)
    return out


def screenshot(page: Path, path: Path) -> None:
    from browser import Browser
    with Browser(width=1400, height=1050) as b:
        b.open(page)
        b.wait_for("document.body.dataset.ready === '1'")
        b.evaluate("(() => { const s = document.getElementById('f-source'); s.value = 'policy';"
                   "s.dispatchEvent(new Event('change')); })()")
        b.evaluate("(document.querySelector('#list article.traj:has(.badge.failure) header')"
                   " || document.querySelector('#list article.traj header')).click()")
        b.evaluate("document.getElementById('trajectories').scrollIntoView()")
        b.screenshot(path)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- the trajectories
def collect_datasets(run: Path, iters: int) -> list[dict]:
    """Every set of trajectories the run wrote, in the loop's order: the demonstrations and BC's evaluation,
    then per iteration its training data (the critic's scored file where there is one, else the relabelled or the
    collected one) and its evaluation episodes."""
    found = [("0-expert", "BC: the expert demonstrations", run / "0" / "expert" / "train.jsonl")]
    for it in range(iters + 1):
        d = run / str(it)
        if it:
            train = next((p for p in (d / "critic" / "scored.jsonl", d / "relabel" / "hybrid.jsonl",
                                      d / "collect" / "self.jsonl") if p.exists()), None)
            what = {"scored.jsonl": "training data scored by the critic", "hybrid.jsonl": "relabelled training data",
                    "self.jsonl": "the policy's rollouts"}
            if train:
                found.append((f"{it}-train", f"Iter {it}: {what[train.name]}", train))
        name = "BC" if it == 0 else f"Iter {it}"
        for split in results.eval_sets(results.parse_settings((run / "settings.txt").read_text())):
            found.append((f"{it}-{split}", f"{name}: evaluation on {split} tasks", d / "eval" / f"{split}.jsonl"))
    datasets = []
    for key, label, path in found:
        if path.exists():
            trajs = [compact(t) for t in read_jsonl(path, allow_empty=True)]  # a bad line: named, no traceback
            datasets.append({"key": key, "label": f"{label} ({len(trajs)})", "n": len(trajs), "trajs": trajs,
                             "scale": advantage_scale(trajs), "path": path})
    return datasets


def default_dataset(datasets: list[dict]) -> str | None:
    """The last iteration's scored training data (what BPPO learned from), else the first dataset."""
    scored = [d["key"] for d in datasets if d["path"].name == "scored.jsonl"]
    return scored[-1] if scored else (datasets[0]["key"] if datasets else None)


def compact(traj: dict) -> dict:
    """What the browser shows of a trajectory; each step as [thought, action, observation, env reward, relabel
    rules, auxiliary reward, V, Q, advantage], null where the file has no such field."""
    steps = []
    for s in traj["steps"]:
        text = s.get("text", "")
        thought = text.rsplit("Action:", 1)[0] if s.get("format_ok", True) and "Action:" in text else text
        steps.append([thought.replace("Thought:", "", 1).strip(), s.get("action"), s.get("observation", ""),
                      s.get("env_reward"), ", ".join(s.get("rules", [])) if "rules" in s else None,
                      s.get("aux_reward"), s.get("value"), s.get("q"), s.get("advantage")])
    return {"id": traj["id"], "task": traj["task"], "variation": traj["variation"], "source": traj["source"],
            "success": traj["success"], "reward": traj["reward"], "cut": traj.get("truncated", False),
            "instruction": traj.get("instruction", ""), "first": traj.get("initial_observation", ""), "steps": steps}


def advantage_scale(trajs: list[dict]) -> float | None:
    """The |advantage| the colour scale saturates at: the 90th percentile, so that the few large penalties of
    failed episodes do not wash out the rest."""
    advs = [abs(s[8]) for t in trajs for s in t["steps"] if s[8] is not None]
    return float(np.percentile(advs, 90)) or 1.0 if advs else None


def pack(trajs: list[dict]) -> str:
    """gzip + base64 of the JSON: observations repeat, so this is about a tenth of the text."""
    return base64.b64encode(gzip.compress(json.dumps(trajs, separators=(",", ":")).encode(), 6)).decode()


# ----------------------------------------------------------------------------- the sections
def results_section(run: Path, iters: int, study: Path | None) -> str:
    parts = ['<section id="results"><h2>Results</h2>']
    try:
        rows = results.policy_rows(run, iters)
    except SystemExit as missing:  # an unfinished run: the rest of the page is still worth a look
        parts.append(f"<p>No results table yet: {html.escape(str(missing))}</p>")
    else:
        parts.append(markdown_table(results.table(rows)))
    if (run / "results.png").exists():
        parts.append(img(run / "results.png", "BC and each iteration on each evaluation set"))
    if study:
        parts.append("<h3>The study this run belongs to: mean ± 95 % interval over seeds and tasks</h3>")
        parts.append(markdown_table((study / "results.md").read_text()))
        if (study / "results.png").exists():
            parts.append(img(study / "results.png", "the study's variants with their intervals"))
    return "\n".join(parts) + "</section>"


def critic_section(run: Path, iters: int, datasets: list[dict]) -> str:
    parts = ['<section id="critic"><h2>The critic at a glance</h2>',
             "<p>Per iteration, on the hybrid data it was trained on: V of the first state for the demonstrations and "
             "for the policy's successes and failures; V against the discounted return it regresses on; the "
             "advantages (process rewards) BPPO weights each step by; how often each relabel rule fired.</p>"]
    scored = {int(d["key"].split("-")[0]): d for d in datasets if d["path"].name == "scored.jsonl"}
    if not scored:
        parts.append("<p>No critic in this run (the SFT and RFT baselines train none).</p>")
    for it, d in sorted(scored.items()):
        critic_args = json.loads((run / str(it) / "critic" / "args.json").read_text())
        parts.append(f"<h3>Iteration {it}</h3>")
        parts.append(png(critic_figure(d["trajs"], critic_args["gamma"], it)))
        diagnostics = run / str(it) / "critic" / "eval.json"
        if diagnostics.exists():
            parts.append(diagnostics_table(json.loads(diagnostics.read_text())))
    return "\n".join(parts) + "</section>"


def training_section(run: Path, iters: int) -> str:
    parts = ['<section id="training"><h2>Training curves</h2>',
             "<p>Each stage's metrics.jsonl per optimizer step, iterations overlaid "
             "(<code>tensorboard --logdir RUN</code> shows the same).</p>"]
    for stage, keys in CURVES.items():
        logs = {it: metrics(run / str(it) / stage / "metrics.jsonl") for it in range(iters + 1)}
        logs = {it: rows for it, rows in logs.items() if rows}
        if logs:
            parts.append(f"<h3>{STAGE_TITLES[stage]}</h3>" + png(curves_figure(logs, keys)))
    return "\n".join(parts) + "</section>"


def settings_section(settings: dict[str, str]) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in settings.items())
    return f'<section id="settings"><h2>Settings</h2><table class="settings">{rows}</table></section>'


def metrics(path: Path) -> list[dict]:
    """A stage's metrics per step; a resumed stage's redone steps count once (the last)."""
    if not path.exists():
        return []
    with open(path) as f:
        by_step = {row["step"]: row for row in map(json.loads, filter(str.strip, f))}
    return [by_step[s] for s in sorted(by_step)]


def diagnostics_table(diag: dict) -> str:
    def show(v):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}" if isinstance(v, float) else v
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(show(v)))}</td></tr>"
                    for k, v in diag.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    return f'<details><summary>the critic\'s diagnostics (critic/eval.json)</summary><table class="settings">{cells}</table></details>'


def markdown_table(text: str) -> str:
    """A results.md as HTML, in its order: each pipe table a table, a heading a heading, other lines notes."""
    out, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):  # not the |---| line
                tag = "td" if rows else "th"
                rows.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if rows:
            out.append(f'<table class="results">{"".join(rows)}</table>')
            rows = []
        if line.startswith("#"):
            out.append(f"<h4>{html.escape(line.lstrip('# '))}</h4>")
        elif line.strip():
            out.append(f"<p class='note'>{html.escape(line.strip())}</p>")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the plots
def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot
    return matplotlib.pyplot


def group(t: dict) -> str:
    return "expert" if t["source"] == "expert" else "policy, success" if t["success"] else "policy, failure"


def discounted_returns(t: dict, gamma: float) -> list[float]:
    """The return-to-go of env + auxiliary reward at every step: what V regresses on (critic.returns_to_go;
    a cut episode's counted as if it had ended there)."""
    g, out = 0.0, []
    for s in reversed(t["steps"]):
        g = s[3] + (s[5] or 0.0) + gamma * g
        out.append(g)
    return out[::-1]


def critic_figure(trajs: list[dict], gamma: float, it: int):
    fig, axes = plt().subplots(1, 4, figsize=(17, 3.6))
    rng = np.random.default_rng(0)  # the strip plot's jitter: the same picture every time
    # V_0 per group: a strip plot with each group's median
    ax = axes[0]
    for x, (name, colour) in enumerate(GROUPS.items()):
        v0 = [t["steps"][0][6] for t in trajs if group(t) == name and t["steps"]]
        if v0:
            ax.scatter(x + rng.uniform(-0.18, 0.18, len(v0)), v0, s=12, color=colour, alpha=0.3 if len(v0) > 200 else 0.7)
            ax.hlines(np.median(v0), x - 0.3, x + 0.3, color="black")
    ax.set_xticks(range(len(GROUPS)), [f"{g}\n({sum(group(t) == g for t in trajs)})" for g in GROUPS], fontsize=8)
    ax.set_title("V of the first state (line: median)")
    # V against the discounted return-to-go, every step
    ax = axes[1]
    for name, colour in GROUPS.items():
        pairs = [(s[6], g) for t in trajs if group(t) == name for s, g in zip(t["steps"], discounted_returns(t, gamma))]
        if pairs:
            v, g = np.array(pairs).T
            ax.scatter(g, v, s=6, color=colour, alpha=0.25 if len(v) > 1000 else 0.6, label=name)
    lo, hi = ax.get_xlim()
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"discounted return-to-go (γ = {gamma})")
    ax.set_ylabel("V(s_t)")
    ax.set_title("V against the return, every step")
    ax.legend(fontsize=7)
    # the advantages of expert and policy steps
    ax = axes[2]
    advs = {name: [s[8] for t in trajs if group(t) == name for s in t["steps"]] for name in GROUPS}
    every = [a for a in sum(advs.values(), [])]
    bins = np.linspace(min(every), max(every), 30) if every and min(every) < max(every) else 10
    for name, colour in GROUPS.items():
        if advs[name]:
            ax.hist(advs[name], bins=bins, histtype="step", lw=1.5, color=colour, label=f"{name} ({len(advs[name])})")
    ax.set_yscale("log")
    ax.set_title("advantage per step")
    ax.legend(fontsize=7)
    # how often each relabel rule fired, expert and policy steps
    ax = axes[3]
    counts: dict[str, list[int]] = {}
    for t in trajs:
        for s in t["steps"]:
            for rule in filter(None, (s[4] or "").split(", ")):
                counts.setdefault(rule, [0, 0])[t["source"] != "expert"] += 1
    if counts:
        names = sorted(counts, key=lambda r: -sum(counts[r]))
        ax.barh(names, [counts[r][0] for r in names], color=GROUPS["expert"], label="expert steps")
        ax.barh(names, [counts[r][1] for r in names], left=[counts[r][0] for r in names], color="#dd8452",
                label="policy steps")
        ax.invert_yaxis()
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no rule fired", ha="center", va="center", transform=ax.transAxes)
    n_steps = sum(len(t["steps"]) for t in trajs)
    ax.set_title(f"relabel rules fired (of {n_steps} steps)")
    fig.suptitle(f"Iteration {it}: the critic on its {len(trajs)} trajectories", fontsize=10)
    fig.tight_layout()
    return fig


def curves_figure(logs: dict[int, list[dict]], keys: tuple[str, ...]):
    keys = [k for k in keys if any(k in row for rows in logs.values() for row in rows)]
    fig, axes = plt().subplots(1, len(keys), figsize=(4.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for it, rows in logs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*pts), label="BC" if it == 0 else f"iter {it}", lw=1.2)
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt().close(fig)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def img(path: Path, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'


if __name__ == "__main__":
    run_stage(lambda: main(tyro.cli(Args)))
