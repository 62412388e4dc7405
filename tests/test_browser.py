"""The web app in a real browser: Debian's Chromium driven by Playwright.

The app runs as its own process (`python launch.py`), exactly as a user starts it, and
trains the built-in tiny model through the page. Needs /usr/bin/chromium (apt install
chromium); the tests are skipped, saying so, where it is missing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from studio_core import trainers
from studio_core.runs.manager import RunManager
from conftest import run_folders

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class App:
    """`python launch.py` on a free port over a given runs folder."""

    def __init__(self, runs_dir: Path, env: dict | None = None):
        self.runs_dir = runs_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(runs_dir.parent / f"app-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "launch.py", "--port", str(self.port), "--runs-dir", str(runs_dir)],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.time() + 90
        while time.time() < deadline:
            assert self.proc.poll() is None, (runs_dir.parent / f"app-{self.port}.log").read_text()
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("the app did not answer within 90 s")

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


@pytest.fixture
def runs_dir(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    yield runs
    for view in RunManager(runs).list():  # never leave a run behind, whatever failed
        if view.live_state in ("starting", "running"):
            RunManager(runs).stop(view.id)


@pytest.fixture
def app(runs_dir):
    server = App(runs_dir)
    yield server
    server.kill()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#start").wait_for()
    return page


def wait_until_finished(manager: RunManager, run_id: str, timeout: float = 180) -> None:
    """A run started outside the page, trained to its end before the page uses it."""
    deadline = time.time() + timeout
    while (state := manager.view(run_id).live_state) != "finished":
        assert time.time() < deadline and state in ("starting", "running"), f"run {run_id}: {state}"
        time.sleep(0.5)


def check_dataset_in_page(page, path: Path):
    """Type a dataset file's path, click Check dataset; the report's locator."""
    dataset = page.locator("#dataset input").first
    dataset.fill(str(path))
    dataset.press("Enter")
    page.get_by_text("Dataset: upload, Hub options").click()
    page.locator("#check-dataset").click()
    return page.locator("#data-report")


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input").first
    box.fill(str(value))
    box.press("Tab")


def test_click_through_sft_on_the_builtin_default(browser, app, tmp_path):
    page = open_page(browser, app.url)
    assert page.locator("#model input").first.input_value() == "builtin:tiny-qwen3"
    assert page.locator("#dataset input").first.input_value() == "builtin:qa"
    page.locator("#run_name textarea, #run_name input").first.fill("browser-sft")
    set_number(page, "max_steps", 40)

    page.locator("#preview").click()
    plan = page.locator("#plan")
    plan.get_by_text("torch.distributed.run").first.wait_for()
    assert "use_cpu = True" in plan.inner_text()
    assert run_folders(app.runs_dir) == []  # a preview launches nothing

    page.locator("#start").click()
    page.get_by_text("FINISHED").first.wait_for(timeout=120_000)
    status = page.locator(".run-status").first.inner_text()
    assert "browser-sft" in status and "loss" in status
    assert page.locator(".run-progress[data-step='40'][data-total='40']").first.is_visible()
    page.screenshot(path=str(tmp_path / "train-finished.png"), full_page=True)

    [view] = RunManager(app.runs_dir).list()
    assert view.live_state == "finished" and view.metrics and "loss" in view.metrics[-2]
    shown_loss = float(status.split("loss")[-1].strip())
    assert shown_loss == pytest.approx(next(m["loss"] for m in reversed(view.metrics) if "loss" in m), abs=1e-4)

    page.get_by_role("tab", name="Runs").click()
    table = page.locator("#runs-table")
    playwright_api.expect(table).to_contain_text(view.id)
    playwright_api.expect(table).to_contain_text("finished")


def test_bad_input_is_refused_in_the_page_and_launches_nothing(browser, app):
    page = open_page(browser, app.url)
    dataset = page.locator("#dataset input").first
    dataset.fill("/no/such/data.jsonl")
    dataset.press("Enter")
    page.get_by_text("Advanced").click()
    page.locator("#extra .cm-content").first.fill("max_step: 5")
    # checked as it is typed, before anything is started
    page.locator("#extra-check").get_by_text("did you mean max_steps").wait_for()
    page.locator("#start").click()
    message = page.locator("#train-message")
    message.get_by_text("Nothing was launched").wait_for()
    text = message.inner_text()
    assert "/no/such/data.jsonl" in text and "did you mean max_steps" in text
    assert run_folders(app.runs_dir) == []
    # the form keeps what the user typed, so they can correct it
    assert page.locator("#dataset input").first.input_value() == "/no/such/data.jsonl"


def test_a_failed_run_shows_failed_its_exit_code_and_the_error(browser, app, tmp_path):
    """A model folder whose config.json is fine (so it passes the checks) but whose weights are
    cut short: the worker fails loading it, and the page says so."""
    from test_runs import broken_model

    page = open_page(browser, app.url)
    model = page.locator("#model input").first
    model.fill(str(broken_model(tmp_path)))
    model.press("Enter")
    page.locator("#start").click()
    page.get_by_text("FAILED").first.wait_for(timeout=120_000)
    [view] = RunManager(app.runs_dir).list()
    assert view.live_state == "failed" and view.exit_code not in (0, None)
    playwright_api.expect(page.locator(".run-status").first).to_contain_text(f"exit code {view.exit_code}")
    error = page.locator(".run-error").first
    playwright_api.expect(error).to_contain_text(view.error_text.splitlines()[0][:60])
    playwright_api.expect(error).to_contain_text("Traceback")


def test_an_uploaded_dataset_is_kept_and_a_second_one_of_that_name_does_not_replace_it(browser, app, tmp_path):
    uploads = app.runs_dir / "uploads"
    chat = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    for number, expected in ((1, uploads / "mine.jsonl"), (2, uploads / "mine-1.jsonl")):
        page = open_page(browser, app.url)  # a page of its own: as two people (or two tabs) upload
        page.get_by_text("Dataset: upload, Hub options, preview, column mapping").click()
        dataset = page.locator("#dataset input").first
        (tmp_path / str(number)).mkdir()
        upload = tmp_path / str(number) / "mine.jsonl"
        upload.write_text("".join(json.dumps(chat) + "\n" for _ in range(number)))
        page.locator("#upload input[type=file]").set_input_files(str(upload))
        playwright_api.expect(dataset).to_have_value(str(expected), timeout=30_000)
        assert expected.read_bytes() == upload.read_bytes()
    assert len((uploads / "mine.jsonl").read_text().splitlines()) == 1  # the first upload is unchanged


def test_a_model_that_reaches_the_hub_cache_while_the_page_is_open_is_listed(browser, runs_dir, tmp_path):
    cache = tmp_path / "hub"
    server = App(runs_dir, env={**os.environ, "HF_HUB_CACHE": str(cache)})
    try:
        page = open_page(browser, server.url)
        # then a download lands, laid out as huggingface_hub writes it: blob, snapshot link, ref
        repo, revision = cache / "models--alice--tiny-chat", "0123456789abcdef0123456789abcdef01234567"
        (repo / "blobs").mkdir(parents=True)
        (repo / "blobs" / "c0ffee").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "config.json").symlink_to(repo / "blobs" / "c0ffee")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        page.locator("#model input").first.click()  # opening the list reads the cache again
        page.get_by_role("option", name="alice/tiny-chat").wait_for(timeout=15_000)
    finally:
        server.kill()


def test_run_survives_page_close_and_app_restart_and_stops_from_a_second_browser(browser, runs_dir):
    first_app = App(runs_dir)
    try:
        page = open_page(browser, first_app.url)
        set_number(page, "max_steps", 100_000)
        set_number(page, "logging_steps", 50)
        page.locator("#start").click()
        page.get_by_text("RUNNING").first.wait_for(timeout=120_000)
        page.close()  # closing the browser changes nothing for the run
    finally:
        first_app.kill()  # and neither does the app dying

    [view] = RunManager(runs_dir).list()
    step = view.step
    deadline = time.time() + 60
    while RunManager(runs_dir).view(view.id).step <= step and time.time() < deadline:
        time.sleep(0.5)
    assert RunManager(runs_dir).view(view.id).step > step, "the run stopped progressing with the app gone"

    second_app = App(runs_dir)
    try:
        other = open_page(browser, second_app.url)  # a fresh page follows the run still going
        other.get_by_text("RUNNING").first.wait_for(timeout=30_000)
        assert view.id in other.locator(".run-status").first.inner_text()
        other.locator("#stop").click()
        other.get_by_text("STOPPED").first.wait_for(timeout=60_000)
        playwright_api.expect(other.locator("#train-message")).to_contain_text("none of its processes is left")
    finally:
        second_app.kill()
    assert RunManager(runs_dir).view(view.id).live_state == "stopped"


@pytest.mark.parametrize(("trainer", "steps"), [("dpo", 10), ("kto", 10), ("grpo", 4), ("rloo", 4), ("reward", 10)])
def test_each_trainer_from_the_page(browser, app, trainer, steps):
    entry = trainers.get(trainer)
    page = open_page(browser, app.url)
    page.get_by_label(entry.label).check()
    playwright_api.expect(page.locator("#dataset input").first).to_have_value(entry.sample)
    for field in entry.fields:  # the trainer's own settings show, and only for it
        playwright_api.expect(page.locator(f"#{trainer}-{field.name}")).to_be_visible()
    page.get_by_text("Dataset: upload, Hub options").click()
    page.locator("#check-dataset").click()
    playwright_api.expect(page.locator("#data-report")).to_contain_text(f"Fits {entry.name}")
    set_number(page, "max_steps", steps)
    set_number(page, "logging_steps", 2)
    page.locator("#start").click()
    page.get_by_text("FINISHED").first.wait_for(timeout=180_000)
    [view] = RunManager(app.runs_dir).list()
    assert view.trainer == trainer and view.live_state == "finished" and view.step == steps
    if not entry.chats:  # a reward model: offered for export, not for chat
        page.get_by_role("tab", name="Chat").click()
        page.locator("#chat-target input").first.click()
        playwright_api.expect(page.get_by_role("option", name="builtin:tiny-qwen3")).to_be_visible()
        assert page.get_by_role("option", name=view.id).count() == 0
        page.get_by_role("tab", name="Export").click()
        page.locator("#export-run input").first.click()
        playwright_api.expect(page.get_by_role("option", name=view.id)).to_be_visible()


def test_a_dataset_that_does_not_fit_gets_a_one_click_fix(browser, app, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "What colour is the mascot?", "answer": "Teal."}\n' * 8)
    page = open_page(browser, app.url)
    report = check_dataset_in_page(page, data)
    playwright_api.expect(report).to_contain_text("Does not fit this trainer")
    playwright_api.expect(report).to_contain_text("map question to prompt, answer to completion")
    page.locator("#apply-fix").click()
    playwright_api.expect(report).to_contain_text("Fits SFT")
    set_number(page, "max_steps", 5)
    page.locator("#start").click()
    page.get_by_text("FINISHED").first.wait_for(timeout=120_000)
    [view] = RunManager(app.runs_dir).list()
    assert view.spec["studio"]["column_map"] == {"question": "prompt", "answer": "completion"}


def test_a_two_process_layout_from_the_page(browser, app):
    page = open_page(browser, app.url)
    page.get_by_text("Layout: processes, parallelism, cores").click()
    core_map = page.locator("#core-map")
    core_map.locator(".core").first.wait_for()  # drawn for the opened accordion before nproc changes
    set_number(page, "nproc", 2)
    # the map is redrawn by the server: allow for a machine busy with another test worker's run
    playwright_api.expect(core_map.locator(".core[data-state='r1']")).to_have_count(1, timeout=30_000)
    playwright_api.expect(core_map).to_contain_text("2 of 2 CPU cores for this run", timeout=30_000)
    set_number(page, "max_steps", 10)
    page.locator("#export").click()
    playwright_api.expect(page.locator("#train-message")).to_contain_text("launch.sh")
    exported = sorted(p.name for p in (app.runs_dir / "exports").iterdir())
    assert exported == ["sft-builtin-tiny-qwen3-launch.sh", "sft-builtin-tiny-qwen3-slurm.sh"]
    assert "--nproc-per-node=2" in (app.runs_dir / "exports" / exported[0]).read_text()
    page.locator("#start").click()
    page.get_by_text("FINISHED").first.wait_for(timeout=180_000)
    [view] = RunManager(app.runs_dir).list()
    assert view.world_size == 2 and view.spec["studio"]["cores"] == "0-1"


def test_the_core_map_marks_the_cores_others_hold_and_names_them(browser, app):
    from studio_core import leases

    holder = "20261130-000000-other-abcdef"
    with leases.acquire(app.runs_dir, "cpu", [0], holder=holder, kind="run"):  # as a run's supervisor does
        page = open_page(browser, app.url)
        page.get_by_text("Layout: processes, parallelism, cores").click()
        core_map = page.locator("#core-map")
        playwright_api.expect(core_map.locator(".core[data-state='busy']")).to_have_count(1, timeout=30_000)
        playwright_api.expect(core_map.locator(".core[data-core='1']")).to_have_attribute("data-state", "r0")
        cores = page.locator("#cores input, #cores textarea").first
        cores.fill("0")
        cores.press("Tab")
        playwright_api.expect(core_map).to_contain_text(f"core 0 is held by run {holder}", timeout=30_000)
        page.locator("#preview").click()  # and the preview refuses it the same way
        playwright_api.expect(page.locator("#train-message")).to_contain_text(f"core 0 is held by run {holder}")


def test_shape_forecast_suggestion_and_live_compilations(browser, app, tmp_path):
    page = open_page(browser, app.url)
    report = page.locator("#forecast-report")
    page.locator("#forecast").click()
    report.get_by_text("distinct batch shape").wait_for(timeout=120_000)
    assert "padding waste" in report.inner_text()
    assert page.locator("#length-histogram").is_visible()
    # the best suggestion goes into "Other TRL settings" and the forecast is made again with it
    suggestions = page.locator("#suggestions")
    best = suggestions.locator("label").first.inner_text()
    assert "shape(s)" in best and "->" in best
    page.locator("#apply-suggestion").click()
    page.get_by_text("Advanced").click()
    setting = best.split(":")[0].strip()  # e.g. "packing" or "pad_to_multiple_of"
    playwright_api.expect(page.locator("#extra .cm-content")).to_contain_text(setting)
    shapes = int(best.split("->")[1].split("shape")[0])
    report.get_by_text(f"{shapes} distinct batch shape").wait_for(timeout=120_000)

    # a compiled run: its compilations show as they happen, with totals and a timeline
    editor = page.locator("#extra .cm-content").first
    editor.fill(editor.inner_text() + "\ntorch_compile: true\ntorch_compile_backend: eager")
    page.locator("#extra-check").get_by_text("recognised").wait_for()
    set_number(page, "max_steps", 6)
    page.locator("#start").click()
    compiles = page.locator(".compiles .compile-totals")
    compiles.get_by_text("batch shape(s) reached the model").wait_for(timeout=120_000)
    page.get_by_text("FINISHED").first.wait_for(timeout=120_000)
    assert page.locator(".compile-timeline .compile-span").count() > 0
    text = compiles.inner_text()
    assert f"{shapes} batch shape(s)" in text and "compilation(s)" in text
    page.screenshot(path=str(tmp_path / "compiles.png"), full_page=True)
    if os.environ.get("STUDIO_SCREENSHOTS"):
        page.screenshot(path=os.environ["STUDIO_SCREENSHOTS"] + "/compiles.png", full_page=True)
    [view] = RunManager(app.runs_dir).list()
    assert len({tuple(e["shape"]) for e in view.shapes}) == shapes


def test_chat_with_a_trained_run_side_by_side_then_unload(browser, app):
    from studio_core.hardware import cpu_hardware
    from studio_core.spec import RunSpec

    manager = RunManager(app.runs_dir)
    run = manager.start(RunSpec.load(ROOT / "recipes" / "tiny-sft.yaml"), cpu_hardware())
    wait_until_finished(manager, run.id)

    page = open_page(browser, app.url)
    page.get_by_role("tab", name="Chat").click()
    target = page.locator("#chat-target input").first
    target.fill(run.id)
    target.press("Enter")
    page.locator("#chat-load").click()
    page.locator("#chat-status").get_by_text(re.compile(r"^Loaded ")).wait_for(timeout=120_000)
    page.locator("#chat-compare input").check()
    box = page.locator("#chat-input textarea").first
    box.fill("What is the name of the studio cat?")
    box.press("Enter")
    tuned, base = page.locator("#chat-tuned"), page.locator("#chat-base")
    playwright_api.expect(tuned).to_contain_text("The studio cat is called Pixel.", timeout=60_000)
    page.locator("#chat-shapes").get_by_text("distinct input shapes").wait_for(timeout=60_000)
    playwright_api.expect(base).to_contain_text("What is the name of the studio cat?")
    page.locator("#chat-unload").click()
    page.locator("#chat-status").get_by_text(re.compile(r"^Unloaded: ")).wait_for(timeout=60_000)


def test_export_and_push_to_the_hub_from_the_page(browser, runs_dir):
    from hub_standin import HubStandIn
    from studio_core.hardware import cpu_hardware
    from studio_core.spec import RunSpec

    token = "hf_browser_push_token_0123456789"
    manager = RunManager(runs_dir)
    run = manager.start(RunSpec.load(ROOT / "recipes" / "tiny-sft.yaml").with_overrides(["max_steps=20"]),
                        cpu_hardware())
    with HubStandIn(tokens={token: {"user": "alice", "orgs": []}}) as standin:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
        server = App(runs_dir, env=env | {"HF_ENDPOINT": standin.url, "HF_HUB_DISABLE_XET": "1"})
        try:
            wait_until_finished(manager, run.id)
            page = open_page(browser, server.url)
            page.get_by_role("tab", name="Export").click()
            choice = page.locator("#export-run input").first
            choice.click()
            page.get_by_role("option", name=run.id).click()
            playwright_api.expect(page.locator("#export-folder textarea, #export-folder input").first
                                  ).to_have_value(re.compile(re.escape(run.id)))
            page.locator("#export-run-button").click()
            page.locator("#export-status").get_by_text("Exported the full model").wait_for(timeout=120_000)
            page.locator("#push-repo input, #push-repo textarea").first.fill("alice/from-the-browser")
            page.locator("#push-token input, #push-token textarea").first.fill(token)
            page.locator("#push").click()
            page.locator("#push-status").get_by_text("Pushed (private)").wait_for(timeout=120_000)
            link = page.locator("#push-status a").first.get_attribute("href")
            assert link == f"{standin.url}/alice/from-the-browser"
            folder = runs_dir / "exports" / run.id
            local = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
            assert standin.repos["alice/from-the-browser"]["files"] == local
        finally:
            server.kill()
        # the typed token went nowhere: not in the runs folder (runs, exports), not in the app's log
        for path in [*runs_dir.rglob("*"), runs_dir.parent / f"app-{server.port}.log"]:
            assert not path.is_file() or token.encode() not in path.read_bytes(), path


def test_stop_and_save_then_resume_from_the_page(browser, app):
    page = open_page(browser, app.url)
    set_number(page, "max_steps", 100_000)
    set_number(page, "logging_steps", 50)
    page.locator("#start").click()
    page.get_by_text("RUNNING").first.wait_for(timeout=120_000)
    page.locator("#stop-save").click()
    page.get_by_text("STOPPED").first.wait_for(timeout=120_000)
    resume_point = page.locator(".resume-point")
    playwright_api.expect(resume_point).to_contain_text("Can resume from step")
    step = int(re.search(r"step (\d+)", resume_point.inner_text()).group(1))
    page.locator("#resume").click()
    page.locator("#train-message").get_by_text(f"resumed from step {step}").wait_for(timeout=60_000)
    page.get_by_text("RUNNING").first.wait_for(timeout=120_000)
    progress = page.locator(".run-progress").first
    playwright_api.expect(progress).not_to_have_attribute("data-step", str(step), timeout=60_000)
    assert int(progress.get_attribute("data-step")) > step  # the step count goes on
    page.locator("#stop").click()
    page.get_by_text("STOPPED").first.wait_for(timeout=60_000)


def test_a_stray_prompt_beside_messages_gets_a_one_click_keep_columns_fix(browser, app, tmp_path):
    # As HuggingFaceH4/ultrachat_200k: a string `prompt` beside `messages` makes TRL read prompts
    chat = [{"role": "user", "content": "What colour is the mascot?"}, {"role": "assistant", "content": "Teal."}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": chat[0]["content"], "messages": chat}) + "\n" for _ in range(8)))
    page = open_page(browser, app.url)
    report = check_dataset_in_page(page, data)
    playwright_api.expect(report).to_contain_text("Does not fit this trainer")
    playwright_api.expect(report).to_contain_text("prompt beside messages")
    playwright_api.expect(report).to_contain_text("Suggested fix: keep only messages")
    page.locator("#apply-fix").click()
    keep = page.locator("#keep_columns textarea, #keep_columns input").first
    playwright_api.expect(keep).to_have_value("messages")
    playwright_api.expect(report).to_contain_text("Fits SFT")
    page.locator("#check-dataset").click()  # and checked again by hand: clean, nothing left to apply
    playwright_api.expect(report).to_contain_text("Fits SFT")
    playwright_api.expect(page.locator("#apply-fix")).to_be_hidden()
    assert "Does not fit" not in report.inner_text()


def test_learning_rate_starts_at_trls_default_for_another_model_unless_typed(browser, app):
    from studio_core.trl_schema import trainer_fields

    def shown(trainer_text: str) -> float:
        playwright_api.expect(box).to_contain_text(trainer_text)
        return float(page.locator("#learning_rate input").first.input_value())

    page = open_page(browser, app.url)
    box = page.locator("#learning_rate")
    assert shown("suit the built-in tiny model") == 2e-3  # seconds on a CPU
    model = page.locator("#model input").first
    model.fill("Qwen/Qwen3-0.6B")
    model.press("Enter")
    assert shown("TRL's default for SFT (SFTConfig) is 2e-05;") == trainer_fields("sft")["learning_rate"]["default"]
    page.get_by_label("DPO (preference pairs)").check()
    assert shown("TRL's default for DPO (DPOConfig) is 1e-06;") == trainer_fields("dpo")["learning_rate"]["default"]
    set_number(page, "learning_rate", 5e-5)  # the user's own value stays
    page.get_by_label("GRPO (online RL with reward functions)").check()
    assert shown("your value; TRL's default for GRPO (GRPOConfig) is 1e-06") == 5e-5
