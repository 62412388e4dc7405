"""The exported Slurm batch script is the one the studio submits (issue 30): one generator, the
same text for the same plan but the run id, the EFA settings of a Trainium plan in both; and its
job, started by plain sbatch, makes a run folder the studio lists as one of its runs. Without a
cluster: the script's job step runs in a real bash with SLURM_JOB_ID set and `srun` a function.
tests/test_slurm.py trains an exported script on the real 2-node test cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from cli.main import main
from studio_core.backends.slurm.backend import batch_script
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.machine.hardware import Hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.rundir import events
from studio_core.runs.manager import RunManager
from studio_core.training.scripts import submit_script
from studio_core.data.sources import model_config
from studio_core.recipe.spec import RunSpec

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"
EFA = ("export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1", "export FI_EFA_FORK_SAFE=1")


def exported_run_id(script: str) -> str:
    return re.search(r"written by the studio for run (\S+)\.$", script, re.M).group(1)


def test_the_exported_script_is_the_submitted_one_but_the_run_id_with_efa_for_trainium(tmp_path, capsys):
    runs, path = tmp_path / "runs", tmp_path / "job.sh"
    code = main(["plan", str(RECIPE), "--instance", "trn2.48xlarge", "--slurm-script", str(path), "--nodes", "4",
                 "--no-forecast", "--runs-dir", str(runs)])
    out = capsys.readouterr()
    assert code == 0, out.err
    exported = path.read_text()
    for line in EFA:  # AWS's multi-node settings, which the plan sets for Neuron nodes
        assert line in exported.splitlines()
    run_id = exported_run_id(exported)
    assert f"run {run_id}: submit it with `sbatch {path}`" in out.out
    assert not (runs / run_id).exists()  # the job makes it, when it starts
    # what Start submits for the same recipe on Slurm: the batch script SlurmBackend.submit writes
    # (slurm.sh), of the manager's plan for a run of its own
    spec = RunSpec.load(RECIPE).with_overrides(["studio.run_on=slurm", "studio.nodes=4"])
    other = "20990101-000000-tiny-sft-abcdef"
    submitted = batch_script(plan(spec, instance_hardware("trn2.48xlarge"), run_dir=runs / other, run_id=other,
                                  compile_cache=compile_cache_root(),
                                  model_config=model_config(spec.model_name_or_path)))  # as the manager plans
    assert exported.replace(run_id, other).splitlines() == submitted.splitlines()
    assert "#SBATCH --nodes=4" in exported and "--output" not in exported  # Slurm opens no file of the folder


def slurm_cpu_plan(runs: Path):
    """A 2-node plan on CPU nodes, exported for a new run of `runs`."""
    spec = RunSpec.load(RECIPE).with_overrides(["max_steps=3"])
    return RunManager(runs).export_plan(spec, Hardware("cpu", 1, cpu_count=1), nodes=2)


def run_as_job(script: Path, cwd: Path, job_id: str | None) -> subprocess.CompletedProcess:
    """The script as its batch step runs it, on a real bash; Slurm's srun a function that says what it got."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"SLURM_JOB_ID": job_id} if job_id else {}
    return subprocess.run(["bash", "-c", f'srun() {{ echo "srun $*" > {cwd}/srun.txt; }}; source "$0"', str(script)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_exported_script_s_job_makes_a_run_the_studio_lists_and_starts_it_once(tmp_path):
    runs = tmp_path / "runs"
    job = slurm_cpu_plan(runs)
    script = tmp_path / "job.sh"
    script.write_text(submit_script(job))
    run_id = exported_run_id(script.read_text())
    run_dir = runs / run_id

    no_slurm = run_as_job(script, tmp_path, None)
    assert no_slurm.returncode == 2 and "submit it with `sbatch FILE`" in no_slurm.stderr
    assert not run_dir.exists() and not (tmp_path / "srun.txt").exists()

    first = run_as_job(script, tmp_path, "4242")
    assert first.returncode == 0, first.stderr + first.stdout
    assert (tmp_path / "srun.txt").read_text().startswith("srun --label --kill-on-bad-exit=1 ")
    assert f"-m studio_core.training.supervisor {run_dir}" in (tmp_path / "srun.txt").read_text()
    # the folder Start would have written, and the job recorded in it
    assert (run_dir / "spec.yaml").read_text() == job.spec.to_yaml()
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["argv"] == job.argv and launch["env"] == job.env and launch["backend"] == "slurm"
    assert launch["hardware"]["backend"] == "cpu" and isinstance(launch["created"], float)
    assert json.loads((run_dir / "slurm.json").read_text())["job_ids"] == ["4242"]
    assert (run_dir / "slurm.sh").read_text() == script.read_text()
    [view] = RunManager(runs).list()
    assert view.id == run_id and view.spec_problem is None and view.where().startswith("Slurm job 4242")
    assert view.state == "starting"

    # the studio's own start: the folder is there, the job recorded already; nothing else changes
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    again = run_as_job(script, tmp_path, "4242")
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name in before} == before

    (tmp_path / "srun.txt").unlink()
    twice = run_as_job(script, tmp_path, "4243")  # the same script submitted a second time
    assert twice.returncode == 2 and "already Slurm job 4242's" in twice.stderr
    assert not (tmp_path / "srun.txt").exists()

    events.append(run_dir / "events.jsonl", events.status("finished", exit_code=0))
    ended = run_as_job(script, tmp_path, "4244")
    assert ended.returncode == 2 and f"launch.py train --resume {run_id}" in ended.stderr
    assert json.loads((run_dir / "slurm.json").read_text())["job_id"] == "4242"
    assert "Traceback" not in no_slurm.stderr + twice.stderr + ended.stderr


def test_a_resumed_run_s_new_job_may_start_it_again(tmp_path):
    runs = tmp_path / "runs"
    job = slurm_cpu_plan(runs)
    script = tmp_path / "job.sh"
    script.write_text(submit_script(job))
    run_dir = runs / exported_run_id(script.read_text())
    assert run_as_job(script, tmp_path, "7").returncode == 0
    events.append(run_dir / "events.jsonl", events.status("stopped"))
    # what RunManager.resume writes before it submits again: a new attempt
    events.append(run_dir / "events.jsonl", events.resume(1, str(run_dir / "output" / "checkpoint-1")))
    events.append(run_dir / "events.jsonl", events.status("starting"))
    resumed = run_as_job(script, tmp_path, "8")
    assert resumed.returncode == 0, resumed.stderr
    recorded = json.loads((run_dir / "slurm.json").read_text())
    assert recorded["job_id"] == "8" and recorded["job_ids"] == ["7", "8"]


def test_a_plan_for_this_machine_gets_no_batch_script():
    spec = RunSpec.load(RECIPE)
    with pytest.raises(ValueError, match="needs a plan for a cluster"):
        submit_script(plan(spec, Hardware("cpu", 1, cpu_count=1)))
