"""tools/report.py: the page evolve.sh writes at the end of the smoke loop, opened in headless Chromium (Debian's
`chromium`; .ci/run installs it): it loads offline with no error, its browser shows every trajectory of an
iteration and each step's advantage as scored.jsonl holds it."""
import json
import re
import shutil
import sys

import common
from conftest import ROOT, run_script

sys.path.insert(0, str(ROOT / "tools"))
from browser import Browser  # noqa: E402

READY = "document.body.dataset.ready === '1'"


def choose(b: Browser, select: str, value: str) -> None:
    """Pick an option of one of the page's selects as a user would, and wait for the list to be drawn."""
    b.evaluate(f"(() => {{ const s = document.getElementById({json.dumps(select)}); s.value = {json.dumps(value)};"
               "s.dispatchEvent(new Event('change')); })()")
    b.wait_for(READY)


def listed(b: Browser) -> list[str]:
    return b.evaluate("[...document.querySelectorAll('#list article.traj')].map(a => a.dataset.id)")


def test_the_smoke_runs_page_in_a_browser(smoke_run):
    run, out = smoke_run
    page = run / "report.html"
    assert f"wrote {page}" in out  # evolve.sh wrote it, beside results.md
    scored = common.read_jsonl(run / "1" / "critic" / "scored.jsonl")
    with Browser() as b:
        b.open(page)
        b.wait_for(READY)
        # every trajectory of iteration 1's scored data, five to a page, paging with the buttons
        choose(b, "f-dataset", "1-train")
        choose(b, "f-per-page", "5")
        ids = []
        for _ in range(len(scored)):
            ids += listed(b)
            if b.evaluate("document.getElementById('next').disabled"):
                break
            b.evaluate("document.getElementById('next').click()")
        assert sorted(ids) == sorted(t["id"] for t in scored) and len(set(ids)) == len(ids)

        # one policy trajectory opened: each step's advantage, V and Q as the file holds them (title: the exact value)
        t = max((t for t in scored if t["source"] == "policy"), key=lambda t: len(t["steps"]))
        b.evaluate(f"(() => {{ const i = document.getElementById('f-text'); i.value = {json.dumps(t['id'])};"
                   "i.dispatchEvent(new Event('input')); })()")
        assert listed(b) == [t["id"]]
        b.evaluate("document.querySelector('#list article.traj header').click()")
        for field, cls in (("advantage", "adv"), ("value", "v"), ("q", "q")):
            cells = b.evaluate(f"[...document.querySelectorAll('#list td.{cls}')].map(td => [td.textContent, td.title])")
            assert [(text, float(exact)) for text, exact in cells] == [(f"{s[field]:+.4f}", s[field]) for s in t["steps"]]
        assert b.evaluate("document.querySelector('#list article.traj .body').hidden") is False

        # the filters: the demonstrations alone; then the policy's attempts at one task side by side
        b.evaluate("(() => { const i = document.getElementById('f-text'); i.value = '';"
                   "i.dispatchEvent(new Event('input')); })()")
        choose(b, "f-per-page", "100")
        choose(b, "f-source", "expert")
        assert sorted(listed(b)) == sorted(t["id"] for t in scored if t["source"] == "expert")
        choose(b, "f-source", "policy")
        b.evaluate("document.querySelector('#list button.same-task').click()")
        first = next(t for t in scored if t["source"] == "policy")
        same = [u for u in scored if u["source"] == "policy" and (u["task"], u["variation"]) == (first["task"], first["variation"])]
        columns = b.evaluate("[...document.querySelectorAll('#compare .columns > div')].map(c => "
                             "[...c.querySelectorAll('article.traj')].map(a => a.dataset.id))")
        assert columns == [[u["id"] for u in same if u["success"]], [u["id"] for u in same if not u["success"]]]

        # every dataset of the run opens, each with all its trajectories (the smoke run's fit on one page)
        choose(b, "f-source", "")
        datasets = json.loads(b.evaluate("document.getElementById('meta').textContent"))["datasets"]
        assert [d["key"] for d in datasets] == ["0-expert", "0-seen", "0-unseen", "1-train", "1-seen", "1-unseen",
                                                 "2-train", "2-seen", "2-unseen"]
        for d in datasets:
            choose(b, "f-dataset", d["key"])
            assert len(listed(b)) == d["n"] > 0
        assert b.errors == []
        assert all(url.startswith(("file:", "data:")) for url in b.requests)  # nothing fetched from a network
    html = page.read_text()
    for section in ('id="results"', 'id="critic"', 'id="training"', "Iteration 2", "BPPO"):
        assert section in html


def test_an_unfinished_run_still_gets_its_page_and_a_wrong_folder_a_clear_error(smoke_run, tmp_path):
    run, _ = smoke_run
    partial = tmp_path / "partial"
    shutil.copytree(run, partial, ignore=shutil.ignore_patterns("eval", "2", "report.html"))
    proc = run_script("tools/report.py", str(partial))
    assert "trajectories" in proc.stdout and "No results table yet" in (partial / "report.html").read_text()

    proc = run_script("tools/report.py", str(tmp_path / "nothing"), check=False)
    assert proc.returncode != 0 and "no settings.txt" in proc.stderr and "Traceback" not in proc.stderr

    expert = partial / "0" / "expert" / "train.jsonl"
    lines = expert.read_text().splitlines()
    expert.write_text("\n".join(lines + ['{"id": "cut short"']) + "\n")  # a write that stopped mid-line
    proc = run_script("tools/report.py", str(partial), check=False)
    assert proc.returncode == 2 and f"train.jsonl:{len(lines) + 1}" in proc.stderr and "Traceback" not in proc.stderr


def test_the_scale_benchmark_builds_and_opens_a_large_page(smoke_run):
    run, _ = smoke_run
    out = run_script("bench/report_scale.py", str(run), "--trajectories", "60", "--steps", "5").stdout
    row = re.search(r"^\| 60 × 5 \| ([0-9.]+) MB \| ([0-9.]+) MB \| ([0-9.]+)x \|", out, re.M)
    assert row and 0 < float(row.group(3)) < 1, out  # the page is smaller than the JSONL it shows
    assert re.search(r"after the filter: 1–20 of [0-9]+ · page 1 of [0-9]+; console errors: 0$", out, re.M), out


def test_a_run_evaluated_on_named_task_lists_reports_them(smoke_run, tmp_path):
    """EVAL_TASKS' sets (here the smoke run's seen and unseen files renamed dev and confirm) take the place of
    seen and unseen in the results table, the TensorBoard curves and the page's datasets."""
    run, _ = smoke_run
    named = tmp_path / "named"
    shutil.copytree(run, named, ignore=shutil.ignore_patterns("report.html", "results.*", "loop"))
    settings = (named / "settings.txt").read_text().replace("EVAL_TASKS      ", "EVAL_TASKS      dev=a.txt confirm=b.txt")
    (named / "settings.txt").write_text(settings)
    for it in (0, 1, 2):
        for old, new in (("seen", "dev"), ("unseen", "confirm")):
            for f in (named / str(it) / "eval").glob(f"{old}.*"):
                f.rename(f.with_name(f.name.replace(old, new, 1)))
    run_script("tools/results.py", str(named), "2")
    table = (named / "results.md").read_text()
    assert table.startswith("| policy | dev reward ×100 | dev success % | confirm reward ×100 | confirm success % |")
    assert "1 dev and 1 confirm episodes per policy" in table
    from conftest import tensorboard_scalars
    assert {"eval/dev_reward_x100", "eval/confirm_success_pct"} <= set(tensorboard_scalars(named / "loop"))
    run_script("tools/report.py", str(named))
    page = (named / "report.html").read_text()
    assert 'data-0-dev"' in page and 'data-2-confirm"' in page and "data-0-seen" not in page
