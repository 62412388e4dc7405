"""Launch scripts exported from a plan: the way out for users who outgrow the studio.

`submit_script` is the batch script of a plan for a cluster: the very script the studio submits
for that plan (the run backend's export_script, one generator), for a run id chosen at export
(RunManager.export_plan). Started by plain `sbatch`, its job makes the run folder itself and
records the job there (studio_core/backends/slurm/job_start.py), so `launch.py runs`, the Runs
tab and `launch.py stop` treat it as a run the studio submitted. `launch_script` is a bash script
that runs the same torchrun with the same environment on one machine (no cluster, nothing the
studio follows). A script holds no secret: HF_TOKEN is read from the environment it runs in.
"""

from __future__ import annotations

import shlex

from studio_core import backends
from studio_core.backends.shell import export_lines, job_name, mesh_note
from studio_core.machine.children import REPO_ROOT
from studio_core.training.plan import WORKER_MODULE, Plan


def launch_script(plan: Plan, run_dir: str = "./studio-run") -> str:
    """A bash script that runs this plan on one machine, writing the run to $RUN_DIR."""
    nproc = plan.spec.layout.nproc
    env = {k: v for k, v in plan.env.items() if k != "STUDIO_RUN_ID"}
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Exported from the studio: {job_name(plan.spec.display_name)}, {nproc} process(es) on one machine.",
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
