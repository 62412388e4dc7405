"""Sweeps: one recipe, a grid of values, a run for each combination.

    launch.py sweep recipes/tiny-sft.yaml --grid learning_rate=1e-4,3e-4 --grid lora_r=8,16
    launch.py sweep recipes/tiny-sft.yaml --grid 'lora_target_modules=[[q_proj, v_proj], [q_proj, k_proj, v_proj]]'

A grid item is `KEY=V1,V2` or, for values that hold commas (lists, text), a YAML list `KEY=[V1, V2]`;
each value is YAML as --set reads it, and a value given twice (as it reads: 1e-3 and 0.001) is
refused, as it would make two identical runs. Every run of the grid is checked and planned before
any starts: an unknown key, a value of the wrong type, a run that would not fit in a core's memory,
more runs than MAX_RUNS without `yes`, runs on several backends, runs its backend cannot take as one
group (Slurm: runs whose job options differ) or, with `evaluate`, a run whose evaluation would not
find what it needs (evaluate/evaluation.py's check, handed in) refuse the whole sweep, naming the
combination. Then:
- Runs on this machine start like Start with the queue on (runs/queue.py): as many at once as
  there are free cores for them (at most `parallel`), the rest wait in order.
- Runs on a backend that takes several runs as one group (its `group`: Slurm's job array) go as
  one, `parallel` its throttle; nothing here names the backend.
- Runs on any other backend (Ray) are submitted one by one and wait in its own queue.
They share the backend's compile cache (machine/compile_cache.py), so a shape one run compiled is
a cache hit for the next. With the recipe's precompile on, the runs whose graphs are the same
(they differ only in SAME_GRAPHS keys) share one precompile: the first of them precompiles, the
others are held in the queue until it has (queue.held_back), then find every shape in the cache.
A failed run does not stop the others. With `evaluate`, each run is evaluated when it has
finished (runs/sweep_eval.py); `wait_evaluations` waits for them.

A sweep is recorded in `<runs dir>/sweeps/<sweep id>.json` (its recipe, grid, settings, each
run's id, values and the run whose precompile it shares, and a group's {id, label}); `table()`
reads its runs back, best first (`ranking`: by their evaluations, else their last eval_loss, else
their training loss), the failed ones last with why.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from studio_core import backends
from studio_core.machine.hardware import Hardware
from studio_core.recipe.spec import RunSpec, SpecError, read_yaml
from studio_core.recipe.validate import SECRET_FIELDS, holds_token, secret_message
from studio_core.rundir import folder
from studio_core.runs import queue, sweep_eval
from studio_core.runs.sweep_eval import SWEEPS, unevaluated  # unevaluated: the runs --wait waits for
from studio_core.runs.manager import RunManager, RunNotFound

MAX_RUNS = 16  # more need `yes`: each run is a training (and on Neuron, maybe a compilation)
RUN_NAME_MAX = 64  # recipe/validate.py's longest run_name
EVAL_LIMIT = sweep_eval.DEFAULT_LIMIT  # rows of each run's evaluation unless the sweep says (the app and CLI show it)


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`KEY=V1,V2` items, or `KEY=[V1, V2]` (a YAML or JSON list: values that hold commas, lists
    themselves) -> {key: [each value as written]}; SpecError naming every malformed item, a key
    given twice, a value that is not YAML or a value given twice (two identical runs)."""
    grid: dict[str, list[str]] = {}
    problems = []
    for item in items:
        key, sep, written = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"--grid {_shown(item)}: write it as {GRID_FORMS}")
        elif key in grid:
            problems.append(f"--grid {key} is given twice: list all its values in one --grid {key}=...")
        else:
            values, wrong = grid_values(key, written.strip())
            grid[key] = values
            problems += wrong
    if not items:
        problems.append(f"a sweep needs at least one --grid: {GRID_FORMS}")
    if problems:
        raise SpecError(problems)
    return grid


GRID_FORMS = ("KEY=V1,V2,... e.g. learning_rate=1e-4,3e-4, or a YAML list for values that hold commas: "
              "KEY=[V1, V2] e.g. lora_target_modules=[[q_proj, v_proj], [q_proj, k_proj, v_proj]]")


def grid_values(key: str, written: str) -> tuple[list[str], list[str]]:
    """A grid item's values, each as written (YAML that --set would take), and what is wrong with
    them: `[...]` is a YAML list of the values, anything else values split at its commas."""
    if written.startswith("["):
        values, problems = _listed(key, written)
    else:
        values = [value.strip() for value in written.split(",") if value.strip()]
        problems = [] if values else [f"--grid {key}={_shown(written)}: no values; write it as {GRID_FORMS}"]
        problems += [problem for value in values for problem in _yaml_problem(key, value)]
    if problems:
        return values, problems
    first: dict[str, str] = {}  # each value as it reads (its type too: 1, 1.0 and true differ) -> as first written
    for value in values:
        read = json.dumps(read_yaml(value), sort_keys=True, default=str)
        if read not in first:
            first[read] = value
        else:
            same = first[read]
            twice = f"{_shown(value)} is given twice" if same == value else \
                f"{_shown(same)} and {_shown(value)} are the same value"
            problems.append(f"--grid {key}: {twice}: each value makes a run, and these would be two identical "
                            "runs; give it once")
    return values, problems


def _listed(key: str, written: str) -> tuple[list[str], list[str]]:
    """The values of `KEY=[V1, V2]`, each as written in the list (JSON where its text does not read
    back alone, as an alias would not)."""
    try:
        listed, node = read_yaml(written), yaml.compose(written, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        return [], [f"--grid {key}={_shown(written)} is not a YAML list ({_yaml_error(error)}): close its brackets "
                    f"and quotes, e.g. {key}=[\"a,b\", c]; the form is {GRID_FORMS}"]
    if not isinstance(listed, list) or not isinstance(node, yaml.SequenceNode) or not listed:
        return [], [f"--grid {key}={_shown(written)}: give a list of one value or more; the form is {GRID_FORMS}"]
    values = []
    for value, element in zip(listed, node.value):
        text = written[element.start_mark.index:element.end_mark.index].strip()
        values.append(text if _reads_as(text, value) else json.dumps(value, default=str))
    return values, []


def _reads_as(text: str, value) -> bool:
    try:
        return json.dumps(read_yaml(text), sort_keys=True, default=str) == json.dumps(value, sort_keys=True,
                                                                                        default=str)
    except yaml.YAMLError:
        return False


def _yaml_problem(key: str, value: str) -> list[str]:
    try:
        read_yaml(value)
    except yaml.YAMLError as error:
        return [f"--grid {key}: value {_shown(value)} is not valid YAML ({_yaml_error(error)}): close its brackets "
                f"or quotes; a value that holds commas goes in a list: --grid '{key}=[\"a,b\", c]'"]
    return []


def _yaml_error(error: yaml.YAMLError) -> str:
    return str(getattr(error, "problem", None) or error).splitlines()[0]


def _shown(text: str) -> str:
    """A value for a message, unless it looks like a token (which start() refuses without repeating it)."""
    return "(a value that looks like a Hub token)" if holds_token(text) else repr(text)


def combinations(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def label(params: dict[str, str]) -> str:
    """`learning_rate=1e-4 lora_r=8`: a combination as the user wrote it."""
    return " ".join(f"{key}={value}" for key, value in params.items())


def run_specs(spec: RunSpec, grid: dict[str, list[str]]) -> list[tuple[dict[str, str], RunSpec]]:
    """Each combination and its run's spec: the recipe with the values set (as --set sets them),
    named after the recipe's run and the values."""
    found, base = [], re.sub(r"[^A-Za-z0-9._-]+", "-", spec.display_name).strip("-") or "sweep"
    for n, params in enumerate(combinations(grid), 1):
        # a value's last path part, in characters a run name keeps: model_name_or_path=/a/b/my-model -> my-model
        suffix = "-".join(f"{key.rsplit('.', 1)[-1]}{re.sub(r'[^A-Za-z0-9._-]+', '', Path(value).name)}"
                          for key, value in params.items())
        name = f"{base}-{suffix}"
        if len(name) > RUN_NAME_MAX:  # cut, and numbered so that two cut names still differ
            name = f"{name[:RUN_NAME_MAX - 4]}-{n:03d}"
        found.append((params, spec.with_overrides([*(f"{k}={v}" for k, v in params.items()), f"run_name={name}"])))
    return found


# Recipe keys whose values leave a run's compiled graphs as they are: they change the numbers the
# optimizer and scheduler use and what is logged or saved, never a tensor's shape or the model's
# forward and backward (the graphs torch_compile compiles). Runs that differ only in these share
# one precompile. Any other key (lora_r, max_length, batch size, seed: a new data order may pad to
# other lengths) may change the graphs, so those runs precompile their own. On Neuron the eager
# ops (the optimizer's among them) compile too; whether a learning rate is a constant in them is
# not verified: at worst a few small ops compile again.
SAME_GRAPHS = {"learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
               "warmup_ratio", "warmup_steps", "lr_scheduler_type", "logging_steps", "save_steps",
               "save_total_limit", "eval_steps"}


def precompile_leaders(params: list[dict[str, str]]) -> list[int | None]:
    """For each run, the index of the earlier run whose precompile it shares (None: it is the
    first of its graphs and precompiles them)."""
    first: dict[tuple, int] = {}
    leaders = []
    for n, values in enumerate(params):
        graphs = tuple((key, value) for key, value in values.items() if key not in SAME_GRAPHS)
        leaders.append(first.get(graphs))
        first.setdefault(graphs, n)
    return leaders


@dataclass
class Sweep:
    id: str
    record: dict  # the file's content: recipe, grid, runs [{id, params}], created


# The evaluation's own check of a run's evaluation, before the run is made: (the run's spec, the
# metrics (None: every one that applies), the rows) -> problems. evaluate/evaluation.py's
# check_run_evaluation; evaluate/ sits above runs/, so whoever starts an evaluating sweep hands it in.
EvalCheck = Callable[[RunSpec, tuple | None, int], list]


def start(manager: RunManager, spec: RunSpec, grid: dict[str, list[str]], hardware: Hardware, recipe: str = "",
          yes: bool = False, parallel: int | None = None, evaluate: dict | None = None,
          check_evaluation: EvalCheck | None = None) -> Sweep:
    """Check and plan every run of the grid, then start them all: local runs through the queue (at
    most `parallel` at once), on a place that takes runs as one group (a Slurm job array) as one
    (`parallel` its throttle). With the recipe's precompile on, runs whose graphs are the same
    (SAME_GRAPHS) share one: the first precompiles, the others wait in the queue until it has.
    `evaluate`: each run is evaluated when it has finished (runs/sweep_eval.py: {"limit": N,
    "metrics": [...]}), each run's evaluation checked first by `check_evaluation`."""
    secrets = [secret_message(f"--grid {key}") for key, values in grid.items()
               if key.rpartition(".")[2] in SECRET_FIELDS or holds_token(values)]
    if secrets:  # before any name, plan or record is made of the values, and without repeating them
        raise SpecError(secrets + ["nothing was started"])
    if evaluate and check_evaluation is None:
        raise ValueError("a sweep with `evaluate` needs `check_evaluation` (evaluation.check_run_evaluation)")
    runs = run_specs(spec, grid)
    if len(runs) > MAX_RUNS and not yes:
        raise SpecError([f"the grid makes {len(runs)} runs, more than {MAX_RUNS}: give fewer values, or confirm "
                         "with --yes"])
    backend = place_of(runs, parallel)
    plans, problems = checked(manager, runs, hardware, evaluate, check_evaluation)
    if backend is not None and backend.group and not problems:
        problems = backend.group_problems(plans)
    if problems:
        raise SpecError(problems + ["nothing was started"])
    sweep_id = folder.new_run_id(manager.runs_dir, f"sweep-{spec.display_name}")
    record = {"recipe": recipe, "grid": grid, "created": time.time(), "runs": [],
              **({"parallel": parallel} if parallel else {}), **({"eval": evaluate} if evaluate else {})}
    grouped = backend is not None and backend.group is not None
    made = make_runs(manager, sweep_id, record, runs, hardware, spec.precompile, parallel, grouped)
    if grouped:
        submit_group(manager, backend, sweep_id, record, made, parallel)
    if evaluate:
        queue.ensure_runner(manager.runs_dir)  # it evaluates each run when it has finished
    return Sweep(sweep_id, record)


def place_of(runs: list[tuple[dict, RunSpec]], parallel: int | None):
    """The backend every run goes to (None: a place the plans will say is unknown); SpecError for
    runs on several places, or `parallel` where the place's own queue decides."""
    places = {run_spec.layout.run_on for _, run_spec in runs}
    if len(places) > 1:
        raise SpecError([f"the sweep's runs would go to {' and '.join(sorted(map(str, places)))}: sweep "
                         "studio.run_on in separate sweeps"])
    try:
        backend = backends.get(places.pop())
    except KeyError:
        return None
    if parallel is not None and not (backend.local_cores or backend.group):
        takes = " or ".join(f"on {b.label}" for b in backends.BACKENDS.values() if b.local_cores or b.group)
        raise SpecError([f"--parallel: for sweeps {takes}; {backend.label} runs wait in their cluster's own queue"])
    return backend


def checked(manager: RunManager, runs: list[tuple[dict, RunSpec]], hardware: Hardware, evaluate: dict | None,
            check_evaluation: EvalCheck | None) -> tuple[list, list[str]]:
    """Every run planned, and its evaluation (with `evaluate`) checked: (the plans, the problems of
    them all, each named by its combination, or "every run: ..." when all share it)."""
    if evaluate and sweep_eval.problems(evaluate):
        return [], sweep_eval.problems(evaluate)
    found, plans = {}, []  # each combination's problems; the plans
    for params, run_spec in runs:
        try:
            plans.append(manager.plan(run_spec, hardware))
            found[label(params)] = plans[-1].errors
        except SpecError as error:
            found[label(params)] = error.problems
        if evaluate and not found[label(params)]:  # its data is there: will its evaluation find what it needs?
            metrics = tuple(evaluate["metrics"]) if evaluate.get("metrics") else None
            found[label(params)] = [f"its evaluation: {problem}"
                                    for problem in check_evaluation(run_spec, metrics, evaluate["limit"])]
    everywhere = [problem for problem in next(iter(found.values())) if all(problem in p for p in found.values())]
    return plans, [f"every run: {problem}" for problem in everywhere] + [
        f"{name}: {problem}" for name, listed in found.items() for problem in listed if problem not in everywhere]


def make_runs(manager: RunManager, sweep_id: str, record: dict, runs: list[tuple[dict, RunSpec]], hardware: Hardware,
              precompile: bool, parallel: int | None, grouped: bool) -> list[tuple[Path, object]]:
    """Each run started (queued as the cores allow), or with `grouped` its folder made for one group
    submit; recorded in the sweep's record as it goes. -> each run's (folder, plan)."""
    leaders = precompile_leaders([params for params, _ in runs]) if precompile else [None] * len(runs)
    made: list[tuple[Path, object]] = []
    for (params, run_spec), leader in zip(runs, leaders):
        entry, hold = {"params": params}, {}
        if leader is not None:  # its graphs are the leader's: it waits for the leader's precompile
            run_spec = run_spec.with_overrides(["studio.precompile=false"])
            entry["precompiled_by"] = hold["after"] = record["runs"][leader]["id"]
        if parallel and not grouped:
            hold |= {"parallel": parallel, "siblings": [run["id"] for run in record["runs"]]}
        planned = []
        view = manager.start(run_spec, hardware, queue_if_busy=True, hold=hold or None, submit=not grouped,
                             planned=planned.append)
        record["runs"].append({"id": view.id, **entry})
        made.append((view.dir, planned[0]))
        write(manager.runs_dir, sweep_id, record)  # as it grows: a sweep cut short still lists what started
    return made


def submit_group(manager: RunManager, backend, sweep_id: str, record: dict, runs: list, parallel: int | None) -> None:
    """The sweep's runs as one group of their backend's (a Slurm job array), recorded as the
    record's `group` ({id, label}); when the place refuses it, the run folders and the sweep's record
    are removed (SpecError: nothing was submitted)."""
    try:
        group_id = backend.submit_group(Path(manager.runs_dir) / SWEEPS, sweep_id, runs, parallel)
    except backends.SubmitError as error:
        for run_dir, _ in runs:
            shutil.rmtree(run_dir, ignore_errors=True)
        (Path(manager.runs_dir) / SWEEPS / f"{sweep_id}.json").unlink(missing_ok=True)
        raise SpecError([f"not submitted: {error}", "nothing was started"]) from error
    record["group"] = {"id": group_id, "label": f"{backend.label} {backend.group} {group_id}"}
    write(manager.runs_dir, sweep_id, record)


EVAL_POLL_S = 1.0


def wait_evaluations(runs_dir: Path, sweep_id: str, timeout: float = math.inf) -> bool:
    """Wait until what became of each run's evaluation is recorded (done, failed, or skipped: the
    run did not finish), starting the queue runner again should it have gone; whether every one
    was within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while unevaluated(runs_dir, sweep_id):
        if time.monotonic() > deadline:
            return False
        queue.ensure_runner(runs_dir)  # nothing when it runs; it evaluates them
        time.sleep(EVAL_POLL_S)
    return True


def write(runs_dir: Path, sweep_id: str, record: dict) -> None:
    path = Path(runs_dir) / SWEEPS / f"{sweep_id}.json"
    path.parent.mkdir(exist_ok=True)
    folder.write_json(path, record)


def read(runs_dir: Path, sweep_id: str) -> dict:
    path = Path(runs_dir) / SWEEPS / f"{Path(sweep_id).name}.json"
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("runs"), list):
            raise ValueError("it holds no list of runs")
        bad = next((n for n, entry in enumerate(record["runs"], 1) if not isinstance(entry, dict)
                    or not isinstance(entry.get("id"), str) or not isinstance(entry.get("params", {}), dict)), None)
        if bad is not None:
            raise ValueError(f"its run {bad} is not a run's id and values")
        return record
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise RunNotFound(f"sweep record {path} cannot be read ({error}): its runs are still listed one by one "
                          "(`launch.py runs`); delete the file to drop the sweep") from None
    except FileNotFoundError:
        known = listed(runs_dir)
        raise RunNotFound(f"no sweep {sweep_id!r} in {runs_dir}" + (f"; there are {', '.join(known)}" if known
                                                                      else "")) from None


def listed(runs_dir: Path) -> list[str]:
    """The sweeps' ids, newest first."""
    return sorted((path.stem for path in (Path(runs_dir) / SWEEPS).glob("*.json")
                   if not path.name.endswith(sweep_eval.EVALS)), reverse=True)


# What an evaluation ranks by, first found first: each metric and whether lower is better.
RANK_METRICS = (("eval_loss", True), ("rouge_l", False), ("exact_match", False), ("mean_reward", False),
                ("preference_accuracy", False))


def table(manager: RunManager, sweep_id: str) -> list[dict]:
    """The sweep's runs, best first: {id, params, state, step, loss, eval_loss, evaluation, why};
    `evaluation` is the tuned model's scores in the run's newest evaluation (sweep_eval), else
    what became of it ("waits to be evaluated", "evaluation failed: ..."). Ranked (ranking) by the evaluations when
    every finished run has one, else by the last eval_loss where every finished run has one, else
    by the last training loss; runs that have not finished come after, the failed ones last."""
    record = read(manager.runs_dir, sweep_id)
    evaluated = sweep_eval.done(manager.runs_dir, sweep_id) if record.get("eval") else {}
    rows = []
    for entry in record["runs"]:
        try:
            view = manager.view(entry["id"])
        except RunNotFound:
            rows.append({**entry, "state": "deleted", "step": 0, "loss": None, "eval_loss": None, "evaluation": None,
                         "why": None})
            continue
        last = {key: next((m[key] for m in reversed(view.metrics) if key in m), None) for key in ("loss", "eval_loss")}
        state = view.live_state
        why = view.error_text if state in ("failed", "stopped") else None
        scores = sweep_eval.latest(view.dir)
        if not scores and record.get("eval") and state == "finished":
            said = evaluated.get(view.id, {})
            failed = said.get("state") == "failed"
            scores = f"evaluation failed: {said.get('why')}" if failed else "waits to be evaluated"
        rows.append({**entry, "state": state, "step": view.step, **last, "evaluation": scores, "why": why})
    _, value = ranking(rows)
    order = {"finished": 0, "running": 1, "starting": 1, "queued": 2, "stopped": 3, "failed": 4, "deleted": 5}
    return sorted(rows, key=lambda row: (order.get(row["state"], 5), value(row)))


def ranking(rows: list[dict]) -> tuple[str, object]:
    """What the table ranks by, in words, and each row's value (smaller is better; inf when none):
    an evaluation metric (RANK_METRICS) every finished run's evaluation has, else eval_loss where
    every finished run has one, else the training loss."""
    finished = [row for row in rows if row["state"] == "finished"]

    def number(value) -> float:
        return value if isinstance(value, (int, float)) and not math.isnan(value) else math.inf

    scored = [row["evaluation"] for row in finished]
    if finished and all(isinstance(scores, dict) for scores in scored):
        for metric, lower in RANK_METRICS:
            if all(scores.get(metric) is not None for scores in scored):
                sign = 1 if lower else -1
                return f"the evaluation's {metric}", lambda row: number(sign * ((row.get("evaluation") or {}).get(
                    metric) if isinstance(row.get("evaluation"), dict) else math.nan))
    key = "eval_loss" if finished and all(row["eval_loss"] is not None for row in finished) else "loss"
    return f"the last {key}", lambda row: number(row[key])


def ranked_by(rows: list[dict]) -> str:
    """What the table ranks by, in words ("the last loss", "the evaluation's eval_loss")."""
    return ranking(rows)[0]


def scores_text(evaluation) -> str:
    """A row's evaluation as a short line: "eval_loss 2.31 rouge_l 0.214", or what became of it."""
    if not isinstance(evaluation, dict):
        return evaluation or ""
    return " ".join(f"{metric} {value:.4g}" for metric, value in evaluation.items() if isinstance(value, (int, float)))
