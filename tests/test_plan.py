"""Tests for the planner (studio_core.training.plan): spec + hardware in, the exact launch out.

Pure data in, pure data out, so Trainium layouts are checked on a machine without one.
"""

import copy
import sys
from pathlib import Path

import pytest

from studio_core.machine.cores import parse_cores
from studio_core.machine.device_env import rank_cores
from studio_core.machine.hardware import TORCH_XLA_PROBLEM, Hardware, instance_hardware
from studio_core.training.plan import DYNAMIC_SHAPES_OFF, WORKER_MODULE, plan
from studio_core.recipe.spec import RunSpec

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

TINY = Path(__file__).parent.parent / "recipes" / "tiny-sft.yaml"
CPU8 = Hardware("cpu", 8, cpu_count=8)
TRN2_3XL = instance_hardware("trn2.3xlarge")


def spec(*overrides: str) -> RunSpec:
    return RunSpec.load(TINY).with_overrides(list(overrides))


def applied_keys(launch) -> dict:
    return {key: value for key, value, _ in launch.applied}


# --- the hardware tables ----------------------------------------------------------------
@pytest.mark.parametrize("instance, lnc, cores, chips", [
    ("trn2.3xlarge", 2, 4, 1),
    ("trn2.3xlarge", 1, 8, 1),
    ("trn2.48xlarge", 2, 64, 16),
])
def test_instance_hardware(instance, lnc, cores, chips):
    hardware = instance_hardware(instance, lnc=lnc)
    assert (hardware.backend, hardware.devices, hardware.chips, hardware.lnc) == ("neuron", cores, chips, lnc)
    assert not hardware.detected
    assert f"{cores} NeuronCores" in hardware.describe()


def test_lnc_1_on_a_trn2_48xlarge_plans_128_ranks_one_core_each():
    """128 logical cores: TorchNeuron allows 128 devices per process, and each rank sees one."""
    launch = plan(spec("studio.nproc=128"), instance_hardware("trn2.48xlarge", lnc=1))
    assert launch.errors == []
    assert launch.env["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert rank_cores(launch.env) == [str(core) for core in range(128)]


def test_unknown_instance_lists_the_known_ones():
    with pytest.raises(ValueError, match="trn2.3xlarge, trn2.48xlarge"):
        instance_hardware("trn1.2xlarge")


# --- purity -----------------------------------------------------------------------------
@pytest.mark.parametrize("hardware", [CPU8, TRN2_3XL], ids=["cpu", "neuron"])
def test_plan_is_pure(hardware):
    original = spec("studio.nproc=2", "model_init_kwargs={dtype: float32}")
    before = copy.deepcopy(original)
    first = plan(original, hardware, run_dir="/runs/r1", run_id="r1", compile_cache="/cache")
    second = plan(original, hardware, run_dir="/runs/r1", run_id="r1", compile_cache="/cache")
    assert first == second
    assert original == before  # the spec given is not changed
    assert first.spec is not original and first.spec.args is not original.args


# --- what each backend applies ----------------------------------------------------------
CPU_APPLIED = {"use_cpu": True, "bf16": False, "ddp_backend": "gloo", "ddp_find_unused_parameters": False,
               "dataloader_pin_memory": False, "disable_tqdm": True, "logging_first_step": True}
NEURON_APPLIED = {"bf16": True, "torch_compile": True, "dataloader_drop_last": True,
                  "pad_to_multiple_of": "auto", "disable_tqdm": True, "logging_first_step": True}


@pytest.mark.parametrize("hardware, expected, absent", [
    (CPU8, CPU_APPLIED, ["torch_compile", "model_init_kwargs", "dataloader_drop_last"]),
    (TRN2_3XL, NEURON_APPLIED, ["use_cpu", "ddp_backend"]),
], ids=["cpu", "neuron"])
def test_backend_defaults_are_applied_each_with_a_reason(hardware, expected, absent):
    launch = plan(spec(), hardware)
    for key, value in expected.items():
        assert launch.spec.args[key] == value, key
        assert applied_keys(launch)[key] == value, key
    for key in absent:
        assert key not in launch.spec.args, key
    for key, _, reason in launch.applied:
        assert len(reason) > 20, f"{key} needs a reason the user can read"
    assert launch.warnings == [] and launch.errors == []
    assert launch.spec.args["max_steps"] == 300  # the recipe's own values stay


def test_neuron_plan_for_trn2_3xlarge():
    launch = plan(spec("studio.nproc=4"), TRN2_3XL, run_dir="/runs/r1", run_id="r1", compile_cache="/cache")
    assert launch.spec.args["model_init_kwargs"] == {"device_map": None}
    applied = applied_keys(launch)
    assert "model_init_kwargs.device_map" in applied and applied["model_init_kwargs.device_map"] is None
    assert applied[DYNAMIC_SHAPES_OFF] is False  # torch_compile is on
    assert launch.env["HF_DEACTIVATE_ASYNC_LOAD"] == "1"
    assert "NEURON_RT_VISIBLE_CORES" not in launch.env  # no range shared by the 4 ranks
    assert launch.env["STUDIO_NEURON_CORES"] == "0-3" and rank_cores(launch.env) == ["0", "1", "2", "3"]
    assert applied["NEURON_RT_VISIBLE_CORES"] == "rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3"
    assert launch.env["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/cache/neuron/neff"
    assert launch.env["TORCHINDUCTOR_CACHE_DIR"] == "/cache/neuron/inductor"
    assert launch.env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert "OMP_NUM_THREADS" not in launch.env
    assert launch.errors == []


@pytest.mark.parametrize("overrides, cores", [
    ([], ["0"]),
    (["studio.nproc=2"], ["0", "1"]),
    (["studio.nproc=4"], ["0", "1", "2", "3"]),
    (["studio.nproc=2", "studio.cores=2-3"], ["2", "3"]),
])
def test_each_rank_sees_one_core_of_its_own(overrides, cores):
    env = plan(spec(*overrides), TRN2_3XL).env
    assert rank_cores(env) == cores
    # one process: its core directly; several: no shared range, the block for the ranks to split
    assert ("NEURON_RT_VISIBLE_CORES" in env) == (len(cores) == 1) != ("STUDIO_NEURON_CORES" in env)


def test_the_recipes_model_init_kwargs_are_kept_on_neuron():
    launch = plan(spec("model_init_kwargs={device_map: cpu, dtype: bfloat16}"), TRN2_3XL)
    assert launch.spec.args["model_init_kwargs"] == {"device_map": "cpu", "dtype": "bfloat16"}
    assert "model_init_kwargs.device_map" not in applied_keys(launch)
    launch = plan(spec("model_init_kwargs={dtype: bfloat16}"), TRN2_3XL)
    assert launch.spec.args["model_init_kwargs"] == {"dtype": "bfloat16", "device_map": None}


def test_recipe_value_is_kept_over_a_default_that_is_not_forced():
    launch = plan(spec("ddp_backend=mpi", "dataloader_pin_memory=true"), CPU8)
    assert launch.spec.args["ddp_backend"] == "mpi"
    assert launch.spec.args["dataloader_pin_memory"] is True
    assert "ddp_backend" not in applied_keys(launch) and "dataloader_pin_memory" not in applied_keys(launch)
    assert launch.warnings == []
    launch = plan(spec("torch_compile=false"), TRN2_3XL)
    assert launch.spec.args["torch_compile"] is False
    assert DYNAMIC_SHAPES_OFF not in applied_keys(launch)


def test_a_forced_default_overrides_the_recipe_with_a_warning():
    launch = plan(spec("bf16=true"), CPU8)
    assert launch.spec.args["bf16"] is False
    assert applied_keys(launch)["bf16"] is False
    (warning,) = launch.warnings
    assert warning.startswith("bf16:") and "True" in warning and "cpu" in warning


def test_a_recipe_value_equal_to_a_forced_default_is_not_warned_about():
    launch = plan(spec("use_cpu=true", "bf16=false"), CPU8)
    assert launch.warnings == []
    assert "use_cpu" not in applied_keys(launch) and "bf16" not in applied_keys(launch)


# --- argv and environment ---------------------------------------------------------------
@pytest.mark.parametrize("hardware, nproc", [(CPU8, 2), (TRN2_3XL, 4)], ids=["cpu", "neuron"])
def test_argv_is_torchrun_standalone_on_the_worker(hardware, nproc):
    launch = plan(spec(f"studio.nproc={nproc}"), hardware, run_dir="/runs/r1", run_id="r1")
    assert launch.argv == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                           f"--nproc-per-node={nproc}", "-m", WORKER_MODULE, "/runs/r1"]
    assert launch.env["STUDIO_RUN_ID"] == "r1"
    assert launch.env["PYTHONPATH"] == str(Path(__file__).resolve().parent.parent)
    assert "torch.distributed.run" in launch.command_line()
    assert "STUDIO_RUN_ID=r1" in launch.command_line()


@pytest.mark.parametrize("cores, nproc, threads", [(8, 1, "8"), (8, 2, "4"), (2, 2, "1"), (3, 2, "1")])
def test_cpu_threads_are_shared_out(cores, nproc, threads):
    launch = plan(spec(f"studio.nproc={nproc}"), Hardware("cpu", cores, cpu_count=cores))
    assert launch.env["OMP_NUM_THREADS"] == threads


@pytest.mark.parametrize("model, dataset, offline", [
    ("builtin:tiny-qwen3", "builtin:qa", True),
    ("LOCAL_MODEL", "LOCAL_DATA", True),
    ("builtin:tiny-qwen3", "trl-lib/Capybara", False),
    ("Qwen/Qwen3-0.6B", "builtin:qa", False),
    ("Qwen/Qwen3-0.6B", "trl-lib/Capybara", False),
])
def test_hub_is_offline_only_when_model_and_dataset_are_local(tmp_path, model, dataset, offline):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    model = str(tmp_path / "model") if model == "LOCAL_MODEL" else model
    dataset = str(tmp_path / "data.jsonl") if dataset == "LOCAL_DATA" else dataset
    launch = plan(spec(f"model_name_or_path={model}", f"dataset_name={dataset}"), CPU8)
    assert ("HF_HUB_OFFLINE" in launch.env) == offline
    assert ("HF_HUB_OFFLINE" in applied_keys(launch)) == offline
    assert launch.env["HF_HUB_DISABLE_TELEMETRY"] == "1"


def test_no_secret_from_the_environment_ends_up_in_the_plan(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_leak_1234")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_do_not_leak_5678")
    for hardware in (CPU8, TRN2_3XL):
        launch = plan(spec(), hardware)
        assert "HF_TOKEN" not in launch.env and "AWS_SECRET_ACCESS_KEY" not in launch.env
        text = launch.describe() + repr(launch.env)
        assert "do_not_leak" not in text


def test_tp_and_fsdp_sizes_reach_the_worker_on_neuron():
    launch = plan(spec("studio.nproc=4", "studio.tp_size=2", "studio.fsdp_size=2"), TRN2_3XL)
    assert launch.errors == []
    assert (launch.env["TP_SIZE"], launch.env["FSDP_SIZE"]) == ("2", "2")
    assert "TP_SIZE" not in plan(spec("studio.nproc=4"), TRN2_3XL).env


# --- what cannot launch -----------------------------------------------------------------
@pytest.mark.parametrize("hardware, nproc, limit", [
    (TRN2_3XL, 8, 4),
    (instance_hardware("trn2.48xlarge"), 128, 64),
    (Hardware("cuda", 2, cpu_count=16), 4, 2),
    (Hardware("cpu", 2, cpu_count=2), 3, 2),
])
def test_more_processes_than_devices_is_an_error(hardware, nproc, limit):
    launch = plan(spec(f"studio.nproc={nproc}"), hardware)
    (error,) = launch.errors
    assert error.startswith("studio.nproc:") and f"use at most {limit}" in error
    assert "Cannot launch:" in launch.describe() and error in launch.describe()
    assert plan(spec(f"studio.nproc={limit}"), hardware).errors == []


def test_trn2_48xlarge_takes_64_processes():
    launch = plan(spec("studio.nproc=64"), instance_hardware("trn2.48xlarge"))
    assert launch.errors == [] and launch.env["STUDIO_NEURON_CORES"] == "0-63"
    assert rank_cores(launch.env) == [str(core) for core in range(64)] and "NEURON_RT_VISIBLE_CORES" not in launch.env


def test_tp_or_fsdp_on_cpu_is_an_error():
    launch = plan(spec("studio.nproc=2", "studio.tp_size=2"), CPU8)
    (error,) = launch.errors
    assert "studio.tp_size" in error and "tp_size 1, fsdp_size 1" in error


def test_describe_lists_the_command_and_every_applied_setting():
    launch = plan(spec("bf16=true"), CPU8)
    text = launch.describe()
    assert text.startswith("Command (runs on this machine):")
    for key, _, reason in launch.applied:
        assert f"  {key} = " in text and reason in text
    assert "Warnings:" in text and launch.warnings[0] in text
    assert "Cannot launch:" not in text


@pytest.mark.parametrize("cores", ["0-3", "0,1", "2,3"])
def test_seed_core_sets_on_a_trn2_3xlarge_reach_the_environment(cores):
    nproc = 4 if cores == "0-3" else 2
    launch = plan(spec(f"studio.nproc={nproc}", f"studio.cores='{cores}'"), TRN2_3XL)
    assert launch.errors == [] and launch.env["STUDIO_NEURON_CORES"] == cores  # as the user wrote it
    assert rank_cores(launch.env) == [str(core) for core in parse_cores(cores)]


def test_a_tp_fsdp_layout_shows_the_distributed_config_it_passes():
    launch = plan(spec("studio.nproc=32", "studio.tp_size=4", "studio.fsdp_size=8"),
                  instance_hardware("trn2.48xlarge"))
    assert launch.errors == []
    assert ("model_init_kwargs.distributed_config", "DistributedConfig(tp_size=4, fsdp_size=8)") in [
        (key, value) for key, value, _ in launch.applied]
    assert launch.env["STUDIO_NEURON_CORES"] == "0-31" and "--nproc-per-node=32" in launch.argv
    assert "NEURON_RT_VISIBLE_CORES" not in launch.env and len(set(rank_cores(launch.env))) == 32
    assert dict((k, v) for k, v, _ in launch.applied)["NEURON_RT_VISIBLE_CORES"] == (
        "rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3, ..., rank 31: 31")


# --- GRPO on Neuron: generation defaults, and the overrides known to hurt --------------
GRPO = Path(__file__).parent.parent / "recipes" / "tiny-grpo.yaml"


def test_grpo_on_neuron_generates_with_a_static_cache_a_bf16_model_and_no_vllm():
    bare = RunSpec.from_dict({k: v for k, v in RunSpec.load(GRPO).to_dict().items() if k != "cache_implementation"})
    launch = plan(bare, TRN2_3XL)
    applied = applied_keys(launch)
    assert applied["cache_implementation"] == "static" and applied["use_vllm"] is False
    assert applied["model_init_kwargs.dtype"] == "bfloat16" and applied["bf16"] is True
    assert launch.spec.args["model_init_kwargs"]["dtype"] == "bfloat16" and launch.warnings == []
    on_cpu = applied_keys(plan(bare, CPU8))  # none of it is forced where it does not matter
    assert "cache_implementation" not in on_cpu and "model_init_kwargs.dtype" not in on_cpu


@pytest.mark.parametrize("overrides, warning", [
    (["cache_implementation=dynamic"], "cache_implementation: 'dynamic' makes every generated token a new shape"),
    (["model_init_kwargs={dtype: float32}"], "model_init_kwargs.dtype: 'float32' with the static cache fails"),
    (["use_vllm=true"], "use_vllm: the recipe's True cannot run on neuron; using False"),
    (["pad_to_multiple_of=null"], "pad_to_multiple_of: null compiles a graph for every batch length"),
    (["dataloader_drop_last=false"], "the last, smaller batch one more compilation"),
])
def test_grpo_overrides_known_to_hurt_on_neuron_are_kept_with_what_they_cost(overrides, warning):
    launch = plan(RunSpec.load(GRPO).with_overrides(overrides), TRN2_3XL)
    assert any(warning in w for w in launch.warnings), launch.warnings
    assert plan(RunSpec.load(GRPO).with_overrides(overrides), CPU8).warnings == []  # only Neuron pays


# --- torch_compile on Neuron: SFT's default only ------------------------------------------
@pytest.mark.parametrize("recipe", ["tiny-dpo.yaml", "tiny-grpo.yaml", "tiny-kto.yaml", "tiny-rloo.yaml",
                                    "tiny-reward.yaml"])
def test_torch_compile_is_sfts_neuron_default_and_an_opt_in_with_a_warning_elsewhere(recipe):
    spec_ = RunSpec.load(Path(__file__).parent.parent / "recipes" / recipe)
    launch = plan(spec_, TRN2_3XL)
    assert "torch_compile" not in launch.spec.args and DYNAMIC_SHAPES_OFF not in applied_keys(launch)
    assert not any("torch_compile" in w for w in launch.warnings)
    opted = plan(spec_.with_overrides(["torch_compile=true"]), TRN2_3XL)
    assert opted.spec.args["torch_compile"] is True and applied_keys(opted)[DYNAMIC_SHAPES_OFF] is False
    (warning,) = [w for w in opted.warnings if w.startswith("torch_compile")]
    assert "untested" in warning and "torch_compile: false" in warning
    assert not any("torch_compile" in w for w in plan(spec_.with_overrides(["torch_compile=true"]), CPU8).warnings)
    assert applied_keys(plan(spec(), TRN2_3XL))["torch_compile"] is True  # SFT keeps it


def test_what_detection_found_wrong_is_a_warning_of_every_plan_on_that_machine():
    troubled = Hardware("neuron", 4, cpu_count=8, chips=1, lnc=2, problems=(TORCH_XLA_PROBLEM,))
    launch = plan(spec(), troubled)
    assert TORCH_XLA_PROBLEM in launch.warnings and "pip uninstall torch-xla" in launch.describe()
    assert TORCH_XLA_PROBLEM not in plan(spec(), TRN2_3XL).warnings
