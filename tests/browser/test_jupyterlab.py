"""Every lesson, run in JupyterLab in a real browser (Chromium driven by Playwright).

For each lessons/*.ipynb: open it in a fresh page, clear its outputs and run all cells from the
menus (Edit > Clear Outputs of All Cells, Run > Run All Cells), wait until every cell has run,
then check what a learner would see:

* no cell ends in an error (no error output, no rendered traceback, every cell numbered);
* each cell that draws a live plot (a `LivePlot(...)`, or a call of a function of the lesson
  that makes one, executed at the top level of the cell) shows at least three different
  pictures while it runs, i.e. the plot changes at least twice;
* each cell that shows ipywidgets (`rerun_controls(...)`, a widget in the saved outputs such as
  a tqdm bar) renders them as widgets, with a button and its sliders for `rerun_controls`;
* the kernel never died or restarted, and is idle at the end;
* the notebook file on disk is unchanged (autosave is off; nothing is saved).

A screenshot of the whole notebook goes to results/browser/<lesson>.png (also on failure),
with the browser console and the JupyterLab log beside it.

JupyterLab runs on a random loopback port with a random token, with throwaway config, data,
runtime and IPython folders (no user state is read or written) and OMP_NUM_THREADS=1,
HF_HUB_OFFLINE=1 for its kernels. Chromium is Debian's (/usr/bin/chromium, or $CHROMIUM);
Playwright's own browser download is never used.

Knobs (environment): BROWSER_LESSON_TIMEOUT (seconds to run one lesson, default 300),
CHROMIUM (browser binary), COURSE_BROWSER_LESSONS (a folder of notebooks to run instead of
lessons/, for checking this test itself).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = Path(os.environ.get("COURSE_BROWSER_LESSONS") or ROOT / "lessons").resolve()
RESULTS = ROOT / "results" / "browser"
LESSON_TIMEOUT = float(os.environ.get("BROWSER_LESSON_TIMEOUT", "300"))
SERVER_START_TIMEOUT = 180.0
OPEN_TIMEOUT = 180.0         # page load + JupyterLab start-up + kernel start
VIEWPORT = {"width": 1280, "height": 900}
MAX_SCREENSHOT_HEIGHT = 32000  # px (Chromium here renders 32000 fine); taller ones are cut

LIVE_CLASSES = {"LivePlot"}
WIDGET_FUNCTIONS = {"rerun_controls", "interact", "interactive", "interact_manual"}
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

LESSON_FILES = sorted(LESSONS.glob("*.ipynb"))


# -- what each lesson should show, from its source ------------------------------------------

def _parse(source: str):
    # IPython magics and shell escapes are not Python; blank them out for the analysis.
    lines = ["pass" if line.lstrip().startswith(("%", "!")) else line
             for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _top_level_calls(tree):
    """Calls that run when the cell runs: not inside a def or lambda body."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _shows_live_plot(call: ast.Call) -> bool:
    return not any(k.arg == "show" and isinstance(k.value, ast.Constant) and not k.value.value
                   for k in call.keywords)


def expectations(nb: dict) -> dict:
    """Which cells must animate a live plot and which must render widgets."""
    trees = {i: _parse("".join(c["source"])) for i, c in enumerate(nb["cells"])
             if c["cell_type"] == "code"}
    live_functions: set[str] = set()
    changed = True
    while changed:  # functions that (directly or through another) make a LivePlot
        changed = False
        for tree in filter(None, trees.values()):
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if fn.name in live_functions:
                    continue
                for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                    name = _callee(call)
                    if (name in LIVE_CLASSES and _shows_live_plot(call)) or name in live_functions:
                        live_functions.add(fn.name)
                        changed = True
                        break
    live, widgets = [], {}
    for i, tree in trees.items():
        cell = nb["cells"][i]
        calls = list(_top_level_calls(tree)) if tree else []
        if any((_callee(c) in LIVE_CLASSES and _shows_live_plot(c)) or _callee(c) in live_functions
               for c in calls):
            live.append(i)
        controls = [c for c in calls if _callee(c) in WIDGET_FUNCTIONS]
        saved = any(WIDGET_MIME in o.get("data", {}) for o in cell.get("outputs", []))
        if controls or saved:
            widgets[i] = {
                "button": bool(controls),
                "controls": any(k.arg not in (None, "button") for c in controls
                                for k in c.keywords),
            }
    return {"live": live, "widgets": widgets}


# -- JupyterLab ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, root: Path):
        self.root = root
        self.tmp = Path(tempfile.mkdtemp(prefix="browser-test-lab-"))
        self.token = secrets.token_hex(24)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.tmp / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None

    def _settings(self):
        config = self.tmp / "config"
        user = config / "lab" / "user-settings" / "@jupyterlab"
        files = {
            # Never write the lessons back: nothing may change the committed notebooks.
            "docmanager-extension/plugin": {"autosave": False},
            # Every cell in the DOM, so that outputs and the screenshot cover the whole notebook.
            # recordTiming: each cell's start and end in its metadata, for the report.
            "notebook-extension/tracker": {"windowingMode": "none", "recordTiming": True},
            # No news/update toasts (and no requests to the internet).
            "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        }
        for name, value in files.items():
            path = user / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        (config / "jupyter_server_config.json").write_text(json.dumps({
            "LabApp": {"news_url": None, "expose_app_in_browser": True,
                       "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"},
        }))
        return config

    def start(self):
        config = self._settings()
        env = dict(os.environ)
        env.update({
            "JUPYTER_CONFIG_DIR": str(config),
            "JUPYTER_DATA_DIR": str(self.tmp / "data"),
            "JUPYTER_RUNTIME_DIR": str(self.tmp / "runtime"),
            "IPYTHONDIR": str(self.tmp / "ipython"),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        env.pop("MPLBACKEND", None)  # the kernel's usual inline backend, as for a learner
        env.pop("JUPYTER_TOKEN", None)
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               f"--port={self.port}", "--ServerApp.port_retries=0",
               "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.root}", "--ServerApp.terminals_enabled=False",
               f"--LabApp.user_settings_dir={config / 'lab' / 'user-settings'}",
               f"--LabApp.workspaces_dir={self.tmp / 'workspaces'}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # containers and CI machines often run as root
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                if self.api("GET", "/api/status", timeout=5) is not None:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_TIMEOUT:.0f} s:\n"
                           + self.log_tail())

    def api(self, method: str, path: str, timeout: float = 30):
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"},
                                     data=b"" if method in ("POST", "DELETE") else None)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else {}

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop_kernels(self):
        """Shut down every session (and its kernel) the last page left behind."""
        try:
            for session in self.api("GET", "/api/sessions"):
                self.api("DELETE", f"/api/sessions/{session['id']}")
        except (OSError, urllib.error.URLError, ValueError):
            pass

    def _leftover_kernels(self):
        """Kernels started by this server: their command line names our runtime folder."""
        mark = str(self.tmp / "runtime").encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
        return pids

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.api("POST", "/api/shutdown", timeout=10)
            except (OSError, urllib.error.URLError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                    try:
                        os.killpg(self.proc.pid, sig)
                        self.proc.wait(timeout=wait)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        for pid in self._leftover_kernels():  # kernels run in their own sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if getattr(self, "log", None):
            self.log.close()
        try:
            RESULTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log_path, RESULTS / "jupyterlab.log")
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- in the page ---------------------------------------------------------------------------

# Every snippet finds the notebook's panel through the app object (LabApp.expose_app_in_browser).
FIND_PANEL = """
const findPanel = (path) => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.sessionContext) return w;
  }
  return null;
};
const promptOf = (node) => {
  const p = node.querySelector('.jp-InputPrompt');
  return p ? p.textContent.trim() : '';
};
// A cell whose input is collapsed (the Colab setup cell: source_hidden) shows no prompt: its
// execution count comes from the cell's model instead.
const promptOfCell = (w) => {
  const p = promptOf(w.node);
  if (p) return p;
  const n = w.model.executionCount;
  return n === null || n === undefined ? '' : '[' + n + ']:';
};
"""

JS_READY = FIND_PANEL + """
(path) => {
  const panel = findPanel(path);
  if (!panel || !panel.context.isReady) return false;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle' && kernel.connectionStatus === 'connected'
         && panel.content.widgets.length > 0;
}
"""

JS_SOURCES = FIND_PANEL + """
(path) => findPanel(path).content.widgets.map(w => [w.model.type, w.model.sharedModel.getSource()])
"""

JS_CLEARED = FIND_PANEL + """
(path) => findPanel(path).content.widgets.every(
  w => w.model.type !== 'code' || (w.model.executionCount === null && w.model.outputs.length === 0))
"""

# Records every picture shown in each cell's outputs, and every kernel status, from now on.
JS_RECORD = FIND_PANEL + """
(path) => {
  const panel = findPanel(path);
  const nodes = panel.content.widgets.map(w => w.node);
  const hash = (s) => {
    let h = 0x811c9dc5;
    for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 16777619); }
    return (h >>> 0).toString(16) + ':' + s.length;
  };
  const t0 = performance.now();
  const state = {cells: {}, statuses: [], before: {}};
  const scan = (i, initial) => {
    const node = nodes[i];
    const busy = promptOf(node).startsWith('[*]');
    for (const img of node.querySelectorAll('.jp-OutputArea-output img')) {
      const src = img.getAttribute('src') || '';
      if (!src) continue;
      const h = hash(src);
      if (initial) { state.before[h] = 1; continue; }
      if (state.before[h]) continue;
      const r = state.cells[i] || (state.cells[i] = {busy: {}, after: {}, times: []});
      if (busy) {
        if (!r.busy[h]) r.times.push(Math.round(performance.now() - t0));
        r.busy[h] = 1;
      } else r.after[h] = 1;
    }
  };
  nodes.forEach((_, i) => scan(i, true));
  const observer = new MutationObserver((records) => {
    const touched = new Set();
    for (const m of records) {
      const el = m.target.nodeType === 1 ? m.target : m.target.parentElement;
      const cell = el && el.closest('.jp-Cell');
      const i = cell ? nodes.indexOf(cell) : -1;
      if (i >= 0) touched.add(i);
    }
    touched.forEach(i => scan(i, false));
  });
  observer.observe(panel.content.node, {subtree: true, childList: true, characterData: true,
                                        attributes: true, attributeFilter: ['src']});
  panel.sessionContext.statusChanged.connect((_, s) => state.statuses.push(s));
  window.__browserTest = {state, observer};
  return nodes.length;
}
"""

JS_PROGRESS = FIND_PANEL + """
(path) => {
  const panel = findPanel(path);
  if (!panel) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {
    prompts: panel.content.widgets.map(w => w.model.type === 'code' ? promptOfCell(w) : null),
    kernel: kernel ? kernel.status : 'none',
    connection: kernel ? kernel.connectionStatus : 'none',
    statuses: window.__browserTest ? window.__browserTest.state.statuses.slice() : [],
  };
}
"""

JS_RESULTS = FIND_PANEL + """
([path, last]) => {
  const panel = findPanel(path);
  const out = panel.content.widgets.map((w, i) => {
    if (w.model.type !== 'code') return null;
    const outputs = w.model.outputs.toJSON();
    const areas = Array.from(w.node.querySelectorAll('.jp-OutputArea-output'));
    const text = areas.map(a => a.textContent).join('\\n');
    return {
      index: i,
      prompt: promptOfCell(w),
      count: w.model.executionCount,
      timing: w.model.getMetadata('execution') || null,
      errors: outputs.filter(o => o.output_type === 'error').map(o => `${o.ename}: ${o.evalue}`),
      traceback: /Traceback \\(most recent call last\\)/.test(text),
      widgets: w.node.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length,
      buttons: w.node.querySelectorAll('.jp-OutputArea-output .widget-button').length,
      controls: w.node.querySelectorAll(
        '.jp-OutputArea-output .widget-slider, .jp-OutputArea-output .widget-dropdown').length,
      widgetError: /Error displaying widget|Error rendering|Loading widget/.test(text),
    };
  });
  const rec = window.__browserTest.state;
  if (last) window.__browserTest.observer.disconnect();
  const frames = {};
  for (const [i, r] of Object.entries(rec.cells)) {
    frames[i] = {busy: Object.keys(r.busy).length, after: Object.keys(r.after).length,
                 times: r.times};
  }
  return {cells: out, frames, statuses: rec.statuses};
}
"""

JS_PAGE_SIZE = FIND_PANEL + """
(path) => {
  const panel = findPanel(path);
  if (window.jupyterapp.shell.collapseLeft) window.jupyterapp.shell.collapseLeft();
  if (window.jupyterapp.shell.collapseRight) window.jupyterapp.shell.collapseRight();
  const candidates = [panel.content.node, ...panel.content.node.querySelectorAll(
    '.jp-WindowedPanel-outer')];
  let best = candidates[0];
  for (const c of candidates)
    if (c.scrollHeight - c.clientHeight > best.scrollHeight - best.clientHeight) best = c;
  best.scrollTop = 0;
  return {extra: Math.max(0, best.scrollHeight - best.clientHeight)};
}
"""


def _menu(page, menu: str, command: str):
    """Click menu > item, the way a learner does (the item is found by its command id)."""
    page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(rf"^\s*{menu}\s*$")).click()
    item = page.locator(f'.lm-Menu .lm-Menu-item[data-command="{command}"]')
    item.wait_for(state="visible", timeout=30_000)
    if "lm-mod-disabled" in (item.get_attribute("class") or ""):
        page.keyboard.press("Escape")
        raise AssertionError(f"menu {menu} > {command} is disabled")
    item.click()


def _screenshot(page, name: str, dest: Path):
    try:
        page.keyboard.press("Escape")  # close a menu left open by a failure
        size = page.evaluate(JS_PAGE_SIZE, name)
        height = min(MAX_SCREENSHOT_HEIGHT, VIEWPORT["height"] + int(size["extra"]))
        page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
        page.wait_for_timeout(1500)  # relayout and paint at the new size
        page.evaluate(JS_PAGE_SIZE, name)  # back to the top after the relayout
        page.wait_for_timeout(500)
        page.screenshot(path=str(dest), full_page=True, timeout=120_000)
    except Exception as exc:  # a screenshot must not hide the real failure
        try:
            page.screenshot(path=str(dest), timeout=60_000)
        except Exception:
            print(f"screenshot of {name} failed: {exc}", file=sys.stderr)


def _seconds(timing) -> float | None:
    """A cell's run time from the metadata JupyterLab records (recordTiming)."""
    from datetime import datetime

    try:
        start = datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00"))
    except (TypeError, KeyError, ValueError):
        return None
    return round((end - start).total_seconds(), 2)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the test ------------------------------------------------------------------------------

@pytest.mark.parametrize("notebook", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_lesson(notebook: Path, lab: Lab, browser, browser_report, request):
    RESULTS.mkdir(parents=True, exist_ok=True)
    nb = json.loads(notebook.read_text())
    expect = expectations(nb)
    name = notebook.relative_to(LESSONS).as_posix()
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    must_run = [i for i in code if "".join(nb["cells"][i]["source"]).strip()]
    digest = _sha256(notebook)
    row = {"lesson": notebook.stem, "nodeid": request.node.nodeid, "results_dir": str(RESULTS),
           "live_cells": expect["live"], "live_frames": {}, "widget_cells": {},
           "open_s": None, "run_s": None}
    browser_report.append(row)

    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    page = context.new_page()
    console = []
    page.on("console", lambda m: console.append(f"[{m.type}] {m.text}"))
    page.on("pageerror", lambda e: console.append(f"[pageerror] {e}"))
    try:
        t0 = time.monotonic()
        page.goto(f"{lab.url}/lab/workspaces/browser-{notebook.stem}/tree/{name}"
                  f"?token={lab.token}", wait_until="domcontentloaded",
                  timeout=OPEN_TIMEOUT * 1000)
        page.wait_for_function(JS_READY, arg=name, timeout=OPEN_TIMEOUT * 1000, polling=500)
        row["open_s"] = round(time.monotonic() - t0, 1)

        sources = page.evaluate(JS_SOURCES, name)
        assert [t for t, _ in sources] == [c["cell_type"] for c in nb["cells"]], \
            "the notebook in JupyterLab does not have the cells of the file"
        for i in expect["live"]:
            assert sources[i][1] == "".join(nb["cells"][i]["source"]), f"cell {i} differs"

        # Focus the notebook (select its first cell) so that the menus act on it.
        page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").first.click()
        _menu(page, "Edit", "editmenu:clear-all")  # Clear Outputs of All Cells
        page.wait_for_function(JS_CLEARED, arg=name, timeout=30_000, polling=200)
        page.evaluate(JS_RECORD, name)
        t_run = time.monotonic()
        _menu(page, "Run", "runmenu:run-all")  # Run All Cells

        # Wait for the end: nothing running, the kernel idle, every cell numbered (or, after an
        # error stopped the run, the same state three polls in a row).
        deadline = t_run + LESSON_TIMEOUT
        seen_running, stable, last = False, 0, None
        while True:
            progress = page.evaluate(JS_PROGRESS, name)
            bad = {"dead", "restarting", "autorestarting"} & set(progress["statuses"])
            assert not bad, f"the kernel went {sorted(bad)} during the run"
            prompts = progress["prompts"]
            running = [i for i, p in enumerate(prompts) if p and p.startswith("[*]")]
            seen_running = seen_running or bool(running)
            numbered = all(re.fullmatch(r"\[\d+\]:?", prompts[i] or "") for i in must_run)
            idle = progress["kernel"] == "idle"
            if not running and idle and (numbered or seen_running):
                stable = stable + 1 if prompts == last else 1
                if numbered or stable >= 3:
                    break
            else:
                stable = 0
            last = prompts
            if time.monotonic() > deadline:
                where = running[:1] or ["?"]
                raise AssertionError(
                    f"{notebook.stem} did not finish in {LESSON_TIMEOUT:.0f} s "
                    f"(kernel {progress['kernel']}, running cell {where[0]}, "
                    f"{sum(1 for i in must_run if (prompts[i] or '').strip('[]: ').isdigit())}"
                    f"/{len(must_run)} cells done)")
            time.sleep(0.5)
        row["run_s"] = round(time.monotonic() - t_run, 1)

        # Widgets render asynchronously after their cell ends: give them a moment.
        wait_until = time.monotonic() + 30
        while True:
            results = page.evaluate(JS_RESULTS, [name, False])
            cells = results["cells"]
            pending = [i for i in expect["widgets"]
                       if not cells[i]["widgets"] or cells[i]["widgetError"]]
            if not pending or time.monotonic() > wait_until:
                break
            time.sleep(1)
        results = page.evaluate(JS_RESULTS, [name, True])
        cells = results["cells"]

        durations = {i: _seconds(cells[i]["timing"]) for i in code}
        slowest = sorted((d, i) for i, d in durations.items() if d is not None)[::-1][:3]
        row["slowest_cells_s"] = {str(i): d for d, i in slowest}

        problems = []
        for i in code:
            c = cells[i]
            if c["errors"] or c["traceback"]:
                src = "".join(nb["cells"][i]["source"]).strip().splitlines()[:1]
                problems.append(f"cell {i} ({src[0] if src else ''!r}) ended in an error: "
                                f"{'; '.join(c['errors']) or 'traceback in its output'}")
        not_run = [i for i in must_run if not re.fullmatch(r"\[\d+\]:?", cells[i]["prompt"])]
        if not_run:
            problems.append(f"cells not run: {not_run} (prompts "
                            f"{[cells[i]['prompt'] for i in not_run[:5]]})")

        for i in expect["live"]:
            f = results["frames"].get(str(i), {"busy": 0, "after": 0, "times": []})
            row["live_frames"][str(i)] = f["busy"]
            row.setdefault("live_cell_s", {})[str(i)] = durations.get(i)
            if len(f["times"]) > 1:
                row.setdefault("live_frames_span_s", {})[str(i)] = round(
                    (f["times"][-1] - f["times"][0]) / 1000, 1)
            if f["busy"] < 3:
                problems.append(f"cell {i}'s live plot showed {f['busy']} different pictures "
                                f"while it ran; want at least 3 (it changes at least twice)")

        for i, want in expect["widgets"].items():
            c = cells[i]
            ok = c["widgets"] > 0 and not c["widgetError"]
            if want["button"]:
                ok = ok and c["buttons"] > 0
            if want["controls"]:
                ok = ok and c["controls"] > 0
            row["widget_cells"][str(i)] = {"ok": ok, "widgets": c["widgets"],
                                           "buttons": c["buttons"], "controls": c["controls"]}
            if not ok:
                problems.append(f"cell {i}: widgets did not render ({c['widgets']} widget views, "
                                f"{c['buttons']} buttons, {c['controls']} sliders/dropdowns"
                                f"{', an error message' if c['widgetError'] else ''})")

        final = page.evaluate(JS_PROGRESS, name)
        bad = {"dead", "restarting", "autorestarting"} & set(results["statuses"])
        if bad or final["kernel"] != "idle" or final["connection"] != "connected":
            problems.append(f"kernel not alive and idle at the end: {final['kernel']}, "
                            f"{final['connection']}, saw {sorted(bad)}")
        kernels = lab.api("GET", "/api/kernels")
        if not kernels or any(k.get("execution_state") not in ("idle",) for k in kernels):
            problems.append(f"server's view of the kernel: {kernels}")

        assert not problems, f"{notebook.stem}:\n  " + "\n  ".join(problems)
    finally:
        _screenshot(page, name, RESULTS / f"{notebook.stem}.png")
        (RESULTS / f"{notebook.stem}.console.log").write_text("\n".join(console) + "\n")
        context.close()
        lab.stop_kernels()
        assert _sha256(notebook) == digest, f"{notebook} was modified by the browser run"
