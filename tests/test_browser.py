"""Browser test: each live notebook runs in JupyterLab and its plot grows as steps run.

It starts ``jupyter lab`` on loopback (a random token, isolated config, data and
settings dirs, no network look-ups), opens ``notebooks/03_advantage_variance_live.ipynb``
(then ``06_learns_to_think.ipynb`` and ``07_collapse_forensics.ipynb``) in headless Chromium (Debian's ``/usr/bin/chromium`` driven by playwright-python; no
browser download), runs all cells, and checks that

* a plotly figure (``.js-plotly-plot``) renders in an output area,
* the number of points of one of its traces grows while the cells run, and ends > 1,
* no cell shows an error or a traceback.

Screenshots go to the test's ``tmp_path``; on failure the message carries the tail
of the JupyterLab log and of the browser console. The whole test is bounded
(``TEST_BUDGET_S``). It skips when playwright or ``/usr/bin/chromium`` is missing;
``.ci/run`` installs both, and under ``CI=true`` a missing one fails the test instead.

The server serves a temporary copy of the notebooks folder; the copy of the notebook
gets a cell after its ``parameters`` cell (as papermill injects one) with a short
run's parameters (``LIVE``) and a temporary ``run_dir``, so nothing is written into the
repository. ``LABKIT_BROWSER_NOTEBOOK=path.ipynb`` points the test at another notebook.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
# The live notebooks, each with the parameters of a short run: the point is the live plot,
# not the training (2 cores run the kernel, the server and Chromium together).
LIVE: dict = {
    "03_advantage_variance_live.ipynb": {"steps": 4, "eval_n": 8, "diag_every": 2,
                                         "diag_prompts": 4, "diag_batches": 3,
                                         "diag_samples": 8},
    "06_learns_to_think.ipynb": {"steps": 4, "eval_n": 8, "eval_every": 2, "batch_prompts": 4,
                                 "critic_steps": 2, "look_prompts": 1, "look_samples": 1},
    "07_collapse_forensics.ipynb": {"steps": 16, "eval_n": 8, "eval_every": 1, "keep_every": 1,
                                    "at": "3", "seeds": 1,
                                    "stabilisers": "half_lr: lr=0.0005"},
}
NOTEBOOKS = ([Path(os.environ["LABKIT_BROWSER_NOTEBOOK"])]
             if os.environ.get("LABKIT_BROWSER_NOTEBOOK")
             else [REPO / "notebooks" / name for name in LIVE])
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TEST_BUDGET_S = 170.0  # everything, from starting the server to the last assertion
SERVER_START_S = 60.0
PAGE_READY_S = 60.0
KERNEL_READY_S = 60.0
POLL_S = 0.25
# LIVE's parameters are set in a cell injected after the notebook's `parameters` cell (as
# papermill does); run_dir is always a temporary folder, so the run writes nothing into the
# repository.

# JupyterLab user settings for the run: no autosave, no news or update look-ups.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


# --------------------------------------------------------------------------- helpers


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        rest = max(0.0, self.end - time.monotonic())
        return rest if cap is None else min(rest, cap)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(lines[-n:])


class LabServer:
    """``jupyter lab`` on 127.0.0.1, in its own process group, logging to a file."""

    def __init__(self, root_dir: Path, work: Path):
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.root_dir = root_dir
        self.log_path = work / "jupyter-lab.log"
        self.proc: subprocess.Popen | None = None
        dirs = {k: work / k for k in ("config", "data", "runtime", "ipython", "settings", "workspaces")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        for name, content in LAB_SETTINGS.items():
            target = dirs["settings"] / name.split("/", 1)[0] / name.split("/", 1)[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(content))
        self.runtime_dir = dirs["runtime"]
        self.env = dict(os.environ)
        bindir = Path(sys.executable).parent
        self.env.update(
            JUPYTER_CONFIG_DIR=str(dirs["config"]),
            JUPYTER_DATA_DIR=str(dirs["data"]),
            JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
            IPYTHONDIR=str(dirs["ipython"]),
            PATH=f"{bindir}{os.pathsep}{self.env.get('PATH', '')}",
            PYTHONUNBUFFERED="1",
        )
        jupyter = bindir / "jupyter"
        self.cmd = [str(jupyter)] if jupyter.exists() else [sys.executable, "-m", "jupyter"]
        self.cmd += [
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--port-retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root_dir}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_remote_access=False",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={dirs['settings']}",
            f"--LabApp.workspaces_dir={dirs['workspaces']}",
        ]
        if os.geteuid() == 0:  # CI runs as root
            self.cmd.append("--allow-root")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=self.root_dir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        end = time.monotonic() + timeout
        url = f"{self.base_url}/api/status?token={self.token}"
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.proc.returncode}" + self.log_tail())
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > end:
                raise AssertionError(f"jupyter lab did not answer /api/status within {timeout:.0f}s" + self.log_tail())
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            pgid = self.proc.pid  # start_new_session: the group is the server's own
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(pgid, sig)
                    self.proc.wait(timeout=wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Kernels run in sessions of their own and exit with their server; any still
        # alive is found by its connection file in this run's runtime dir.
        for pid in self._kernel_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _kernel_pids(self) -> list[int]:
        marker = str(self.runtime_dir).encode()
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if marker in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
        return pids

    def log_tail(self, n: int = 60) -> str:
        return f"\n--- jupyter lab log (last {n} lines) ---\n{_tail(self.log_path, n)}"


# --------------------------------------------------------------------------- fixtures


def _unavailable(reason: str):
    """Skip where the browser tools are missing, but fail under CI (.ci/run installs them)."""
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"CI must run the browser test: {reason}")
    pytest.skip(reason)


@pytest.fixture
def sync_playwright_api():
    try:
        import jupyterlab  # noqa: F401
        from playwright import sync_api
    except ImportError as e:
        _unavailable(f"{e.name} is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium; .ci/run does it)")
    return sync_api


def _copy_notebooks(dest: Path, run_dir: Path, notebook: Path) -> None:
    """The notebooks folder in `dest`, LIVE's parameters (and run_dir) injected into
    `notebook`."""
    import nbformat

    shutil.copytree(
        notebook.parent, dest, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
    )
    book = nbformat.read(notebook, as_version=4)
    tagged = [i for i, c in enumerate(book.cells) if "parameters" in c.metadata.get("tags", [])]
    values = {"run_dir": str(run_dir), **LIVE.get(notebook.name, {})}
    cell = nbformat.v4.new_code_cell(
        "\n".join(f"{k} = {v!r}" for k, v in values.items()),
        metadata={"tags": ["injected-parameters"]},
    )
    book.cells.insert(tagged[0] + 1 if tagged else 0, cell)
    nbformat.write(book, dest / notebook.name)


@pytest.fixture(params=NOTEBOOKS, ids=lambda path: path.stem)
def notebook(request) -> Path:
    return request.param


@pytest.fixture
def deadline():
    return Deadline(TEST_BUDGET_S)


@pytest.fixture
def lab(tmp_path, deadline, sync_playwright_api, notebook):
    assert notebook.exists(), f"{notebook} is missing"
    root = tmp_path / "notebooks"
    _copy_notebooks(root, tmp_path / "run", notebook)
    server = LabServer(root, tmp_path / "jupyter")
    try:
        server.start(deadline.left(SERVER_START_S))
        yield server
    finally:
        server.stop()


@pytest.fixture
def browser(tmp_path, sync_playwright_api):
    """A page of a fresh headless Chromium profile, with its console and blocked requests."""
    pw = sync_playwright_api.sync_playwright().start()
    context = None
    try:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000},
            timeout=60_000,
        )
        pg = context.pages[0] if context.pages else context.new_page()
        b = SimpleNamespace(page=pg, console=[], blocked=[])

        def _route(route):  # loopback and local files only
            url = route.request.url
            if url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:",
                               "file:")):
                route.continue_()
            else:
                b.blocked.append(url)
                route.abort()

        context.route("**/*", _route)
        pg.on("console", lambda m: b.console.append(f"[{m.type}] {m.text}"))
        pg.on("pageerror", lambda e: b.console.append(f"[pageerror] {e}"))
        yield b
    finally:
        if context is not None:
            context.close()
        pw.stop()


# --------------------------------------------------------------------------- page scripts

# The notebook panel once JupyterLab has restored it; null until then.
JS_PANEL = """(name) => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return null;
  const w = app.shell.currentWidget;
  return !!(w && w.context && w.sessionContext && w.context.path.endsWith(name));
}"""

JS_KERNEL = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const dialog = document.querySelector('.jp-Dialog');
  return {status: k ? k.status : null, name: k ? k.name : null,
          dialog: dialog ? dialog.innerText.slice(0, 300) : null};
}"""

JS_RUN_ALL = """() => {
  const app = window.jupyterapp;
  window.__labkitRun = {done: false, result: null, error: null};
  app.commands.execute('notebook:run-all-cells').then(
    (r) => { window.__labkitRun.done = true; window.__labkitRun.result = r; },
    (e) => { window.__labkitRun.done = true; window.__labkitRun.error = String(e); });
  return true;
}"""

# Points per trace of every plotly figure in an output area; each figure keeps an id.
JS_SAMPLE = """() => {
  window.__labkitSeq = window.__labkitSeq || 0;
  const plots = [];
  for (const gd of document.querySelectorAll('.jp-OutputArea-output .js-plotly-plot')) {
    if (!gd.dataset.labkitId) gd.dataset.labkitId = String(++window.__labkitSeq);
    const traces = (gd.data || []).map((t) => {
      const a = t.x != null ? t.x : t.y;
      return a != null && a.length != null ? a.length : 0;
    });
    const box = gd.getBoundingClientRect();
    plots.push({id: gd.dataset.labkitId, traces, width: box.width, height: box.height,
                svg: gd.querySelectorAll('.main-svg').length,
                marks: gd.querySelectorAll('.scatterlayer .point').length
                       + [...gd.querySelectorAll('.scatterlayer path.js-line')]
                           .filter((p) => (p.getAttribute('d') || '').length > 1).length});
  }
  const run = window.__labkitRun || {};
  const w = window.jupyterapp.shell.currentWidget;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  return {t: performance.now(), plots, done: !!run.done, result: run.result, error: run.error,
          kernel: k ? k.status : null};
}"""

JS_ERRORS = """() => {
  const out = [];
  const w = window.jupyterapp.shell.currentWidget;
  const cells = w.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    const outs = c.toJSON().outputs || [];
    for (const o of outs) {
      if (o.output_type === 'error')
        out.push(`cell ${i}: ${o.ename}: ${o.evalue}\\n` + (o.traceback || []).join('\\n').replace(/\\x1b\\[[0-9;]*m/g, ''));
    }
  }
  for (const el of document.querySelectorAll(
      '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], ' +
      '.jp-RenderedText[data-mime-type*="error"]')) {
    const text = el.innerText || '';
    if (text.includes('Traceback') || el.matches('[data-mime-type*="error"]'))
      out.push('output area: ' + text.slice(0, 2000));
  }
  for (const el of document.querySelectorAll('.jp-OutputArea-output')) {
    const text = el.innerText || '';
    if (/Error displaying widget|Failed to load model class|Model not found/i.test(text))
      out.push('widget: ' + text.slice(0, 500));
  }
  return out;
}"""


# --------------------------------------------------------------------------- the test


def test_live_notebook_plot_grows_in_jupyterlab(deadline, lab, browser, tmp_path, notebook):
    page = browser.page
    name = notebook.name
    samples: list[dict] = []

    def context() -> str:
        console = "\n".join(browser.console[-40:])
        blocked = ", ".join(browser.blocked[:10]) or "none"
        return (
            f"\nscreenshots in {tmp_path}\nblocked non-loopback requests: {blocked}"
            f"\n--- browser console (last 40) ---\n{console}" + lab.log_tail()
        )

    try:
        page.goto(
            f"{lab.base_url}/lab/tree/{name}?token={lab.token}",
            wait_until="domcontentloaded",
            timeout=deadline.left(PAGE_READY_S) * 1000,
        )
        page.wait_for_function(JS_PANEL, arg=name, timeout=deadline.left(PAGE_READY_S) * 1000)

        # The kernel: started and idle (a kernel picker dialog means the notebook's
        # kernelspec is not available).
        end = time.monotonic() + deadline.left(KERNEL_READY_S)
        kernel = page.evaluate(JS_KERNEL)
        while kernel["status"] != "idle":
            assert kernel["dialog"] is None, f"a dialog blocks the notebook: {kernel['dialog']!r}"
            assert time.monotonic() < end, f"kernel not idle in time: {kernel}"
            time.sleep(POLL_S)
            kernel = page.evaluate(JS_KERNEL)

        page.evaluate(JS_RUN_ALL)
        t0 = time.monotonic()
        while True:
            s = page.evaluate(JS_SAMPLE)
            s["elapsed"] = round(time.monotonic() - t0, 2)
            samples.append(s)
            if s["done"]:
                break
            assert deadline.left() > 15, (
                f"run-all not finished after {s['elapsed']:.0f}s (last sample: {s})"
            )
            time.sleep(POLL_S)
        # Updates already received may still be drawing: let them settle.
        last = None
        for _ in range(8):
            time.sleep(0.5)
            s = page.evaluate(JS_SAMPLE)
            s["elapsed"] = round(time.monotonic() - t0, 2)
            if last is not None and [p["traces"] for p in s["plots"]] == [p["traces"] for p in last["plots"]]:
                break
            last = s
        final = s
        samples.append(final)

        plot = page.locator(".jp-OutputArea-output .js-plotly-plot").first
        if plot.count():
            plot.scroll_into_view_if_needed(timeout=5_000)
            time.sleep(0.3)
            plot.screenshot(path=str(tmp_path / "plot.png"), timeout=10_000)
        page.screenshot(path=str(tmp_path / "lab.png"), timeout=10_000)

        errors = page.evaluate(JS_ERRORS)
        assert not errors, "the notebook shows errors:\n" + "\n\n".join(errors)
        assert final["error"] is None, f"run-all failed: {final['error']}"
        assert final["result"] is not False, "run-all reported a failed cell"

        assert final["plots"], "no plotly figure (.js-plotly-plot) rendered in any output area"
        # The live plot: a figure with a trace seen at two or more sizes > 0 while the
        # cells were still running (a figure filled once at the end does not count).
        grown = []
        for p in final["plots"]:
            for ti, n_final in enumerate(p["traces"]):
                seen = [
                    q["traces"][ti]
                    for smp in samples
                    if not smp["done"]
                    for q in smp["plots"]
                    if q["id"] == p["id"] and len(q["traces"]) > ti
                ]
                sizes = sorted({n for n in seen if n > 0})
                if len(sizes) >= 2 and n_final > 1:
                    grown.append((p, ti, sorted(set(sizes + [n_final]))))
        history = [(smp["elapsed"], [q["traces"] for q in smp["plots"]]) for smp in samples]
        assert grown, (
            "no trace of a rendered plot grew step by step while the cells ran "
            f"(elapsed s, points per trace per plot): {history[:5]} ... {history[-5:]}"
        )
        # The live trace: the one seen at the most distinct sizes during the run.
        p, ti, counts = max(grown, key=lambda g: (len(g[2]), g[2][-1]))
        assert p["svg"] > 0 and p["width"] > 100 and p["height"] > 100, f"plot not drawn: {p}"
        assert p["marks"] > 0, f"the plot draws no scatter points or lines: {p}"
        print(
            f"live plot {p['id']}, trace {ti}: points seen {counts}; run took "
            f"{final['elapsed']:.1f}s; screenshots in {tmp_path}"
        )
    except Exception as e:  # noqa: BLE001 - every failure gets the logs attached
        try:
            page.screenshot(path=str(tmp_path / "failure.png"), timeout=10_000)
        except Exception:  # noqa: BLE001
            pass
        what = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
        raise AssertionError(what + context()) from e


def test_a_report_opens_offline_with_its_equations_and_figures(browser, tmp_path):
    """report.html (for readers: no code) and notebook.html (with code) of a run, opened
    from disk with every request off the machine blocked: the equations render as MathML,
    the plotly figure draws, and no request was even attempted."""
    from labkit.lab.runner import run_notebook

    run_dir = run_notebook(REPO / "tests" / "fixtures" / "tiny.ipynb", {"steps": "3"},
                           root=tmp_path / "runs", progress=False)
    requests = []
    browser.page.on("request", lambda r: requests.append(r.url))
    for name, code in (("report.html", False), ("notebook.html", True)):
        page = browser.page
        page.goto((run_dir / name).as_uri(), wait_until="load", timeout=60_000)
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        boxes = page.eval_on_selector_all(
            "math", "els => els.map(e => [e.getAttribute('display'), "
                    "e.getBoundingClientRect().width, e.getBoundingClientRect().height])")
        assert len(boxes) == 3, boxes  # $t$, $s_t = ...$, and the displayed sum
        assert all(w > 0 and h > 0 for _, w, h in boxes), boxes
        assert [d for d, _, _ in boxes].count("block") == 1
        fraction = page.eval_on_selector("mfrac", "e => e.getBoundingClientRect().height")
        inline = page.eval_on_selector("math[display=inline]",
                                       "e => e.getBoundingClientRect().height")
        assert fraction > inline  # laid out as a fraction, not a line of text
        text = page.inner_text("body")
        assert "$" not in text and "\\frac" not in text and "\\text" not in text
        assert ("import json" in text) is code  # the code cells only in notebook.html
        page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    left = [url for url in requests if not url.startswith(("file:", "data:", "blob:"))]
    assert not left and not browser.blocked, (left, browser.blocked, browser.console[-5:])
