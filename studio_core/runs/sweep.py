"""Sweeps: one recipe, a grid of values, a run for each combination.

    launch.py sweep recipes/tiny-sft.yaml --grid learning_rate=1e-4,3e-4 --grid lora_r=8,16

Every run of the grid is checked and planned before any starts: an unknown key, a value of the
wrong type, a run that would not fit in a core's memory, more runs than MAX_RUNS without `yes`,
runs on several backends, or (on Slurm) runs whose job options differ refuse the whole sweep,
naming the combination. Then:
- Runs on this machine start like Start with the queue on (runs/queue.py): as many at once as
  there are free cores for them (at most `parallel`), the rest wait in order.
- Runs on Slurm go as one job array (backends/slurm/array.py), `parallel` its throttle (`%N`).
- Runs on Ray are submitted one by one and wait in Ray's own queue.
They share the backend's compile cache (machine/compile_cache.py), so a shape one run compiled is
a cache hit for the next. With the recipe's precompile on, the runs whose graphs are the same
(they differ only in SAME_GRAPHS keys) share one precompile: the first of them precompiles, the
others are held in the queue until it has (queue.held_back), then find every shape in the cache.
A failed run does not stop the others. With `evaluate`, each run is evaluated when it has
finished (runs/sweep_eval.py).

A sweep is recorded in `<runs dir>/sweeps/<sweep id>.json` (its recipe, grid, settings and each
run's id, values and the run whose precompile it shares); `table()` reads its runs back, best
first (`ranking`: by their evaluations, else their last eval_loss, else their training loss), the
failed ones last with why.
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

from studio_core import backends
from studio_core.backends.slurm import array as slurm_array
from studio_core.machine.hardware import Hardware
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import SECRET_FIELDS, holds_token, secret_message
from studio_core.rundir import folder
from studio_core.runs import queue, sweep_eval
from studio_core.runs.sweep_eval import SWEEPS
from studio_core.runs.manager import RunManager, RunNotFound

MAX_RUNS = 16  # more need `yes`: each run is a training (and on Neuron, maybe a compilation)
RUN_NAME_MAX = 64  # recipe/validate.py's longest run_name
EVAL_LIMIT = sweep_eval.DEFAULT_LIMIT  # rows of each run's evaluation unless the sweep says (the app and CLI show it)


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`KEY=V1,V2` items -> {key: [values as written]}; SpecError for a malformed or repeated one."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key, found = key.strip(), [value.strip() for value in values.split(",") if value.strip()]
        if not sep or not key or not found:
            raise SpecError([f"--grid {item!r}: write it as KEY=V1,V2,... e.g. learning_rate=1e-4,3e-4"])
        if key in grid:
            raise SpecError([f"--grid {key} is given twice: list all its values in one --grid {key}=..."])
        grid[key] = found
    if not grid:
        raise SpecError(["a sweep needs at least one --grid KEY=V1,V2,..."])
    return grid


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


def start(manager: RunManager, spec: RunSpec, grid: dict[str, list[str]], hardware: Hardware, recipe: str = "",
          yes: bool = False, parallel: int | None = None, evaluate: dict | None = None) -> Sweep:
    """Check and plan every run of the grid, then start them all: local runs through the queue (at
    most `parallel` at once), Slurm runs as one job array (`%parallel`). With the recipe's
    precompile on, runs whose graphs are the same (SAME_GRAPHS) share one: the first precompiles,
    the others wait in the queue until it has. `evaluate`: each run is evaluated when it has
    finished (runs/sweep_eval.py: {"limit": N, "metrics": [...]})."""
    secrets = [secret_message(f"--grid {key}") for key, values in grid.items()
               if key.rpartition(".")[2] in SECRET_FIELDS or holds_token(values)]
    if secrets:  # before any name, plan or record is made of the values, and without repeating them
        raise SpecError(secrets + ["nothing was started"])
    runs = run_specs(spec, grid)
    if len(runs) > MAX_RUNS and not yes:
        raise SpecError([f"the grid makes {len(runs)} runs, more than {MAX_RUNS}: give fewer values, or confirm "
                         "with --yes"])
    places = {run_spec.layout.run_on for _, run_spec in runs}
    on_slurm = places == {"slurm"}
    if len(places) > 1:
        raise SpecError([f"the sweep's runs would go to {' and '.join(sorted(places))}: sweep studio.run_on in "
                         "separate sweeps"])
    if parallel is not None and not (on_slurm or backends.get(places.pop()).local_cores):
        raise SpecError([f"--parallel: for sweeps on this machine or on Slurm; {spec.layout.run_on} runs wait in "
                         "its own cluster's queue"])
    found, plans = {}, []  # each combination's problems; the plans
    for params, run_spec in runs:
        try:
            plans.append(manager.plan(run_spec, hardware))
            found[label(params)] = plans[-1].errors
        except SpecError as error:
            found[label(params)] = error.problems
    everywhere = [problem for problem in next(iter(found.values())) if all(problem in p for p in found.values())]
    problems = [f"every run: {problem}" for problem in everywhere] + [
        f"{name}: {problem}" for name, listed in found.items() for problem in listed if problem not in everywhere]
    if on_slurm and not problems:
        problems = slurm_array.problems(plans)
    if evaluate and not problems:
        problems = sweep_eval.problems(evaluate)
    if problems:
        raise SpecError(problems + ["nothing was started"])
    sweep_id = folder.new_run_id(manager.runs_dir, f"sweep-{spec.display_name}")
    record = {"recipe": recipe, "grid": grid, "created": time.time(), "runs": [],
              **({"parallel": parallel} if parallel else {}), **({"eval": evaluate} if evaluate else {})}
    leaders = precompile_leaders([params for params, _ in runs]) if spec.precompile else [None] * len(runs)
    submitted: list[tuple[Path, object]] = []  # Slurm: the runs' folders and plans, for the job array
    for (params, run_spec), leader in zip(runs, leaders):
        entry, hold = {"params": params}, {}
        if leader is not None:  # its graphs are the leader's: it waits for the leader's precompile
            run_spec = run_spec.with_overrides(["studio.precompile=false"])
            entry["precompiled_by"] = hold["after"] = record["runs"][leader]["id"]
        if parallel and not on_slurm:
            hold |= {"parallel": parallel, "siblings": [run["id"] for run in record["runs"]]}
        planned = []
        view = manager.start(run_spec, hardware, queue_if_busy=True, hold=hold or None, submit=not on_slurm,
                             planned=planned.append)
        record["runs"].append({"id": view.id, **entry})
        submitted.append((view.dir, planned[0]))
        write(manager.runs_dir, sweep_id, record)  # as it grows: a sweep cut short still lists what started
    if on_slurm:
        submit_array(manager, sweep_id, record, submitted, parallel)
    if evaluate:
        queue.ensure_runner(manager.runs_dir)  # it evaluates each run when it has finished
    return Sweep(sweep_id, record)


def submit_array(manager: RunManager, sweep_id: str, record: dict, runs: list, parallel: int | None) -> None:
    """The sweep's Slurm runs as one job array; when Slurm refuses it, the run folders and the
    sweep's record are removed (SpecError: nothing was submitted)."""
    script = Path(manager.runs_dir) / SWEEPS / f"{sweep_id}.slurm.sh"
    try:
        record["slurm_job"] = slurm_array.submit(script, runs, parallel)
    except backends.SubmitError as error:
        for run_dir, _ in runs:
            shutil.rmtree(run_dir, ignore_errors=True)
        (Path(manager.runs_dir) / SWEEPS / f"{sweep_id}.json").unlink(missing_ok=True)
        raise SpecError([f"not submitted: {error}", "nothing was started"]) from error
    write(manager.runs_dir, sweep_id, record)


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
