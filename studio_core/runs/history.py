"""Run history: filtering and sorting runs, comparing them (metric curves and settings),
cloning one's settings, deleting a run with its files, the runs chat and export can use, and
what a run's loss says when its tokens come out right anyway (loss_note).

Everything is read from the runs folder through the run manager, as the Runs tab and the
command line do; nothing here imports Gradio.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil

from studio_core.machine import leases
from studio_core.training import plan
from studio_core.rundir import folder
from studio_core.rundir.events import ACTIVE_STATES
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView, format_loss
from studio_core.recipe.spec import RunSpec, trackers

CHAT_TASK = "text-generation"  # a saved model that answers prompts (trainers.Trainer.task)
SORTS = ("newest first", "oldest first", "final loss")
NOT_SET = "(not set)"
NOT_METRICS = {"type", "time", "step", "epoch"}  # event fields that are not a logged metric


class RunActiveError(RuntimeError):
    """A run that cannot be deleted (or otherwise changed) while it is going."""


# --- filtering and sorting --------------------------------------------------------------
def filter_runs(views: list[RunView], state: str | None = None, trainer: str | None = None,
                model: str | None = None) -> list[RunView]:
    """The runs matching every filter given; None (or "all") matches anything."""
    def keep(value, wanted):
        return wanted in (None, "", "all") or value == wanted

    return [v for v in views if keep(v.live_state, state) and keep(v.trainer, trainer) and keep(v.model, model)]


def sort_runs(views: list[RunView], by: str = "newest first") -> list[RunView]:
    """By first start (RunView.first_start: a resume does not move a run; the run id, which
    begins with it, between runs started in the same moment), or by final loss, lowest first
    (runs without a loss last)."""
    if by == "newest first":
        return sorted(views, key=lambda v: (v.created, v.id), reverse=True)
    if by == "oldest first":
        return sorted(views, key=lambda v: (v.created, v.id))
    if by == "final loss":
        return sorted(views, key=lambda v: (v.last_loss() is None, v.last_loss() or 0.0, -v.created))
    raise ValueError(f"sort by {by!r}: choose one of {', '.join(SORTS)}")


# --- comparing --------------------------------------------------------------------------
def flatten(data: dict, prefix: str = "") -> dict:
    """{"studio": {"nproc": 2}} -> {"studio.nproc": 2}; lists stay values."""
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


def _text(value) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def settings_diff(specs: dict[str, dict]) -> list[list[str]]:
    """Rows [setting, value in run 1, value in run 2, ...] for the settings whose values differ
    between the runs (a setting one run lacks shows as "(not set)"), keys flattened with dots
    (`studio.nproc`, `model_init_kwargs.dtype`), in the order the spec files list them."""
    flat = {run_id: flatten(spec or {}) for run_id, spec in specs.items()}
    keys = list(dict.fromkeys(key for values in flat.values() for key in values))
    rows = []
    for key in keys:
        values = [values.get(key, NOT_SET) for values in flat.values()]
        texts = [NOT_SET if value is NOT_SET else _text(value) for value in values]
        if len(set(texts)) > 1:
            rows.append([key, *texts])
    return rows


def metric_names(views: list[RunView]) -> list[str]:
    """The numeric metrics every one of these runs logged, loss and learning rate first."""
    if not views:
        return []
    shared = set.intersection(*({k for m in v.metrics for k, value in m.items() if k not in NOT_METRICS
                                 and isinstance(value, (int, float)) and not isinstance(value, bool)}
                                for v in views))
    first = [name for name in ("loss", "learning_rate") if name in shared]
    return first + sorted(shared - set(first))


def metric_curves(views: list[RunView], name: str) -> list[dict]:
    """Rows {run, step, value} of one metric for each run, to overlay in one plot."""
    return [{"run": v.id, "step": m["step"], "value": m[name]} for v in views for m in v.metrics
            if isinstance(m.get(name), (int, float)) and "step" in m]


# --- cloning ----------------------------------------------------------------------------
def clone_spec(manager: RunManager, run_id: str) -> RunSpec:
    """The run's settings to run it again: its spec.yaml less what the planner added for this
    machine (listed in launch.json; the planner adds it again) and less the cores the run
    was given (a clone takes the next free ones)."""
    view = manager.view(run_id)
    if view.spec_problem:
        raise KeyError(f"run {run_id} cannot be cloned: its {folder.SPEC} {view.spec_problem}")
    spec = RunSpec.load(view.dir / folder.SPEC)
    applied = view.launch().get("applied", [])
    args = dict(spec.args)
    for key, *_ in applied:
        top, _, nested = key.partition(".")
        if not nested:
            args.pop(top, None)
        elif isinstance(args.get(top), dict) and nested in args[top]:
            args[top] = {k: v for k, v in args[top].items() if k != nested}
            if not args[top]:
                del args[top]
    spec.args = args
    spec.layout.cores = None
    return spec


# --- deleting ---------------------------------------------------------------------------
def delete_run(manager: RunManager, run_id: str) -> int:
    """Delete the run's folder and everything in it; return the bytes freed. Refused (with
    RunActiveError naming the state) while the run is starting or running. The core leases
    (machine/leases.py; an older studio's in <runs dir>/.leases) are not the run's files."""
    with leases.choosing(manager.runs_dir):  # no run starts (or resumes) while we decide
        view = manager.view(run_id)  # KeyError for an unknown run
        state = view.live_state
        if state in ACTIVE_STATES:
            raise RunActiveError(f"run {run_id} is {state}: stop it first (Stop, or "
                                 f"`python launch.py stop {run_id}`); nothing was deleted")
        if view.backend.alive(view.dir):
            raise RunActiveError(f"run {run_id} is {state} but its processes are still ending: try again "
                                 "in a moment; nothing was deleted")
        size = folder.run_size(view.dir)
        doomed = manager.runs_dir / f"{folder.DELETING}{run_id}"  # out of every listing from now on
        view.dir.rename(doomed)
    shutil.rmtree(doomed)
    return size


# --- experiment tracking ----------------------------------------------------------------
TENSORBOARD_PORT = 6006  # TensorBoard's own default; the studio itself is on 7860


def tracking_hint(view: RunView) -> str | None:
    """How to open the run's experiment tracking (TRL's report_to), one markdown line per tracker,
    or None when it has none. The folders are named from where the run folder is now (it may have
    been moved); a run made before the studio put them in its folder is pointed where it wrote."""
    names = trackers(view.spec.get("report_to", "none"))
    env = view.launch().get("env", {})
    lines = []
    if "tensorboard" in names:
        logdir = (view.dir / plan.TENSORBOARD_DIR if "TENSORBOARD_LOGGING_DIR" in env
                  else view.dir / folder.OUTPUT / "runs")  # transformers 5's own <output_dir>/runs/<date>_<host>
        url = f"http://localhost:{TENSORBOARD_PORT}"
        lines.append(f"TensorBoard: `{shlex.join(['tensorboard', '--logdir', str(logdir), '--port', str(TENSORBOARD_PORT)])}`"
                     f", then open [{url}]({url})")
    if "trackio" in names:
        project = shlex.quote(str(view.spec.get("project", "huggingface")))
        if "TRACKIO_DIR" in env:
            where = f"TRACKIO_DIR={shlex.quote(str(view.dir / plan.TRACKIO_DIR))} "
        else:  # logged to Trackio's own folder, shared by every run that did so
            where = ""
        lines.append(f"Trackio: `{where}trackio show --project {project}` (it prints the dashboard's address)")
    return "  \n".join(lines) or None


def runs_with_a_model(manager: RunManager, chats: bool = False) -> list[str]:
    """The runs that saved a model or adapter (finished runs), newest first: what export can use;
    with `chats`, only those whose model answers prompts (what chat can use: a reward model
    scores texts instead)."""
    found = []
    for view in manager.list():  # newest first
        info = view.output_info()
        if info and (not chats or info.get("task", CHAT_TASK) == CHAT_TASK):  # older runs all chat
            found.append(view.id)
    return found


# --- what a loss says ---------------------------------------------------------------------
# A run whose share of right tokens is this many times the probability it gives them on average
# (exp(-loss): their geometric mean) ranks the right token first without being sure of it. In a
# healthy run the two are close (the tiny full SFT ends at 0.97 and 0.88); the tiny LoRA SFT ends
# at 0.97 and 0.003, with its output layer frozen at the base model's small random weights.
CONFIDENCE_GAP = 20


def loss_note(view: RunView) -> str | None:
    """One sentence for a run whose loss stays high while its tokens (and so its answers) come
    out right, saying why the two disagree; None when they agree or the trainer logs no token
    accuracy (TRL's SFT logs `mean_token_accuracy` beside the loss)."""
    last = next((m for m in reversed(view.metrics) if _number(m.get("loss")) and
                 _number(m.get("mean_token_accuracy"))), None)
    if last is None:
        return None
    loss, accuracy = float(last["loss"]), float(last["mean_token_accuracy"])
    probability = math.exp(-loss)
    if accuracy < 0.5 or probability * CONFIDENCE_GAP > accuracy:
        return None
    lora = ("; with LoRA the base model's output layer stays frozen, which can keep a small model's outputs "
            "this flat") if view.spec.get("use_peft") else ""
    return (f"Loss {format_loss(loss)} with {accuracy:.0%} of tokens predicted right: the model ranks the right "
            f"token first but gives it only about {probability:.1%} probability on average (exp(-loss)), so its "
            f"answers (and exact_match) come out right while the loss stays high{lora}.")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
