"""Launch scripts exported from a plan: the way out for users who outgrow the studio.

`submit_script` is the batch script of a plan for a cluster: the very script the studio submits
for that plan (the run backend's export_script, one generator), for a run id chosen at export
(RunManager.export_plan). Started by plain `sbatch`, its job makes the run folder itself and
records the job there (studio_core/backends/slurm/job_start.py), so `launch.py runs`, the Runs
tab and `launch.py stop` treat it as a run the studio submitted. `launch_script` is a bash script
that runs the same torchrun with the same environment on one machine (no cluster, nothing the
studio follows). A script holds no secret: HF_TOKEN is read from the environment it runs in.

`overwrite_problem` is the rule for where a script is written: a new file, or a script the
studio wrote there before (its own mark in its first lines: re-exporting a plan replaces it);
anything else at that path (another file, a folder, a symbolic link, a device or pipe) is
refused, since writing would destroy it or write through it somewhere else.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from studio_core import backends
from studio_core.backends.shell import export_lines, job_name, mesh_note
from studio_core.machine.children import REPO_ROOT
from studio_core.training.plan import WORKER_MODULE, Plan


LAUNCH_MARK = "# Exported from the studio: "  # launch_script's second line
BATCH_MARK = ", written by the studio for run "  # the Slurm batch script's comment (backends/slurm/batch.py)
HEAD_BYTES = 16384  # a script's head, where its mark is: after the shebang and the #SBATCH lines


def launch_script(plan: Plan, run_dir: str = "./studio-run") -> str:
    """A bash script that runs this plan on one machine, writing the run to $RUN_DIR."""
    nproc = plan.spec.layout.nproc
    env = {k: v for k, v in plan.env.items() if k != "STUDIO_RUN_ID"}
    return "\n".join([
        "#!/usr/bin/env bash",
        f"{LAUNCH_MARK}{job_name(plan.spec.display_name)}, {nproc} process(es) on one machine.",
        *mesh_note(plan.spec.layout),
        "set -euo pipefail",
        f"RUN_DIR=$(realpath -m \"${{RUN_DIR:-{run_dir}}}\")  # relative to where the script starts",
        'mkdir -p "$RUN_DIR"',
        f"cd {shlex.quote(str(REPO_ROOT))}  # the worker is studio_core.training.worker in this repository",
        "cat > \"$RUN_DIR/spec.yaml\" <<'SPEC'",
        plan.spec.to_yaml().rstrip("\n"),
        "SPEC",
        *export_lines(env),
        'export STUDIO_RUN_ID="${STUDIO_RUN_ID:-$(basename "$RUN_DIR")}"',
        f"exec {shlex.quote(plan.argv[0])} -m torch.distributed.run --standalone --nnodes=1 \\",
        f'  --nproc-per-node={nproc} -m {WORKER_MODULE} "$RUN_DIR"',
        "",
    ])


def submit_script(plan: Plan) -> str:
    """The batch script of a plan for a cluster (RunManager.export_plan): what the studio would
    submit for it. ValueError for a plan of a place that takes no script, or a run folder no
    script can name."""
    return backends.get(plan.backend).export_script(plan)


def overwrite_problem(path: Path) -> str | None:
    """Why a script must not be written at `path`, saying what to do; None for a new file or a
    script the studio wrote there before. Looked at without following a link or opening
    anything but a regular file (a pipe would block)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"cannot look at it ({error.strerror}): choose a file in a folder you can read"
    if stat.S_ISLNK(mode):
        return (f"is a symbolic link (to {os.readlink(path)}): the studio writes no script through a link; give "
                f"a new file name, or remove the link (rm {shlex.quote(str(path))}) and export again")
    if stat.S_ISDIR(mode):
        return f"is a folder: give a file name, e.g. {path / 'job.sh'}"
    if not stat.S_ISREG(mode):
        return "is a device, a pipe or a socket, not a file: give a new file name"
    if not written_by_studio(path):
        return (f"already exists and is not a script the studio wrote: nothing is overwritten; give a new file "
                f"name, or remove it (rm {shlex.quote(str(path))}) if you mean to replace it")
    return None


def written_by_studio(path: Path) -> bool:
    """The file is a script the studio exported: a bash script with one of the studio's marks."""
    try:
        with open(path, "rb") as file:
            head = file.read(HEAD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return False
    return head.startswith("#!/usr/bin/env bash\n") and (LAUNCH_MARK in head or BATCH_MARK in head)
