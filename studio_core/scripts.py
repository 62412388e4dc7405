"""Launch scripts exported from a plan: the way out for users who outgrow the studio.

`launch_script` writes a bash script that runs the same torchrun, with the same
environment, on this kind of machine; `slurm_script` writes a Slurm batch script that
runs it on several trn nodes (torchrun with --nnodes and a c10d rendezvous on the first
node). Both carry the resolved spec inline, so they need only this repository (for the
worker) and the same Python environment. A script holds no secret: HF_TOKEN is read
from the environment it runs in.
"""

from __future__ import annotations

import shlex

from studio_core import slurm
from studio_core.children import REPO_ROOT
from studio_core.plan import WORKER_MODULE, Plan

RDZV_PORT = 29500


# Cores of this machine: a Slurm job's nodes are its own, so its script names none.
MACHINE_CORES = ("NEURON_RT_VISIBLE_CORES", "STUDIO_NEURON_CORES", "CUDA_VISIBLE_DEVICES")


def _header(plan: Plan, run_dir: str, cluster: bool = False) -> list[str]:
    env = {k: v for k, v in plan.env.items() if k != "STUDIO_RUN_ID" and not (cluster and k in MACHINE_CORES)}
    spec_yaml = plan.spec.to_yaml()
    return [
        "set -euo pipefail",
        f"RUN_DIR=$(realpath -m \"${{RUN_DIR:-{run_dir}}}\")  # relative to where the script starts",
        'mkdir -p "$RUN_DIR"',
        f"cd {shlex.quote(str(REPO_ROOT))}  # the worker is studio_core.worker in this repository",
        "cat > \"$RUN_DIR/spec.yaml\" <<'SPEC'",
        spec_yaml.rstrip("\n"),
        "SPEC",
        *[f"export {key}={shlex.quote(value)}" for key, value in env.items()],
        'export STUDIO_RUN_ID="${STUDIO_RUN_ID:-$(basename "$RUN_DIR")}"',
    ]


def _mesh_note(plan: Plan) -> list[str]:
    layout = plan.spec.layout
    if layout.tp_size == 1 and layout.fsdp_size == 1:
        return []
    return [f"# Each node runs one TP {layout.tp_size} x FSDP {layout.fsdp_size} mesh; the worker replicates it "
            "across nodes (DistributedConfig dp_replicate_size = the number of nodes: HSDP)."]


def _python(plan: Plan) -> str:
    return shlex.quote(plan.argv[0])


def launch_script(plan: Plan, run_dir: str = "./studio-run") -> str:
    """A bash script that runs this plan on one machine, writing the run to $RUN_DIR."""
    nproc = plan.spec.layout.nproc
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Exported from the studio: {slurm.job_name(plan.spec.display_name)}, {nproc} process(es) on one machine.",
        *_header(plan, run_dir),
        f"exec {_python(plan)} -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node={nproc} \\",
        f'  -m {WORKER_MODULE} "$RUN_DIR"',
        "",
    ])


def slurm_script(plan: Plan, nodes: int, run_dir: str = "./studio-run") -> str:
    """A Slurm batch script: the same run on `nodes` trn nodes, each running the plan's processes."""
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, got {nodes}")
    nproc = plan.spec.layout.nproc
    return "\n".join([
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={slurm.job_name(plan.spec.display_name)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"# Exported from the studio: {nodes} node(s) x {nproc} process(es); the first node hosts",
        "# the c10d rendezvous. Submit with: sbatch THIS_FILE",
        "# RUN_DIR and this repository must be on a filesystem every node sees (e.g. FSx for Lustre).",
        *_mesh_note(plan),
        *_header(plan, run_dir, cluster=True),
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun {_python(plan)} -m torch.distributed.run --nnodes=\"$SLURM_NNODES\" --nproc-per-node={nproc} \\",
        f'  --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:{RDZV_PORT}" \\',
        f'  -m {WORKER_MODULE} "$RUN_DIR"',
        "",
    ])
