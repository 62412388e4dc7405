"""The run folder: its files' names, and reading and writing them.

    <runs dir>/<run id>/
        spec.yaml        the resolved spec: the recipe plus every default the studio applied
        launch.json      what runs and why: argv, the environment the studio added (no secret),
                         hardware, backend, cores, applied defaults with reasons, warnings
        events.jsonl     the event stream (studio_core.rundir.events)
        train.log        the raw output of every process of the run
        output/          the saved model or adapter (OUTPUT_INFO says which), checkpoint-<step>/
        control.json     a "stop and save" request (studio_core.rundir.checkpoints)
    and what the run's backend keeps to find the run again (the local backend's supervisor.json).

The folder is the source of truth: a web app that restarts, a second browser or the CLI all
read the same runs from it. A run id is `<time>-<name>-<6 hex digits>`, unique across runs
folders, because a run's processes are found machine-wide by their STUDIO_RUN_ID marker.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

from studio_core.machine.sizes import folder_size

SPEC = "spec.yaml"
LAUNCH = "launch.json"
EVENTS = "events.jsonl"
LOG = "train.log"
ENDED = "ended.json"  # the supervisor's own record of how the run ended, beside its final status event
OUTPUT = "output"
# Written next to the saved model: whether output/ is a LoRA adapter or a full model, which
# trainer made it and from which base, so chat and export load it the right way.
OUTPUT_INFO = "studio_output.json"
CREATING = ".creating-"  # a folder being made; renamed to the run id when whole
DELETING = ".deleting-"


def file_safe(name: str) -> str:
    """A name (a run's, a model's) as part of a file name: letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def new_run_id(runs_dir: Path, name: str) -> str:
    """`<time>-<name>-<6 hex>`, not used yet in `runs_dir`."""
    slug = file_safe(name)[:48] or "run"
    while True:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(3)}"
        if not (runs_dir / run_id).exists() and not (runs_dir / f"{CREATING}{run_id}").exists():
            return run_id


def is_run_id(run_id: str) -> bool:
    """A name a run folder may have: one plain folder name, no path (no /, no .., not hidden)."""
    return (isinstance(run_id, str) and bool(run_id) and "/" not in run_id and "\\" not in run_id
            and "\0" not in run_id and not run_id.startswith("."))


def is_run(path: Path) -> bool:
    """A whole run folder (not one being made or deleted, not the studio's own state)."""
    return not path.name.startswith(".") and (path / SPEC).exists()


def run_id_of(runs_dir: Path, given: str) -> str:
    """The run id that `given` names: an id as it is, or the path of a run folder that, symlinks
    resolved, is a folder of `runs_dir` itself. Anything else is returned unchanged, for the
    caller to refuse as it refuses any unknown id (a path outside the runs folder stays one)."""
    if not isinstance(given, str) or not given or is_run_id(given) or "\0" in given:
        return given
    try:
        path, home = Path(given).expanduser().resolve(), Path(runs_dir).expanduser().resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return given
    return path.name if path.parent == home and is_run_id(path.name) and is_run(path) else given


def inside(runs_dir: Path, run_id: str) -> bool:
    """Whether the run folder of `run_id` is, symlinks resolved, a folder of `runs_dir` (a symlink
    that leads out of it is no run of this runs folder)."""
    try:
        return (Path(runs_dir) / run_id).resolve().parent == Path(runs_dir).resolve()
    except (OSError, RuntimeError):
        return False


class DamagedRun(ValueError):
    """A file of a run folder that cannot be read; the message names the file, the run and what
    is wrong with it."""


# What every spec.yaml the studio writes holds (the resolved spec): one without them was cut short.
SPEC_KEYS = ("model_name_or_path", "dataset_name", "studio")


def spec_problem(run_dir: Path) -> tuple[dict, str | None]:
    """spec.yaml as plain data, and what is wrong with it ({} and the problem, in words that follow
    "spec.yaml": "cannot be read (not UTF-8 text: ...)"); ({}, None) when it is missing (a folder being deleted)."""
    import yaml

    try:
        raw = (Path(run_dir) / SPEC).read_bytes()
    except FileNotFoundError:
        return {}, None
    except OSError as error:
        return {}, f"cannot be read ({error.strerror})"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return {}, f"cannot be read (not UTF-8 text: byte {error.start} is {raw[error.start]:#x})"
    if not text.strip():
        return {}, "cannot be read (it is empty)"
    if not text.endswith("\n"):  # the studio writes it whole (yaml.dump), ending in a newline
        return {}, "cannot be read (cut short: its last line has no end)"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return {}, f"cannot be read (not YAML: {getattr(error, 'problem', None) or 'no valid YAML'}{where})"
    if not isinstance(data, dict):
        return {}, f"holds no recipe (a mapping of settings) but {type(data).__name__ if data is not None else 'nothing'}"
    missing = [key for key in SPEC_KEYS if key not in data]
    if missing:
        return {}, f"cannot be read (cut short: it lacks {', '.join(missing)})"
    return data, None


def read_spec(run_dir: Path) -> dict:
    """spec.yaml as plain data; DamagedRun naming the file, the run and what is wrong."""
    data, problem = spec_problem(run_dir)
    if problem is None and not data:  # no spec.yaml: a folder being deleted, or no run at all
        problem = "is missing"
    if problem:
        raise DamagedRun(f"{SPEC} of run {Path(run_dir).name} {problem}: the run's settings are unknown; put the "
                         "file back whole (the run's own copy, from a backup), or delete the run")
    return data


def write_json(path: Path, data: dict) -> None:
    """Replace the file at once: a reader sees the old or the new text, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """The JSON object in the file; {} when it is missing, cannot be read or is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return {}
    return data if isinstance(data, dict) else {}


def read_launch(run_dir: Path) -> dict:
    return read_json(run_dir / LAUNCH)


def launch_record(launch) -> dict:
    """launch.json but its `created`, from a Plan: what will run, where, and why (no secret), and
    the device memory per core it was estimated to need."""
    return {"argv": launch.argv, "env": launch.env, "backend": launch.backend,
            "hardware": launch.hardware.to_dict() if launch.hardware else None,
            "applied": [[k, v, why] for k, v, why in launch.applied], "warnings": launch.warnings,
            "cores": launch.cores, "memory": launch.memory.record() if launch.memory else None}


def write_launch(run_dir: Path, record: dict, created: float | None) -> None:
    """launch.json; `created`: when the run was first started (a resume keeps it), which the run's
    start time falls back on when its events lost their beginning."""
    write_json(run_dir / LAUNCH, {"created": created, **record})


def write_new_run(path: Path, spec_yaml: str, record: dict, created: float, state: str = "starting") -> None:
    """A new run's files, in the folder `path` (made under a temporary name, renamed to the run id
    when whole): spec.yaml, launch.json, and its first events (`state`: starting, or queued for a
    run that waits for its cores; the plan's warnings). The manager writes them for a run it
    starts, and a batch job started by plain sbatch for its own."""
    from studio_core.rundir import events

    (path / SPEC).write_text(spec_yaml)
    write_launch(path, record, created)
    events.append(path / EVENTS, events.status(state))
    for warning in record.get("warnings", []):
        events.append(path / EVENTS, events.log(f"warning: {warning}"))


def output_info(run_dir: Path) -> dict | None:
    """The saved model's OUTPUT_INFO: {kind: full|adapter, trainer, base_model, base_model_path,
    task}, or None while the run has saved no model."""
    return read_json(run_dir / OUTPUT / OUTPUT_INFO) or None


def log_tail(run_dir: Path, max_bytes: int = 12_000, lines: int = 60) -> str:
    """The end of train.log, each line as a terminal would show it last (after any \\r)."""
    path = run_dir / LOG
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - max_bytes))
            text = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join([line.rsplit("\r", 1)[-1] for line in text.splitlines()][-lines:])


_SIZES: dict[Path, tuple[tuple, int]] = {}


def run_size(run_dir: Path) -> int:
    """Bytes the run folder takes (model, checkpoints, log: everything in it).

    Walking a folder per run every few seconds adds up with hundreds of runs, so the size is
    kept and walked again only when something changed: everything the studio and the trainer
    put in a run folder also adds to events.jsonl or train.log, or adds or removes an entry
    in the folder or in output/ (a checkpoint is followed by its event, and TRL removes old
    checkpoints from output/)."""
    key = tuple(_stamp(run_dir / name) for name in ("", EVENTS, LOG, OUTPUT))
    known = _SIZES.get(run_dir)
    if known is not None and known[0] == key:
        return known[1]
    size = folder_size(run_dir)
    _SIZES[run_dir] = (key, size)
    return size


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_mtime_ns, stat.st_size


EVAL_DIR = "eval"  # in a run folder: an evaluation's rows and summary per folder (evaluate/evaluation.py)
SUMMARY = "summary.json"


def evaluations(run_dir: Path, under: str = EVAL_DIR) -> list[dict]:
    """The run's finished evaluations' summaries (or those of a folder's `under`), newest first (one
    that cannot be read is left out)."""
    found = []
    for path in sorted((run_dir / under).glob(f"*/{SUMMARY}"), reverse=True):
        try:
            found.append({**json.loads(path.read_text()), "dir": str(path.parent)})
        except (OSError, ValueError):
            continue
    return found
