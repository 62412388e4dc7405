"""The compiler's LNC and the precompile jobs a host can hold (issue 30, items 5 and 7).

LNC: AWS's "Logical NeuronCore configuration" page requires the compiler's --lnc to equal the
runtime's NEURON_LOGICAL_NC_CONFIG. TorchNeuron passes --lnc from NEURON_LOGICAL_NC_CONFIG to the
compiler itself and appends NEURON_CC_FLAGS, part of every NEFF cache key (issue 45, item 3): every
process the studio puts on Neuron gets NEURON_LOGICAL_NC_CONFIG and the user's own NEURON_CC_FLAGS
exactly as given, no --lnc added; a user --lnc that names another LNC is refused before anything starts.

Precompile: neuronx-cc compiles on the host, so the default number of parallel precompile jobs
is capped by the host's vCPUs and memory as well as the cores, and the plan says which limit
set it; a number chosen above those is warned of.

All through the pure planning functions, fed with the instance table's descriptions.
"""

import os
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from studio_core.serve.chat import ChatError, ChatProcess
from studio_core.machine.device_env import device_env
from studio_core.doctor import doctor
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.recipe.spec import RunSpec

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app

TINY = Path(__file__).parent.parent / "recipes" / "tiny-sft.yaml"
PRECOMPILED = ["torch_compile=true", "studio.precompile=true"]
TRN2_3XL = instance_hardware("trn2.3xlarge")
LNC_PAGE = "Logical NeuronCore configuration"


def spec(*overrides: str) -> RunSpec:
    return RunSpec.load(TINY).with_overrides(list(overrides))


def applied(launch) -> dict:
    return {key: (value, reason) for key, value, reason in launch.applied}


@pytest.fixture
def no_flags(monkeypatch):
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)


# --- item 5 (issue 30), item 3 (issue 45): the compiler's LNC ------------------------------
@pytest.mark.parametrize("instance, lnc", [("trn2.3xlarge", 2), ("trn2.3xlarge", 1), ("trn2.48xlarge", 2),
                                           ("trn2.48xlarge", 1), ("trn3.48xlarge", 2)])
def test_a_neuron_plan_sets_the_runtimes_lnc_and_adds_no_compiler_flag(no_flags, instance, lnc):
    """TorchNeuron passes --lnc from NEURON_LOGICAL_NC_CONFIG itself: an --lnc of the studio's would
    reach the compiler twice and change every NEFF cache key against a plain TorchNeuron run."""
    launch = plan(spec(), instance_hardware(instance, lnc=lnc))
    assert launch.errors == []
    assert launch.env["NEURON_LOGICAL_NC_CONFIG"] == str(lnc)
    assert "NEURON_CC_FLAGS" not in launch.env and "NEURON_CC_FLAGS" not in applied(launch)
    assert "--lnc" not in launch.command_line() and "NEURON_CC_FLAGS" not in launch.describe()


def test_chat_export_and_the_doctor_add_no_compiler_flag_either(no_flags, monkeypatch, tmp_path):
    for cores in ([3], None):  # a chat or evaluation on its core; an export or a Slurm node naming none
        env = device_env(TRN2_3XL, tmp_path, cores)
        assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and "NEURON_CC_FLAGS" not in env
    assert "NEURON_CC_FLAGS" not in device_env(instance_hardware("trn2.3xlarge", lnc=1), tmp_path, [0])
    check = doctor.compiler_flags(TRN2_3XL)
    assert check.ok and "NEURON_CC_FLAGS not set" in check.found
    assert "TorchNeuron passes --lnc=2 from NEURON_LOGICAL_NC_CONFIG" in check.found
    # off Neuron the flags are not the studio's business: not set, not checked
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=1")
    assert "NEURON_CC_FLAGS" not in device_env(cpu_hardware(), tmp_path, [0])
    on_cpu = plan(spec(), cpu_hardware())
    assert "NEURON_CC_FLAGS" not in on_cpu.env and on_cpu.errors == []


@pytest.mark.parametrize("flags", ["-O1 --model-type=transformer", "  --auto-cast=none  ", "", "-O1 --lnc=2",
                                   "--logical-nc-config 2 -O1", "-lnc=2"])
def test_the_users_own_flags_are_kept_exactly_as_given(monkeypatch, tmp_path, flags):
    monkeypatch.setenv("NEURON_CC_FLAGS", flags)
    launch = plan(spec(), TRN2_3XL)
    assert launch.errors == []
    assert launch.env["NEURON_CC_FLAGS"] == flags  # nothing added, nothing stripped: the cache key is theirs
    value, reason = applied(launch)["NEURON_CC_FLAGS"]
    assert value == flags and "kept exactly as given" in reason and LNC_PAGE in reason
    assert device_env(TRN2_3XL, tmp_path, None)["NEURON_CC_FLAGS"] == flags
    check = doctor.compiler_flags(TRN2_3XL)
    assert check.ok and f"NEURON_CC_FLAGS={flags!r} kept as given" in check.found


@pytest.mark.parametrize("flags, option", [
    ("--lnc=1", "--lnc"), ("-O1 --lnc 1", "--lnc"), ("-lnc=1", "-lnc"), ("-lnc 1 -O1", "-lnc"),
    ("--logical-nc-config=1", "--logical-nc-config"), ("--logical-nc-config 1", "--logical-nc-config"),
])
def test_a_user_lnc_that_disagrees_is_refused_before_launch(monkeypatch, tmp_path, flags, option):
    monkeypatch.setenv("NEURON_CC_FLAGS", flags)
    launch = plan(spec(), TRN2_3XL)
    (error,) = [e for e in launch.errors if "NEURON_CC_FLAGS" in e]
    assert "runtime runs at LNC=2" in error and LNC_PAGE in error
    assert (f"remove {option} from NEURON_CC_FLAGS (TorchNeuron passes --lnc=2 from NEURON_LOGICAL_NC_CONFIG "
            "itself)") in error
    # the rest of the plan still shows; what it would launch does not carry the refused flags
    assert "NEURON_CC_FLAGS" not in launch.env and launch.env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    # the same flags are right for an LNC=1 plan, and kept as written there
    one = plan(spec(), instance_hardware("trn2.3xlarge", lnc=1))
    assert one.errors == [] and one.env["NEURON_CC_FLAGS"] == flags
    # a chat (and an evaluation, which starts the same way) is refused before its process starts
    with pytest.raises(ChatError, match=f"remove {option} from NEURON_CC_FLAGS"):
        ChatProcess.spawn("studio_core.serve.chat_worker", {"kind": "chat"}, tmp_path, TRN2_3XL, None)
    check = doctor.compiler_flags(TRN2_3XL)
    assert not check.ok and "runtime runs at LNC=2" in check.found and f"remove {option}" in check.fix


@pytest.mark.parametrize("flags, expected", [
    ("-O1 --lnc", "sets --lnc (no value)"),
    ('-O1 --tensorizer-options="--a', "cannot be read as shell words"),
])
def test_flags_that_cannot_be_read_are_refused_with_the_fix(monkeypatch, flags, expected):
    monkeypatch.setenv("NEURON_CC_FLAGS", flags)
    (error,) = [e for e in plan(spec(), TRN2_3XL).errors if "NEURON_CC_FLAGS" in e]
    assert expected in error and ("remove --lnc" in error or "fix its quoting, or unset it" in error)


# --- item 7: precompile jobs within the host's vCPUs and memory ----------------------------
def test_the_instance_table_knows_each_hosts_vcpus_and_memory():
    assert (TRN2_3XL.vcpus, TRN2_3XL.host_memory_gib) == (12, 128)
    big = instance_hardware("trn2.48xlarge")
    assert (big.vcpus, big.host_memory_gib) == (192, 2048)


def test_this_machine_is_described_from_psutil_and_its_cpu_affinity():
    here = cpu_hardware()
    assert here.vcpus == len(os.sched_getaffinity(0))
    assert here.host_memory_gib == pytest.approx(psutil.virtual_memory().total / 2**30, abs=0.1)


def test_a_trn2_3xlarge_runs_as_many_jobs_as_its_12_vcpus_hold_and_says_so(no_flags):
    launch = plan(spec(*PRECOMPILED), TRN2_3XL)
    assert launch.errors == []
    jobs, why = applied(launch)["studio.precompile_jobs"]
    assert jobs == launch.spec.precompile_jobs == 3  # 4 NeuronCores, but 12 vCPUs at ~4 per job
    assert why.startswith("3 precompile jobs: trn2.3xlarge has 12 vCPUs, ~4 per compile job")
    # a trn2.48xlarge (64 NeuronCores, 192 vCPUs, 2 TiB) stops at the default maximum
    jobs, why = applied(plan(spec(*PRECOMPILED), instance_hardware("trn2.48xlarge")))["studio.precompile_jobs"]
    assert jobs == 8 and "at most 8" in why


def test_host_memory_caps_the_jobs_when_it_is_the_tighter_limit(no_flags):
    small = replace(TRN2_3XL, host_memory_gib=40)  # a container given 40 GiB of the instance's 128
    jobs, why = applied(plan(spec(*PRECOMPILED), small))["studio.precompile_jobs"]
    assert jobs == 2 and "trn2.3xlarge has 40 GiB of host memory, ~16 GiB per compile job" in why
    starved = replace(TRN2_3XL, vcpus=2)
    assert applied(plan(spec(*PRECOMPILED), starved))["studio.precompile_jobs"][0] == 1  # never 0


def test_jobs_chosen_above_what_the_host_holds_are_warned_of_not_refused(no_flags):
    over = plan(spec(*PRECOMPILED, "studio.precompile_jobs=4"), TRN2_3XL)
    assert over.errors == [] and over.spec.precompile_jobs == 4
    (warning,) = [w for w in over.warnings if w.startswith("studio.precompile_jobs")]
    assert "4 parallel compile jobs, but trn2.3xlarge has 12 vCPUs" in warning and "3 fit" in warning
    within = plan(spec(*PRECOMPILED, "studio.precompile_jobs=3"), TRN2_3XL)
    assert not [w for w in within.warnings if w.startswith("studio.precompile_jobs")]
