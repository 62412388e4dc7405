"""A Slurm run's batch job: sbatch's options (the user's, checked by the one rule for them) and the
batch script's text (slurm.sh), which the backend submits for one run, Export writes, and a sweep's
job array (array.py) runs in each of its tasks.
"""

from __future__ import annotations

import json
import shlex
import unicodedata
from pathlib import Path

from studio_core.backends.shell import export_lines, job_name, mesh_note
from studio_core.backends.slurm import tools as slurm
from studio_core.backends.slurm.options import SlurmOptions
from studio_core.backends.slurm.records import SCRIPT
from studio_core.machine.children import REPO_ROOT
from studio_core.rundir.folder import LOG, launch_record


def options_of(layout) -> SlurmOptions:
    """The layout's Slurm options (the defaults when it gives none)."""
    return layout.options if isinstance(layout.options, SlurmOptions) else SlurmOptions()


def refusals(layout) -> list[str]:
    """What is wrong with the layout's node count and Slurm options: the options' own check, the one rule for them."""
    return [p for p in [slurm.check_nodes(layout.nodes)] if p] + options_of(layout).check()


def sbatch_argv(layout) -> list[str]:
    """The sbatch command: the user's options as sbatch gets them (--name=value; a refused one is left out)."""
    extra = options_of(layout).sbatch_args
    return ["sbatch", "--parsable", *slurm.sbatch_words(extra if isinstance(extra, list) else [])[0], SCRIPT]


def job_options(layout) -> list[str]:
    """The job's sbatch options but its name, as the batch script's #SBATCH lines give them (the
    user's extra ones among them: plain sbatch gets them too). A job array (array.py) gives its
    tasks one set of them: what its runs must share."""
    options = options_of(layout).to_dict()
    extra = options.get("sbatch_args", [])
    return [f"--nodes={layout.nodes}", "--ntasks-per-node=1", "--exclusive", "--no-requeue",
            *[f"--{key}={options[key]}" for key in ("partition", "time", "account") if key in options],
            *slurm.sbatch_words(extra if isinstance(extra, list) else [])[0]]


def _one_line(text: str) -> str:
    """Text for a comment line of the script: a control character (a line break) shown as '?'."""
    return "".join("?" if unicodedata.category(c).startswith("C") else c for c in str(text))


# The batch job's first step (job_start.py): the run folder made on a first start by plain sbatch, the
# job recorded in it; the plan's records come on stdin (PAYLOAD_END ends them).
JOB_START = "studio_core.backends.slurm.job_start"
PAYLOAD_END = "STUDIO_RUN_RECORDS"


def batch_script(plan) -> str:
    """The batch script of a planned Slurm run: what the studio submits, and what Export writes
    (the same text: the run id is chosen before either). Its job makes the run folder on a first
    start by plain `sbatch` (spec.yaml, launch.json and the first events, carried in the script),
    records its job id in slurm.json, then starts one node supervisor per node with srun.
    Every word is quoted for the shell (sbatch reads #SBATCH lines with the same quotes); a run
    folder whose path holds a line break is refused (ValueError): no quoting keeps it in a
    #SBATCH line or a comment, which run to the line's end.
    No #SBATCH --output or --chdir into the run folder: Slurm opens them before the script runs,
    and fails the job when the folder is not there yet (JobLaunchFailure). The job's own lines
    before the folder exists go to Slurm's default slurm-<job id>.out where sbatch ran."""
    layout, run_dir = plan.spec.layout, plan.argv[-1]
    if _one_line(run_dir) != str(run_dir):
        raise ValueError(f"the run folder {str(run_dir)!r} holds a control character (a line break?): give the "
                         "runs folder a path without one")
    options = options_of(layout).to_dict()
    sbatch = [f"--job-name={job_name(plan.spec.display_name)}", *job_options(layout)]
    srun = ["srun", "--label", "--kill-on-bad-exit=1", *(["--auto-resume=1"] if options.get("auto_resume") else []),
            plan.argv[0], "-m", "studio_core.training.supervisor", run_dir]
    records = {"spec.yaml": plan.spec.to_yaml().splitlines(), "launch.json": launch_record(plan)}
    return "\n".join([
        "#!/usr/bin/env bash",
        *[f"#SBATCH {shlex.quote(_one_line(option))}" for option in sbatch],
        f"# {_one_line(plan.spec.display_name)}: {layout.nodes} node(s) x {layout.nproc} process(es), written by the "
        f"studio for run {_one_line(Path(run_dir).name)}.",
        "# Submit it as it is (sbatch THIS_FILE): the studio submits this same script. Its job makes the run",
        "# folder on the run's first start and records itself there, so the studio lists, follows and stops",
        "# the run; the output goes to the folder's train.log.",
        "# Every node must see the run folder, the compile cache and the studio's repository",
        f"# ({_one_line(REPO_ROOT)}): shared storage, e.g. FSx for Lustre or NFS.",
        *mesh_note(layout),
        "set -euo pipefail",
        *export_lines(plan.env),
        "# the run folder, made on the run's first start; this job recorded in it (slurm.json)",
        f"{shlex.quote(plan.argv[0])} -m {JOB_START} {shlex.quote(run_dir)} \"$0\" <<'{PAYLOAD_END}'",
        _json_text(records),  # JSON: no line of it can be the end marker
        PAYLOAD_END,
        f"cd {shlex.quote(run_dir)}",
        f"exec >>{shlex.quote(f'{run_dir}/{LOG}')} 2>&1",
        "# one supervisor per node: it runs the node's torchrun (rendezvous on the first node), samples",
        "# the node's hardware, and on the first node writes the run's final status",
        shlex.join(srun),
        "",
    ])


def without_records(script: str) -> str:
    """The batch script as a plan shows it: the run's records (spec and launch.json, a hundred
    lines of JSON the job's first step reads) as one line that says what is there."""
    lines = script.split("\n")
    if PAYLOAD_END not in lines:
        return script
    end = lines.index(PAYLOAD_END)
    start = next(i for i in range(end - 1, -1, -1) if lines[i].endswith(f"<<'{PAYLOAD_END}'"))
    return "\n".join([*lines[:start + 1], f"(the run's spec.yaml and launch.json as JSON: {end - start - 1} lines)",
                      *lines[end:]])


def _json_text(value, depth: int = 0) -> str:
    """JSON for people: the outer levels one entry per line (the spec's lines, launch.json's keys, the
    environment, each applied setting), what is inside them on one line."""
    inner = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else None
    wide = isinstance(value, dict) or any(isinstance(item, (dict, list)) or len(str(item)) > 40 for item in inner or [])
    if not inner or depth > 2 or (depth == 2 and not wide):
        return json.dumps(value, default=str)
    lines = [f"{json.dumps(key)}: {_json_text(item, depth + 1)}" for key, item in value.items()] if isinstance(
        value, dict) else [_json_text(item, depth + 1) for item in value]
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    return opening + "\n" + ",\n".join(" " * (depth + 1) + line for line in lines) + "\n" + " " * depth + closing
