"""EleutherAI's lm-evaluation-harness (lm-eval) as an optional step of the studio's evaluation:
its tasks (its own, or YAML tasks in a folder of the user's) run on a model the studio has
already loaded, the same way its chat process loads it (on Neuron: `device_map="neuron"`).

lm-eval is optional: the studio works without it, and `available()` says whether it is
installed without importing it (nor torch), so the web app may call it. `check_tasks` and
`run_tasks` import lm-eval and torch: call them from a child process or the CLI.

lm-eval's index of its own tasks takes about 20 s to build (it parses ~15,000 YAML files), so
both look for the tasks in the include folder first and build that index only for a name not
found there; `check_tasks` keeps the names of lm-eval's own tasks in the studio's cache, one
file per lm-eval version.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import numbers
import os
from pathlib import Path

from studio_core.machine.cache import cache_dir

INSTALL = "pip install lm-eval"


def available() -> bool:
    """Whether lm-eval is installed (found, not imported: importing it pulls in torch)."""
    return importlib.util.find_spec("lm_eval") is not None


def check_tasks(tasks: list[str], include_path: str | None = None) -> list[str]:
    """What would stop these tasks from running, each problem saying what to change; [] if none."""
    if not available():
        return [f"lm-eval is not installed: run `{INSTALL}` in the studio's environment, or drop the lm-eval tasks"]
    if include_path and not Path(include_path).is_dir():
        # The names may be in that folder: judge them once it is the right one.
        return [f"lm-eval include path {include_path} is not a folder: point it at the folder that holds your "
                "task YAML files, or leave it empty to use lm-eval's own tasks"]
    if not tasks:
        return ["no lm-eval task named: name at least one (`lm-eval ls tasks` lists lm-eval's own)"]
    local = set(_local_manager(include_path).all_tasks) if include_path else set()
    missing = [name for name in tasks if name not in local]
    if not missing:
        return []
    known = local | set(_builtin_task_names())
    return [_unknown_task(name, known, include_path) for name in missing if name not in known]


def run_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | float | None = None,
              batch_size: int = 1, device: str | None = None) -> dict:
    """Run lm-eval's tasks on an already loaded model (a transformers model or a peft.PeftModel)
    and its tokenizer. `limit`: at most this many documents per task (a float below 1: that
    fraction). `device`: where lm-eval puts the inputs (default the model's own device).

    Returns {task: {metric: value, ..., "samples": documents evaluated}}: lm-eval's metric names
    without the `,none` filter suffix (another filter's name is kept: `exact_match,strict-match`),
    standard errors as `<metric>_stderr`, None where lm-eval has no number. Raises what lm-eval
    raises (run `check_tasks` first for messages that say what to change)."""
    import datasets
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    # Given a model object, HFLM neither loads nor moves it, and ignores its own `device`
    # argument: it sends inputs to `model.device`. The only way to choose another is its field.
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if device is not None:
        lm._device = torch.device(device)
    # datasets pings S3 to count each load of its `json` builder, even of a local file (up to
    # 3 s when unreachable, unless HF_HUB_OFFLINE): a local task should need no network at all.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    output = simple_evaluate(model=lm, tasks=list(tasks), task_manager=_manager_for(tasks, include_path),
                             limit=limit, log_samples=False)
    if output is None:  # lm-eval reports only on rank 0, which it reads from LOCAL_RANK
        raise RuntimeError(f"lm-eval returned no results in a process with LOCAL_RANK={os.environ.get('LOCAL_RANK')}: "
                           "run it in a single process, outside torchrun")
    return summarize(output)


def summarize(output: dict) -> dict:
    """lm-eval's results as {task: {metric: value}}, JSON-safe (see run_tasks)."""
    counts = output.get("n-samples", {})
    summary = {}
    for task, values in output["results"].items():
        metrics = {}
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name:  # alias, name, sample_len: labels, not metrics
                continue
            metrics[metric if filter_name == "none" else key] = _number(value)
        if task in counts:  # groups have none
            metrics["samples"] = int(counts[task]["effective"])
        summary[task] = metrics
    return summary


def _number(value) -> float | None:
    # lm-eval writes "N/A" for a standard error it did not compute; NaN and inf are not JSON.
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    return None


# What lm-eval's __init__ sets in os.environ, for its own downloads, when it is first imported (lm-eval
# 0.4: `os.environ.setdefault`). Left there by check_tasks in a process that goes on (a test session;
# the CLI, before it starts a run), they would be in the environment of every run and child it starts
# after; and a run whose environment differs from the zygote's is not forked (backends/forking.py).
LM_EVAL_SETS = ("HF_XET_HIGH_PERFORMANCE", "HF_HUB_ENABLE_HF_TRANSFER")


def _task_manager_class():
    """lm_eval.tasks.TaskManager, imported without leaving LM_EVAL_SETS in this process's environment."""
    unset = [name for name in LM_EVAL_SETS if name not in os.environ]
    from lm_eval.tasks import TaskManager

    for name in unset:
        os.environ.pop(name, None)
    return TaskManager


def _local_manager(include_path: str):
    """A TaskManager over the include folder alone: milliseconds, against ~20 s with lm-eval's own tasks."""
    return _task_manager_class()(include_path=include_path, include_defaults=False)


def _manager_for(tasks: list[str], include_path: str | None):
    """The include folder alone when it defines every task (groups may name lm-eval's own tasks,
    so they need the full index), else the include folder over lm-eval's own tasks."""
    TaskManager = _task_manager_class()
    if include_path:
        local = _local_manager(include_path)
        if set(tasks) <= set(local.all_subtasks):
            return local
    return TaskManager(include_path=include_path)


def _builtin_task_names() -> list[str]:
    """The names of lm-eval's own tasks, groups and tags, cached per lm-eval version."""
    from importlib.metadata import version

    cached = cache_dir() / "lm-eval" / f"tasks-{version('lm_eval')}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    names = _task_manager_class()().all_tasks
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}")
    partial.write_text(json.dumps(names))
    partial.replace(cached)  # atomic: a concurrent reader sees the whole list or none
    return names


def _unknown_task(name: str, known: set[str], include_path: str | None) -> str:
    where = f"lm-eval's own tasks or in {include_path}" if include_path else "lm-eval's own tasks"
    close = difflib.get_close_matches(name, known, n=3)
    if close:
        return f"lm-eval task {name!r} is not among {where}: did you mean {', '.join(map(repr, close))}?"
    return (f"lm-eval task {name!r} is not among {where}: check its name (`lm-eval ls tasks` lists lm-eval's "
            "own), or put its YAML file in the include folder")
