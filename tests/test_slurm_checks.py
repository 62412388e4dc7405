"""What the Slurm backend reads and refuses, without a cluster: Slurm's outputs parsed, the
user's Slurm settings checked, a Slurm plan and its batch script, the form's Slurm widgets."""

import pytest

from studio_core.backends.slurm.backend import batch_script, slurm_ending
from studio_core.backends.slurm.options import SlurmOptions
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.backends.slurm.tools import Job, check_sbatch_args, check_time, parse_fields, parse_sinfo, parse_squeue
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validate

pytestmark = pytest.mark.fast


def test_partitions_are_read_from_sinfo_with_their_nodes_added_up():
    found = parse_sinfo("trn*|2|infinite|up\ngpu|3|1-00:00:00|up\ngpu|1|1-00:00:00|up\nnoise\n")
    assert found["trn"].default and found["trn"].nodes == 2
    assert found["gpu"].nodes == 4 and not found["gpu"].default and found["gpu"].max_time == "1-00:00:00"


def test_a_queued_job_says_why_it_waits_and_where_it_runs():
    assert parse_squeue("7", "PENDING|Resources|\n").describe() == "Slurm job 7: PENDING (Resources)"
    assert parse_squeue("7", "RUNNING|None|n[1-2]\n").describe() == "Slurm job 7: RUNNING on n[1-2]"
    assert parse_squeue("7", "") is None
    assert Job("7", "COMPLETING", "None", "n1").active and not Job("7", "TIMEOUT", "None", "n1").active


@pytest.mark.parametrize("state,kind,words", [
    ("CANCELLED", "stopped", "cancelled outside the studio"), ("TIMEOUT", "failed", "time limit (00:01:00)"),
    ("NODE_FAIL", "failed", "a node of Slurm job 9 failed (n[1-2]: NodeDown)"),
    ("PREEMPTED", "stopped", "preempted"), ("OUT_OF_MEMORY", "failed", "out of memory on n[1-2]")])
def test_a_job_slurm_ended_reads_as_the_studio_s_state_with_slurm_s_reason(state, kind, words):
    record = parse_fields(f"JobId=9 JobName=x JobState={state} Reason=NodeDown ExitCode=0:15 "
                          "TimeLimit=00:01:00 NodeList=n[1-2] Command=/a b")
    ending = slurm_ending("9", record)
    assert ending.state == kind and words in ending.reason
    assert "no longer keeps its record" in slurm_ending("9", None).reason


def test_time_limits_in_slurm_s_forms_pass_and_others_say_what_to_write():
    for good in ("90", "0:01", "1:30:00", "2-00", "2-12:00", "2-12:00:00", "UNLIMITED"):
        assert check_time(good) is None
    for bad in ("1:2:3:4", "an hour", "1h", "-5", ""):
        assert "1:30:00" in check_time(bad)


def test_sbatch_options_the_studio_owns_are_refused_with_the_setting_to_use():
    assert check_sbatch_args(["--qos=high", "--gres=neuron:16", "--exclusive", "--mail-type=END"]) == []
    [output] = check_sbatch_args(["--output=x.log"])
    assert "train.log" in output
    [partition] = check_sbatch_args(["-p", "trn"])[:1]
    assert "set Partition (--partition) instead" in partition
    assert "is not an option" in check_sbatch_args(["qos=high"])[0]


def test_a_slurm_spec_is_checked_before_asking_any_cluster():
    spec = RunSpec.load("recipes/tiny-sft.yaml").with_overrides(["studio.nodes=2"])
    assert any("set studio.run_on: slurm" in p for p in validate(spec))
    with pytest.raises(SpecError, match="studio.slurm.partiton: unknown key; it takes partition"):
        spec.with_overrides(["studio.run_on=slurm", "studio.slurm={partiton: trn}"])
    spec.layout.run_on, spec.layout.options = "slurm", SlurmOptions(time=5, sbatch_args="--qos=x", auto_resume="y")
    problems = " ".join(validate(spec))
    for words in ("studio.slurm.time: 5 is not text", "sbatch_args: write a list",
                  "studio.slurm.auto_resume: write true or false"):
        assert words in problems
    assert validate(spec.with_overrides(["studio.run_on=local", "studio.nodes=1"])) == [
        "studio.slurm: these settings are for studio.run_on: slurm, but the run is local"]
    assert "leave cores empty" in " ".join(validate(spec.with_overrides(["studio.cores=0-1"])))
    spec.layout.options = SlurmOptions(partition="trn", time="10", sbatch_args=["--qos=high"])
    assert validate(spec) == []
    again = RunSpec.from_dict(spec.to_dict())  # saved and read back, as the run folder holds it
    assert again.layout == spec.layout
    assert "nodes" not in RunSpec().to_dict()["studio"]  # a local recipe stays as it was


def test_a_slurm_plan_names_no_core_sets_efa_on_trainium_and_submits_one_supervisor_per_node():
    spec = RunSpec.load("recipes/tiny-sft.yaml").with_overrides(["studio.run_on=slurm", "studio.nodes=4",
                                                                "studio.nproc=32"])
    spec.layout.options = SlurmOptions(partition="trn", time="2-00:00:00", account="ml", auto_resume=True,
                                       sbatch_args=["--qos=high"])
    launch = plan(spec, instance_hardware("trn2.48xlarge", lnc=2), run_dir="/fsx/runs/r1", run_id="r1",
                  compile_cache="/fsx/cache")
    assert launch.backend == "slurm" and launch.cores is None and not launch.errors
    # each node is the job's alone: no core named, for the process or per rank (torch-neuronx picks by LOCAL_RANK)
    assert "NEURON_RT_VISIBLE_CORES" not in launch.env and "STUDIO_NEURON_CORES" not in launch.env
    assert launch.env["HF_DEACTIVATE_ASYNC_LOAD"] == "1"
    assert {k: launch.env[k] for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE")} == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    reasons = {key: why for key, _, why in launch.applied}
    assert "RDMA" in reasons["FI_EFA_USE_DEVICE_RDMA"] and "each node compiles alone" in reasons["compile cache"]
    assert "--nnodes=4" in launch.argv and "--rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT" in launch.argv
    script = batch_script(launch)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --partition=trn",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --account=ml", "exec >>/fsx/runs/r1/train.log 2>&1",
                 "export FI_PROVIDER=efa", "srun --label --kill-on-bad-exit=1 --auto-resume=1"):
        assert line in script
    assert "-m studio_core.training.supervisor /fsx/runs/r1" in script
    described = launch.describe()
    assert described.startswith("Command (runs on a Slurm cluster):")
    assert "sbatch --parsable --qos=high slurm.sh" in described


def test_the_form_s_slurm_widgets_make_the_spec_and_back():
    from app.train_form import form_values, spec_from_form

    spec = RunSpec.load("recipes/tiny-sft.yaml").with_overrides(["studio.run_on=slurm", "studio.nodes=2"])
    spec.layout.options = SlurmOptions(partition="trn", time="30", sbatch_args=["--comment=a b", "--qos=high"])
    values = form_values(spec, trackers=["none"])
    values |= {"target": "this machine", "lnc": 2}
    again = spec_from_form(values)
    assert again.layout == spec.layout
    local = spec_from_form(values | {"run_on": "local", "nodes": 4})
    assert local.layout.run_on == "local" and local.layout.nodes == 1 and local.layout.options is None


def test_a_plan_on_the_cpu_for_slurm_takes_no_core_of_this_machine():
    spec = RunSpec.load("recipes/tiny-sft.yaml").with_overrides(["studio.run_on=slurm", "studio.nodes=2"])
    launch = plan(spec, cpu_hardware(), run_dir="/tmp/runs/r1", run_id="r1", compile_cache="/tmp/cache")
    assert any("on this machine's own disk" in w for w in launch.warnings)
    assert "studio.cores" not in {key for key, _, _ in launch.applied}


def test_an_auto_resumed_step_goes_on_from_the_newest_checkpoint_its_job_saved(tmp_path):
    import json
    import os

    from studio_core.backends.slurm.node import auto_resumed

    def checkpoint(step, mtime):
        folder = tmp_path / "output" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        os.utime(folder, (mtime, mtime))

    (tmp_path / "slurm.json").write_text(json.dumps({"job_id": "5", "submitted": 1000.0}))
    checkpoint(10, 900.0)  # an earlier attempt's
    assert auto_resumed(tmp_path, {"STUDIO_AUTO_RESUME": "1"}) is None  # this job's first start
    checkpoint(20, 1100.0)
    assert auto_resumed(tmp_path, {"STUDIO_AUTO_RESUME": "1"})["step"] == 20  # the step started again
    assert auto_resumed(tmp_path, {}) is None  # without auto-resume the studio resumes
