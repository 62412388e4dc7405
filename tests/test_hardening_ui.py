"""Issue 29, what a new user met clicking through every tab: numbers that mean what they appear
to mean. The texts and values the page shows, built from real run folders (events written with
the project's own event constructors) and read back through the run manager, as the page does:

- the compile panel: Dynamo's graph id spelled out (it read "graph 4/2"), what the counts count,
  "so far" only while the run goes;
- a LoRA run's loss that stays near a uniform guess while its tokens come out right, explained;
- one format for a loss (GRPO's -0.0 read "0" in one place and "-0.0000" in another);
- plots hidden until they have data, limits around a lone point;
- the Hub check: one verdict for the Doctor tab and `launch.py doctor` in the same environment;
- element ids unique in the page (#slurm-box was there twice).
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from hub_standin import HubStandIn
from studio_core.doctor import doctor
from studio_core.runs import history
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir import events as ev
from studio_core.runs import view as view_texts
from studio_core.runs.manager import RunManager

REPO = Path(__file__).resolve().parent.parent
T0 = 1_760_000_000.0
RUN = "20260101-120000-tiny-sft-abc123"
LORA_SPEC = "studio: {trainer: sft}\nmodel_name_or_path: builtin:tiny-qwen3\ndataset_name: builtin:qa\nuse_peft: true\n"


def write_run(runs: Path, events: list[dict], spec: str = LORA_SPEC, run_id: str = RUN) -> Path:
    """A run folder with its spec and these events, each `time` seconds after T0."""
    run_dir = runs / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.yaml").write_text(spec)
    for event in events:
        ev.append(run_dir / "events.jsonl", {**event, "time": T0 + event["time"]})
    return run_dir


def at(seconds: float, event: dict) -> dict:
    return {**event, "time": seconds}


def going(run_dir: Path) -> None:
    """The run's supervisor is this process (pid and start time): the local backend finds it alive."""
    me = psutil.Process()
    (run_dir / "supervisor.json").write_text(json.dumps({"pid": me.pid, "create_time": me.create_time()}))


# --- the compile panel ------------------------------------------------------------------------
# A compiled run's events as the tiny SFT compiled with aot_eager writes them (one frame shown):
# frame 4 compiles again for each new batch shape, its forward then its backward.
COMPILED = [at(0, ev.status("starting")), at(1, ev.status("running", world_size=1, max_steps=8)),
            at(2, ev.shape([4, 37], 1)),
            at(2, ev.compile_start("0/0", "forward", 1)), at(3, ev.compile_end("0/0", "forward", 1, 1.0)),
            at(3, ev.compile_start("4/0", "forward", 1)), at(12, ev.compile_end("4/0", "forward", 1, 9.0)),
            at(12, ev.compile_start("4/0", "backward", 1)), at(13, ev.compile_end("4/0", "backward", 1, 1.0)),
            at(14, ev.shape([4, 34], 2)),
            at(14, ev.compile_start("4/1", "forward", 2)), at(24, ev.compile_end("4/1", "forward", 2, 10.0)),
            at(24, ev.compile_start("4/1", "backward", 2)), at(25, ev.compile_end("4/1", "backward", 2, 1.0)),
            at(26, ev.shape([4, 33], 6)),
            at(26, ev.compile_start("4/2", "forward", 6)), at(34, ev.compile_end("4/2", "forward", 6, 8.0)),
            at(34, ev.compile_start("4/2", "backward", 6))]


@pytest.mark.fast
def test_the_compile_panel_says_what_it_counts_and_so_far_only_while_the_run_goes(tmp_path):
    from app import run_panel

    run_dir = write_run(tmp_path / "runs", COMPILED)
    going(run_dir)
    view = RunManager(tmp_path / "runs").view(RUN)
    assert view.active
    shown = run_panel.compiles_html(view)
    # Dynamo's "4/2" is frame 4's third compilation, not "graph 4 of 2"
    assert "graph 4/2" not in shown and "Compiling now: compilation 7 of this run, the backward pass of code frame " \
        "4, its compilation 3 (Dynamo&#x27;s id 4/2)" in shown
    totals = view_texts.compile_totals_text(view)
    assert totals.startswith("6 compilation(s) (4 forward, 2 backward; 2 code frame(s)) in ")
    assert "3 batch shape(s) reached the model" in totals and "of the run's time so far)" in totals

    (run_dir / "supervisor.json").unlink()
    for event in (at(35, ev.compile_end("4/2", "backward", 6, 1.0)), at(40, ev.status("finished", exit_code=0))):
        ev.append(run_dir / "events.jsonl", {**event, "time": T0 + event["time"]})
    ended = RunManager(tmp_path / "runs").view(RUN)
    assert ended.live_state == "finished"
    shown = run_panel.compiles_html(ended)
    assert "Compiling now" not in shown and "7 compilation(s) (4 forward, 3 backward; 2 code frame(s))" in shown
    assert "of the run's time)" in view_texts.compile_totals_text(ended) and "so far" not in shown
    odd = view_texts.compiling_text("weird", "forward", 1)  # an id not of Dynamo's form is shown as it is
    assert odd.endswith("the forward pass of graph weird (Dynamo's id weird)")


# --- a loss near a uniform guess beside right answers ------------------------------------------
# The last metrics of recipes/tiny-sft-lora.yaml and recipes/tiny-sft.yaml (300 steps, measured).
LORA_END = {"loss": 5.756, "mean_token_accuracy": 0.9659, "entropy": 6.896, "learning_rate": 6.667e-06}
FULL_END = {"loss": 0.1283, "mean_token_accuracy": 0.9659, "entropy": 0.471, "learning_rate": 6.667e-06}


@pytest.mark.fast
def test_a_high_loss_beside_right_tokens_is_explained_on_the_run_page_and_beside_its_scores(tmp_path):
    from app import run_panel, runs_tab

    runs = tmp_path / "runs"
    ended = [at(0, ev.status("starting")), at(1, ev.status("running", max_steps=300)),
             at(5, ev.metrics(300, 100.0, LORA_END)), at(6, ev.status("finished", exit_code=0))]
    lora = write_run(runs, ended)
    view = RunManager(runs).view(RUN)
    note = history.loss_note(view)
    assert note and "Loss 5.756 with 97% of tokens predicted right" in note and "about 0.3% probability" in note
    assert "with LoRA the base model's output layer stays frozen" in note
    assert note in run_panel.status_markdown(view)
    # beside the evaluation's scores too, where exact_match 0.83 met the loss 5.8
    summary = lora / "eval" / "20260101-130000" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"time": T0 + 100, "data": "builtin:qa", "split": "train", "rows": 12,
                                   "metrics": ["exact_match"], "results": {"tuned": {"exact_match": 0.8333}}}))
    shown = runs_tab.evaluations_text(RunManager(runs), RUN)
    assert "exact_match 0.8333" in shown and note in shown

    full = [*ended[:2], at(5, ev.metrics(300, 100.0, FULL_END)), ended[3]]
    write_run(runs, full, spec="studio: {trainer: sft}\nmodel_name_or_path: builtin:tiny-qwen3\n",
              run_id=RUN[:-1] + "d")
    healthy = RunManager(runs).view(RUN[:-1] + "d")
    assert history.loss_note(healthy) is None and "predicted right" not in run_panel.status_markdown(healthy)


# --- one format for a loss --------------------------------------------------------------------
@pytest.mark.fast
def test_a_loss_reads_the_same_in_the_status_line_the_runs_table_and_compare(tmp_path):
    from app import compare, run_panel, runs_tab

    from studio_core.runs.view import format_loss

    assert [format_loss(x) for x in (-0.0, 0.0, 5.75612, 0.12834, -1.5e-9, None)] == \
        ["0", "0", "5.756", "0.1283", "-1.5e-09", ""]
    runs = tmp_path / "runs"
    for run_id, loss in ((RUN, -0.0), (RUN[:-1] + "d", 5.75612)):  # GRPO ends at -0.0
        write_run(runs, [at(0, ev.status("starting")), at(1, ev.status("running", max_steps=2)),
                         at(2, ev.metrics(2, 1.0, {"loss": loss, "learning_rate": 1e-6})),
                         at(3, ev.status("finished", exit_code=0))], run_id=run_id)
    manager = RunManager(runs)
    views = [manager.view(RUN), manager.view(RUN[:-1] + "d")]
    table = runs_tab.runs_table(views).set_index("run")["final loss"]
    assert dict(table) == {RUN: "0", RUN[:-1] + "d": "5.756"}
    assert " · loss 0" in run_panel.status_markdown(views[0]) and "-0.0" not in run_panel.status_markdown(views[0])
    assert " · loss 5.756" in run_panel.status_markdown(views[1])
    _, last = compare.curves(views, "loss")
    assert f"| `{RUN}` | 0 | 2 |" in last and f"| `{RUN[:-1]}d` | 5.756 | 2 |" in last


@pytest.mark.fast
def test_compares_legend_labels_fit_the_legend_and_are_all_different():
    """Issue 47: Vega cut the ids of one sweep's runs to the same text (the browser test shows it drawn)."""
    from app import compare

    short, *sweep = ["tiny-sft-abc123", "20261206-103855-sft-builtin-tiny-qwen3-24ef7f",
                     "20261206-103855-sft-builtin-tiny-qwen3-9a1b2c"]
    assert compare.legend_labels([short, *sweep]) == {short: short, sweep[0]: "…iltin-tiny-qwen3-24ef7f",
                                                      sweep[1]: "…iltin-tiny-qwen3-9a1b2c"}
    same_end = [f"2026010{n}-120000-{'x' * 40}" for n in range(1, 4)]  # not the studio's ids: numbered
    labels = compare.legend_labels(same_end)
    assert list(labels.values()) == [f"{n} …{'x' * 21}" for n in range(1, 4)]
    assert all(len(label) <= compare.LEGEND_CHARS for label in labels.values())


# --- plots: none before data, sensible axes for one point --------------------------------------
@pytest.mark.fast
def test_plots_are_hidden_until_they_have_data_and_label_a_lone_point_briefly(tmp_path):
    import gradio as gr
    from app import run_panel

    with gr.Blocks():
        panel = run_panel.RunPanel()
    manager = RunManager(tmp_path / "runs")
    nothing = panel.render(manager, None)
    for plot in (panel.loss, panel.lr, panel.hardware.process_plots):
        assert nothing[plot]["visible"] is False, plot  # not an untitled empty frame
    assert panel.loss.visible is False and panel.lr.visible is False  # nor before the first render
    # every plot labels its axes in d3 formats: a lone point reads "6.889" by "1", not "6.889331" by "1.000000"
    plots = [panel.loss, panel.lr, *panel.trainer_plots, panel.hardware.cpu, panel.hardware.rss]
    # steps whole ("~f", issue 47: not "1e+2"), seconds and values briefly
    assert {(p.x_axis_format, p.y_axis_format) for p in plots} == {("~f", ".4~g"), ("~g", ".4~g")}

    write_run(tmp_path / "runs", [at(0, ev.status("starting")), at(1, ev.status("running", max_steps=300)),
                                  at(2, ev.metrics(1, 0.01, {"loss": 6.889331, "learning_rate": 0.002})),
                                  at(3, ev.status("finished", exit_code=0))])
    one = panel.render(manager, RUN)
    assert one[panel.loss]["visible"] and list(one[panel.loss]["value"]["loss"]) == [6.889331]
    assert one[panel.lr]["visible"] and one[panel.hardware.process_plots]["visible"] is False  # no hardware sample
    sample = {"cpu_percent": 50.0, "rss_bytes": 2**30, "processes": 2}
    ev.append(tmp_path / "runs" / RUN / "events.jsonl", ev.hardware(sample))
    shown = panel.render(RunManager(tmp_path / "runs"), RUN)  # one sample: in the note, no plot of one point
    assert shown[panel.hardware.process_plots]["visible"] is False and "CPU 50 %" in shown[panel.hardware.note]
    ev.append(tmp_path / "runs" / RUN / "events.jsonl", ev.hardware(sample))
    assert panel.render(RunManager(tmp_path / "runs"), RUN)[panel.hardware.process_plots]["visible"] is True


# --- the Hub check: one rule for the Doctor tab and the CLI -------------------------------------
class _NotTheHub(http.server.BaseHTTPRequestHandler):
    """What a wrong HF_ENDPOINT or a proxy's error page answers: 404 to everything."""

    def do_HEAD(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, format, *args):
        """Quiet."""


def _cli_hub_line(env: dict) -> str:
    """The hub check's line as `launch.py doctor` gets it: a new process that reads its
    environment when it imports huggingface_hub."""
    code = "from studio_core.doctor import doctor; print(doctor.hub().line())"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "TRANSFORMERS_OFFLINE"},
                               "PYTHONPATH": str(REPO), **env}, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _tab_hub_row(env: dict, monkeypatch) -> tuple[doctor.Check, str]:
    """The hub check as the Doctor tab gets it, in this (the app's) process with the same
    environment: huggingface_hub read it at import, so its constants are set as it would have."""
    from app import doctor_tab

    from huggingface_hub import constants

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", env["HF_HUB_OFFLINE"] == "1")
    monkeypatch.setattr(constants, "ENDPOINT", env["HF_ENDPOINT"])
    check = doctor.hub()
    return check, doctor_tab.table([check], running=False)


@pytest.mark.fast
def test_the_doctor_tab_and_the_cli_give_the_hub_the_same_verdict_in_the_same_environment(monkeypatch):
    from app import doctor_tab

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotTheHub)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with HubStandIn() as hub:
            environments = {"not the Hub": {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
                                            "HF_HUB_OFFLINE": "0"},
                            "the Hub": {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"},
                            "offline": {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}}
            verdicts = {}
            for name, env in environments.items():
                cli = _cli_hub_line(env)
                with monkeypatch.context() as patch:
                    check, table = _tab_hub_row(env, patch)
                assert cli.splitlines()[0] == check.line().splitlines()[0], name  # the same line, word for word
                assert ("**FAIL** | hub" in table) == (not check.ok) == cli.startswith("FAIL"), name
                verdicts[name] = check
    finally:
        server.shutdown()
        server.server_close()
    wrong = verdicts["not the Hub"]
    assert not wrong.ok and "answers HTTP 404, not as the Hub does" in wrong.found and "HF_ENDPOINT" in wrong.fix
    assert verdicts["the Hub"].ok and "answers (HTTP 200)" in verdicts["the Hub"].found
    assert verdicts["offline"].ok and "offline (HF_HUB_OFFLINE=1)" in verdicts["offline"].found
    # and the tab ends on the CLI's own verdict
    assert doctor_tab.table([wrong], running=False).endswith(f"**{doctor.verdict([wrong]).capitalize()}.**")


# --- element ids --------------------------------------------------------------------------------
@pytest.mark.fast
def test_every_element_id_in_the_page_is_unique(tmp_path):
    import gradio as gr

    from app.main import build_app

    demo = build_app(tmp_path / "runs", cpu_hardware())
    blocks = list(demo.blocks.values())
    ids = [b.elem_id for b in blocks if getattr(b, "elem_id", None)]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    # Gradio 6 writes a Group's elem_id on two nested elements (#slurm-box was in the page twice)
    assert [b.elem_id for b in blocks if isinstance(b, gr.Group) and b.elem_id] == []


@pytest.mark.fast
def test_the_form_keeps_a_float_lora_alpha_and_writes_a_whole_one_whole():
    """PEFT takes lora_alpha as a float scale; the form rounded it to a whole number."""
    from app.train_form import form_values, spec_from_form
    from studio_core.recipe.spec import RunSpec

    spec = RunSpec.load(Path(__file__).resolve().parent.parent / "recipes" / "tiny-sft-lora.yaml")
    values = form_values(spec, trackers=["none"]) | {"target": "this machine", "lnc": 2}
    assert spec_from_form(values | {"lora_alpha": 16.5}).args["lora_alpha"] == 16.5
    whole = spec_from_form(values | {"lora_alpha": 32.0}).args["lora_alpha"]
    assert whole == 32 and isinstance(whole, int)
