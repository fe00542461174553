"""The real-browser test (JupyterLab + Chromium) runs only when asked for by path.

`pytest tests` (make test, make unit) skips this folder: starting JupyterLab and a browser
takes minutes and needs Chromium. Run it with

    .venv/bin/python -m pytest tests/browser -q          # or: make test-browser

Any path at or below this folder on the command line (tests/browser,
tests/browser/test_jupyterlab.py, ...::test_lesson[01_text_generation]) enables it.
After the run, a per-lesson table (time in the browser, live-plot frames, widgets) is printed
just before pytest's own summary and written to results/browser/summary.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ..apart import ignore_unless_asked

HERE = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
REPORT = pytest.StashKey[list]()


pytest_ignore_collect = ignore_unless_asked(HERE)   # tests/apart.py


def pytest_configure(config):
    config.stash[REPORT] = []


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: .venv/bin/pip install playwright "
                    "(never `playwright install`; the test uses Debian's Chromium)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/browser_setup.sh "
                    "(apt-get install chromium) or set CHROMIUM")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def lab():
    """One JupyterLab for the whole run, serving lessons/ (or $COURSE_BROWSER_LESSONS): every
    lesson runs in it (test_jupyterlab.py) and is presented in RISE (test_slides.py)."""
    from .test_jupyterlab import LESSONS, Lab
    server = Lab(LESSONS)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser_report(request):
    """A list the test appends one dict per lesson to (printed in the terminal summary)."""
    return request.config.stash[REPORT]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" or (report.when == "setup" and not report.passed):
        for row in item.config.stash.get(REPORT, []):
            if row.get("nodeid") == item.nodeid:
                row["outcome"] = report.outcome
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(REPORT, [])
    if not rows:
        return
    tr = terminalreporter
    tr.section("JupyterLab in Chromium, per lesson")
    tr.write_line(f"{'lesson':34} {'result':7} {'open s':>7} {'run s':>7} "
                  f"{'live-plot frames (in s)':>24} {'widget cells':>13}")
    for r in rows:
        seconds = r.get("live_cell_s", {})
        frames = ", ".join(f"{n} ({seconds.get(i)})" for i, n in r.get("live_frames", {}).items())
        frames = frames or "-"
        widgets = r.get("widget_cells", {})
        ok = sum(1 for w in widgets.values() if w.get("ok"))
        wtxt = f"{ok}/{len(widgets)}" if widgets else "-"
        run_s = r.get("run_s")
        open_s = r.get("open_s")
        tr.write_line(f"{r['lesson']:34} {r.get('outcome', '?'):7} "
                      f"{open_s if open_s is not None else '-':>7} "
                      f"{run_s if run_s is not None else '-':>7} {frames:>24} {wtxt:>13}")
    results = rows[0].get("results_dir")
    if results:
        try:
            Path(results, "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        except OSError as exc:  # the summary is a convenience; never fail the run on it
            tr.write_line(f"(could not write summary.json: {exc})")
        tr.write_line(f"screenshots and logs: {results}")
