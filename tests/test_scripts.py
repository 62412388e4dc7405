"""Exported launch scripts: valid bash, the plan's environment, and the exported one really runs."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.training.scripts import launch_script, submit_script
from studio_core.recipe.spec import RunSpec

RECIPES = Path(__file__).parent.parent / "recipes"


def bash_syntax_ok(script: str, tmp_path: Path) -> bool:
    path = tmp_path / "script.sh"
    path.write_text(script)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def exported_env(script: str) -> dict[str, str]:
    pairs = [shlex.split(line.removeprefix("export "))[0] for line in script.splitlines()
             if line.startswith("export ") and not line.startswith(("export STUDIO_RUN_ID", "export PYTHONPATH"))]
    return dict(pair.split("=", 1) for pair in pairs)


@pytest.mark.fast
def test_the_one_machine_script_carries_the_plans_environment(tmp_path):
    spec = RunSpec.load(RECIPES / "qwen3-8b-sft-tp4-fsdp8.yaml")
    launch = plan(spec, instance_hardware("trn2.48xlarge"))
    assert launch.errors == []
    expected = {k: v for k, v in launch.env.items() if k not in ("STUDIO_RUN_ID", "PYTHONPATH")}
    assert expected["STUDIO_NEURON_CORES"] == "0-31" and "NEURON_RT_VISIBLE_CORES" not in expected
    assert expected["TP_SIZE"] == "4" and expected["FSDP_SIZE"] == "8"
    script = launch_script(launch)
    assert bash_syntax_ok(script, tmp_path)
    assert exported_env(script) == expected
    # PYTHONPATH goes before the one the script finds, as every process of a run gets it (Plan.env)
    assert f"export PYTHONPATH={shlex.quote(launch.env['PYTHONPATH'])}${{PYTHONPATH:+:$PYTHONPATH}}" in script
    assert "--nproc-per-node=32" in script and "--standalone --nnodes=1" in script
    assert "dp_replicate_size = the number of nodes" in script  # what the worker's mesh_sizes does


@pytest.mark.fast
def test_the_slurm_script_is_the_batch_script_of_a_slurm_plan(tmp_path):
    spec = RunSpec.load(RECIPES / "qwen3-8b-sft-tp4-fsdp8.yaml").with_overrides(["studio.run_on=slurm",
                                                                                  "studio.nodes=4"])
    launch = plan(spec, instance_hardware("trn2.48xlarge"), run_dir=tmp_path / "runs" / "r1", run_id="r1")
    script = submit_script(launch)
    assert bash_syntax_ok(script, tmp_path)
    expected = {k: v for k, v in launch.env.items() if k not in ("STUDIO_RUN_ID", "PYTHONPATH")}
    assert exported_env(script) == expected  # a Slurm node is the job's: no core of it named
    assert "STUDIO_NEURON_CORES" not in expected and expected["FI_PROVIDER"] == "efa"
    assert "#SBATCH --nodes=4" in script and "--nproc-per-node=32" in script and "--nnodes=4" in script
    assert "dp_replicate_size = the number of nodes" in script


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
