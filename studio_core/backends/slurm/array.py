"""A sweep's Slurm runs as one job array: one `sbatch --array=0-(N-1)[%parallel]` instead of one
job per run, so the cluster's queue holds one entry for the sweep and Slurm itself keeps at most
`parallel` of its runs going at once (the array's throttle).

Each run is made as any Slurm run is (RunManager.start with submit=False: its folder, spec and
launch.json) and keeps its own batch script, slurm.sh (batch.batch_script: the same text a
single submit writes); the array's script, in the sweeps folder, runs run i's slurm.sh in task i.
A task does not read the #SBATCH lines of the script it runs, so the array's own script carries
the job's options (batch.job_options), one set for every task: the runs of one array must
agree on them (`problems`). Each run records its job as the array task's id, `<array id>_<i>`,
which is how Slurm's commands name the task (squeue -j, scancel, scontrol show job) and how
the task records itself when it starts (records.job_in); from there the run is followed, stopped
and resumed as any Slurm run (a resume submits it alone, as a plain job).
"""

from __future__ import annotations

import shlex
import time
import unicodedata
from pathlib import Path

from studio_core.backends.base import SubmitError
from studio_core.backends.shell import job_name
from studio_core.backends.slurm import tools as slurm
from studio_core.backends.slurm.batch import batch_script, job_options, refusals, sbatch_argv
from studio_core.backends.slurm.records import SCRIPT, record_job
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS

SUFFIX = ".slurm.sh"  # the array script's name: <sweep id>.slurm.sh in the sweeps folder
# The setting a user changes for each job option a sweep's runs may differ in; any other comes
# from the extra sbatch options.
SETTINGS = {"--nodes": "studio.nodes", "--partition": "studio.slurm.partition", "--time": "studio.slurm.time",
            "--account": "studio.slurm.account"}


def problems(plans: list) -> list[str]:
    """Why these planned runs cannot go to Slurm as one job array ([] when they can): a plan not
    for Slurm, the Slurm refusals of any run's layout, or job options that differ between them
    (a grid over studio.nodes or studio.slurm.partition, say): an array's tasks share one set,
    so each value must be a sweep of its own."""
    found = [f"run {_name(plan)} is planned for {plan.backend}, not Slurm: a job array holds Slurm runs only"
             for plan in plans if plan.backend != "slurm"]
    for plan in plans:
        found += [problem for problem in refusals(plan.spec.layout) if problem not in found]
    if found:
        return found
    return [f"{setting} differs between the sweep's runs ({', '.join(values)}): a sweep's Slurm runs are one job "
            f"array, whose runs share one set of sbatch options; sweep each {setting} value as a separate sweep"
            for setting, values in _differing(plans).items()]


def submit(script_path: str | Path, runs: list[tuple[Path, object]], parallel: int | None = None) -> str:
    """Submit the runs (each `(run folder, plan)`, folders already made) as one Slurm job array:
    writes each run's slurm.sh and the array script at `script_path`, submits it with
    `sbatch --parsable --array=0-(N-1)` (and `%parallel`: at most that many tasks at once), then
    records task i's id (`<array id>_<i>`) in run i's slurm.json and says so in its log.
    -> the array's job id. SubmitError, with what to do, when nothing was submitted."""
    script_path = Path(script_path)
    runs = [(Path(run_dir), plan) for run_dir, plan in runs]
    found = problems([plan for _, plan in runs]) if runs else ["no runs to submit"]
    if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1):
        found.append(f"parallel: {parallel!r} is not a number of runs at once, 1 or more (None: no limit)")
    found += [f"run folder {run_dir} was paired with the plan of {plan.argv[-1]}: give each folder its own plan"
              for run_dir, plan in runs if Path(plan.argv[-1]) != run_dir]
    if found:
        raise SubmitError("; ".join(found))
    layout = runs[0][1].spec.layout
    try:
        for run_dir, plan in runs:
            (run_dir / SCRIPT).write_text(batch_script(plan))
        script_path.parent.mkdir(parents=True, exist_ok=True)
        script_path.write_text(array_script(script_path, runs, parallel))
        job_id = slurm.submit(str(script_path), cwd=str(script_path.parent),
                              extra=[array_option(len(runs), parallel), *sbatch_argv(layout)[2:-1]])
    except (ValueError, OSError, slurm.SlurmError) as error:
        raise SubmitError(str(error)) from error
    try:
        for task, (run_dir, _) in enumerate(runs):
            record_job(run_dir, task_id(job_id, task), time.time())  # unless the task, started at once, did first
            events.append(run_dir / EVENTS, events.log(f"submitted to Slurm as job {task_id(job_id, task)} (task "
                                                       f"{task} of job array {job_id})"))
    except OSError as error:
        raise _withdrawn(job_id, f"its runs' records were not written ({error})") from error
    return job_id


def task_id(job_id: str, task: int) -> str:
    """A task of a job array as Slurm's commands name it (123_4)."""
    return f"{job_id}_{task}"


def array_option(count: int, parallel: int | None) -> str:
    """sbatch's --array for `count` tasks, at most `parallel` at once (Slurm's throttle, %N)."""
    return f"--array=0-{count - 1}" + (f"%{parallel}" if parallel else "")


def array_script(script_path: Path, runs: list[tuple[Path, object]], parallel: int | None = None) -> str:
    """The array's batch script: the runs' shared job options as #SBATCH lines (each run's own
    slurm.sh has them too, but a task runs it with bash: there they are comments), Slurm's own
    output of task i in the sweeps folder (<sweep id>-<array id>_<i>.out), and task i runs run i's
    slurm.sh, which sends the run's output to its train.log. Every word is quoted for the shell;
    a path holding a line break is refused (ValueError), as batch_script refuses one."""
    script_path = Path(script_path)
    name = script_path.name.removesuffix(SUFFIX)
    for path in (script_path, *[run_dir for run_dir, _ in runs]):
        if any(unicodedata.category(c).startswith("C") for c in str(path)):
            raise ValueError(f"{str(path)!r} holds a control character (a line break?): give the runs folder a path "
                             "without one")
    output = f"{script_path.parent}/{name}".replace("%", "%%") + "-%A_%a.out"  # %% is a % of the path itself
    sbatch = [f"--job-name={job_name(name)}", *job_options(runs[0][1].spec.layout), f"--output={output}"]
    submitted = shlex.join(["sbatch", "--parsable", array_option(len(runs), parallel), script_path.name])
    return "\n".join([
        "#!/usr/bin/env bash",
        *[f"#SBATCH {shlex.quote(option)}" for option in sbatch],
        f"# Sweep {name}: {len(runs)} run(s) as one Slurm job array, written by the studio and submitted as",
        f"# `{submitted}`" + (f" (at most {parallel} at once)." if parallel else "."),
        "# Task i runs run i's own batch script (its folder's slurm.sh, whose #SBATCH lines are only comments",
        "# here: the options above are every task's); the run's output goes to its folder's train.log, and",
        "# Slurm's own lines of task i to the --output file above.",
        "set -euo pipefail",
        "runs=(",
        *[f"  {shlex.quote(str(run_dir))}  # task {task}" for task, (run_dir, _) in enumerate(runs)],
        ")",
        f': "${{SLURM_ARRAY_TASK_ID:?this is a job array script: submit it with sbatch '
        f'{array_option(len(runs), None)}}}"',
        f'exec bash "${{runs[$SLURM_ARRAY_TASK_ID]}}/{SCRIPT}"',
        "",
    ])


def _differing(plans: list) -> dict[str, list[str]]:
    """The job options the plans do not agree on: {the user's setting: the values, as sbatch gets them}."""
    each = [_options(plan) for plan in plans]
    names = sorted({name for options in each for name in options})
    return {SETTINGS.get(name, f"studio.slurm.sbatch_args {name}"): sorted({options.get(name, "(not set)")
                                                                            for options in each})
            for name in names if len({options.get(name) for options in each}) > 1}


def _options(plan) -> dict[str, str]:
    """A plan's job options (batch.job_options) as {--name: value}; an option without a value is its name."""
    found: dict[str, str] = {}
    for word in job_options(plan.spec.layout):
        name, _, value = word.partition("=")
        found[name] = ", ".join(filter(None, [found.get(name), value or name]))  # one given twice keeps both
    return found


def _name(plan) -> str:
    return Path(str(plan.argv[-1])).name if plan.argv else plan.spec.display_name


def _withdrawn(job_id: str, why: str) -> SubmitError:
    """The submitted array cancelled again (nothing of it may run), as the error that says so."""
    try:
        slurm.cancel(job_id)
    except slurm.SlurmError as error:
        return SubmitError(f"job array {job_id} was submitted but {why}, and Slurm did not cancel it ({error}): "
                           f"cancel it with `scancel {job_id}`")
    return SubmitError(f"job array {job_id} was submitted but {why}: it was cancelled again")
