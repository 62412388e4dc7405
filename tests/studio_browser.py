"""The web app in a real browser, for the tests/test_browser_*.py files: Debian's Chromium driven
by Playwright, and the app as its own process (`python launch.py`), exactly as a user starts it.

Needs /usr/bin/chromium (apt install chromium); the browser tests are skipped, saying so, where
it is missing. A test file imports the fixtures it uses from here (pytest finds fixtures in the
test module's names):

    from studio_browser import app, app_env, browser, new_page, page, pytestmark  # noqa: F401 (fixtures)

`app` is one app per test file, over that file's runs folder: starting one takes seconds, so the
tests of a file share it (a file that needs the app to see another environment overrides
`app_env`). Each test opens its own page (`page`, or `new_page(url)` for more than one) and finds
the runs it started by their ids (`app.new_runs()`), never by assuming the runs folder holds only
its own; a run a test leaves going is stopped after it, so the next test's fresh page follows no
run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
# How long a page may take to answer Preview or Start when the answer waits on the TRL config check:
# the app's first check (and one after the child idled out) imports torch, Transformers and TRL in
# a child, 10 s on a quiet 2-core machine and over 30 s, Playwright's default wait, on a busy one.
CHECKED_MS = 120_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_runs(runs_dir: Path) -> None:
    """Stop every run still going in a runs folder."""
    manager = RunManager(runs_dir)
    for view in manager.list():
        if view.active:
            manager.stop(view.id)


def default_location(base: Path) -> tuple[Path, dict]:
    """A runs folder where a user's is by default (~/trn-studio/runs), for an app started without
    --runs-dir: (the folder, the app's environment). Its home is under `base`, and its temp
    folder elsewhere under it, so that, as on a user's machine, the runs folder is neither in
    the temp folder nor in the working directory (from where Gradio hands out files by itself)."""
    env = {key: value for key, value in os.environ.items() if key != "STUDIO_RUNS_DIR"}
    env |= {"HOME": str(base / "home"), "TMPDIR": str(base / "tmp")}
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    runs = base / "home" / "trn-studio" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    return runs, env


def code_text(page, elem_id: str) -> str:
    """The whole text of a gr.Code box: its CodeMirror editor's document. The page's text may miss
    lines: CodeMirror draws the lines near its viewport, and more as it measures them (a test that
    read the page's text right after the box filled once found a line missing)."""
    # the editor's view hangs on its content element: cmTile in the CodeMirror Gradio 6 ships, cmView in older ones
    return page.locator(f"#{elem_id} .cm-content").first.evaluate(
        "el => (el.cmTile || el.cmView).view.state.doc.toString()")


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class App:
    """`python launch.py` on a free port over a given runs folder (`default_location`: the folder
    is the default one of the app's environment, and no --runs-dir is given; `sigint_ignored`: it
    starts with SIGINT ignored, as a script's `launch.py &` starts it)."""

    def __init__(self, runs_dir: Path, env: dict | None = None, default_location: bool = False,
                 sigint_ignored: bool = False):
        self.runs_dir = runs_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = runs_dir.parent / f"app-{self.port}.log"
        self.log = open(self.log_path, "wb")
        where = [] if default_location else ["--runs-dir", str(runs_dir)]
        self.proc = subprocess.Popen(
            [sys.executable, "launch.py", "--port", str(self.port), *where],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            preexec_fn=ignore_sigint if sigint_ignored else None)
        self.known: set[str] = set()
        deadline = time.time() + 90
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("the app did not answer within 90 s")

    def runs(self) -> list[RunView]:
        return RunManager(self.runs_dir).list()

    def mark(self) -> None:
        """Remember the runs there are now: new_runs() gives only the ones started after."""
        self.known = {view.id for view in self.runs()}

    def new_runs(self) -> list[RunView]:
        """The runs started since the last mark(), newest first."""
        return [view for view in self.runs() if view.id not in self.known]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def app_env():
    """The environment of the file's app: this process's, unless the file overrides this fixture."""
    return None


@pytest.fixture(scope="module")
def app(request, tmp_path_factory, app_env):
    """One app for the tests of a file, over a runs folder of its own; no run outlives the file.
    A file that sets APP_DEFAULT_LOCATION = True gets one over the default runs folder of a home
    of its own (default_location), started without --runs-dir."""
    if getattr(request.module, "APP_DEFAULT_LOCATION", False):
        runs, env = default_location(tmp_path_factory.mktemp("app"))
        server = App(runs, env=env | (app_env or {}), default_location=True)
    else:
        runs = tmp_path_factory.mktemp("app") / "runs"
        runs.mkdir()
        server = App(runs, env=app_env)
    yield server
    server.kill()
    stop_runs(server.runs_dir)


@pytest.fixture
def runs_dir(tmp_path):
    """A runs folder for a test that starts an app of its own; no run outlives the test."""
    runs = tmp_path / "runs"
    runs.mkdir()
    yield runs
    stop_runs(runs)  # never leave a run behind, whatever failed


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#start").wait_for()
    return page


@pytest.fixture
def new_page(browser):
    """new_page(url): a page on the app at `url`, its Train tab loaded. Every page is closed after
    the test: an open page keeps asking its app for updates every 0.5 to 2 seconds, and pages left
    open by earlier tests would take CPU from every later one."""
    opened = []

    def new(url):
        opened.append(open_page(browser, url))
        return opened[-1]

    yield new
    for page in opened:
        if not page.is_closed():
            page.close()


@pytest.fixture
def page(new_page, app):
    """A fresh page on the file's app; the runs this test starts are app.new_runs(), and any it
    leaves going is stopped after it."""
    app.mark()
    yield new_page(app.url)
    stop_runs(app.runs_dir)


def run_state(page, state: str):
    """The Train tab's run status once it says `state` (e.g. "FINISHED"): the status line of the
    run this page follows, not a state named anywhere else on the page."""
    return page.locator(".run-status").first.get_by_text(state).first


def drawn_lines(plot):
    """The lines a LinePlot (a locator) draws: its SVG line marks with a colour (Gradio draws a
    series outside the colour scale it fixed earlier as a line without one: invisible)."""
    return plot.locator(".mark-line path[stroke]:not([stroke='none'])")


def log_at_end(page) -> bool:
    """Whether the Train tab's log box shows the end of the log (its last lines)."""
    return page.locator(".run-log textarea").first.evaluate(
        "t => t.value.length > 0 && t.scrollHeight - t.scrollTop - t.clientHeight < 24")


def check_dataset_in_page(page, path: Path):
    """Type a dataset file's path, click Check dataset; the report's locator."""
    dataset = page.locator("#dataset input").first
    dataset.fill(str(path))
    dataset.press("Enter")
    page.get_by_text("Dataset: upload, Hub options").click()
    page.locator("#check-dataset").click()
    return page.locator("#data-report")


def record_texts(page, selector: str) -> None:
    """From now on, every text the element at `selector` shows is kept (texts_shown reads them): a
    message shown for less than Playwright's polling interval is seen too."""
    page.evaluate("""sel => { const el = document.querySelector(sel); window.__shown = [el.innerText];
        new MutationObserver(() => window.__shown.push(el.innerText))
            .observe(el, {subtree: true, childList: true, characterData: true}); }""", selector)


def texts_shown(page) -> list[str]:
    return page.evaluate("() => window.__shown")


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input").first
    box.fill(str(value))
    box.press("Tab")


def broken_header_words(table) -> list[str]:
    """The words of a gr.Dataframe's (a locator's) column headers that are laid out on more than
    one line (a word is what lies between spaces and after a hyphen: "ste|p" is one broken, a run
    id wrapped after one of its hyphens is not)."""
    return table.evaluate("""el => {
        const broken = [];
        for (const th of el.querySelectorAll('[role=columnheader]')) {
            const walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
            for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                for (const word of node.data.matchAll(/[^\\s-]+-?/g)) {
                    const range = document.createRange();
                    range.setStart(node, word.index);
                    range.setEnd(node, word.index + word[0].length);
                    const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
                    if (lines.size > 1) broken.push(word[0]);
                }
            }
        }
        return broken;
    }""")
