"""Exported launch scripts: valid bash, the plan's environment, and the exported one really runs."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from studio_core.hardware import cpu_hardware, instance_hardware
from studio_core.plan import plan
from studio_core.scripts import launch_script, slurm_script
from studio_core.spec import RunSpec

RECIPES = Path(__file__).parent.parent / "recipes"


def bash_syntax_ok(script: str, tmp_path: Path) -> bool:
    path = tmp_path / "script.sh"
    path.write_text(script)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def exported_env(script: str) -> dict[str, str]:
    pairs = [shlex.split(line.removeprefix("export "))[0] for line in script.splitlines()
             if line.startswith("export ") and "STUDIO_RUN_ID" not in line]
    return dict(pair.split("=", 1) for pair in pairs)


@pytest.mark.fast
def test_scripts_for_a_trainium_layout_carry_the_plans_environment(tmp_path):
    spec = RunSpec.load(RECIPES / "qwen3-8b-sft-tp4-fsdp8.yaml")
    launch = plan(spec, instance_hardware("trn2.48xlarge"))
    assert launch.errors == []
    expected = {k: v for k, v in launch.env.items() if k != "STUDIO_RUN_ID"}
    on_cluster = {k: v for k, v in expected.items() if k not in ("STUDIO_NEURON_CORES", "NEURON_RT_VISIBLE_CORES")}
    assert expected["STUDIO_NEURON_CORES"] == "0-31" and "NEURON_RT_VISIBLE_CORES" not in expected
    for script, env in ((launch_script(launch), expected), (slurm_script(launch, nodes=4), on_cluster)):
        assert bash_syntax_ok(script, tmp_path)
        assert exported_env(script) == env  # a Slurm node is the job's: no core of it named
        assert expected["TP_SIZE"] == "4" and expected["FSDP_SIZE"] == "8"
        assert "--nproc-per-node=32" in script
    slurm = slurm_script(launch, nodes=4)
    assert "#SBATCH --nodes=4" in slurm and "--rdzv-backend=c10d" in slurm and '--nnodes="$SLURM_NNODES"' in slurm
    assert "dp_replicate_size = the number of nodes" in slurm  # what the worker's mesh_sizes does


def test_the_exported_script_runs_the_same_training(tmp_path):
    spec = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["max_steps=3"])
    script = tmp_path / "run.sh"
    script.write_text(launch_script(plan(spec, cpu_hardware(), compile_cache=tmp_path / "compile-cache")))
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RUN_DIR": "exported-run"})
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "exported-run"
    assert RunSpec.load(run_dir / "spec.yaml") == plan(spec, cpu_hardware()).spec
    assert (run_dir / "output" / "config.json").exists()
    assert '"state": "running"' in (run_dir / "events.jsonl").read_text()
