"""Tests for studio_core.machine.hardware: the instance table, LNC values, and neuron-ls parsing.

No Trainium here: detection is run against a stand-in `neuron-ls` script and a stand-in
`torch_neuronx` module on PYTHONPATH, each playing the part of the AWS tool or package.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.machine.hardware import (INSTANCES, MAX_DEVICES_PER_PROCESS, cpu_hardware, detect_hardware,
                                   instance_hardware, parse_neuron_ls, studio_cpus)
from studio_core.machine.layout import check_layout
from studio_core.machine import hardware as hardware_module

GIB = 2**30


@pytest.mark.fast
@pytest.mark.parametrize("instance, lnc, cores, chips, memory", [
    ("trn2.3xlarge", 2, 4, 1, 96),
    ("trn2.3xlarge", 1, 8, 1, 96),
    ("trn2.48xlarge", 2, 64, 16, 96),
    ("trn2u.48xlarge", 2, 64, 16, 96),
    ("trn3.48xlarge", 2, 64, 16, 144),
    ("trn2.48xlarge", 1, 128, 16, 96),  # TorchNeuron allows 128 devices per process (issue 45, item 4)
    ("trn2u.48xlarge", 1, 128, 16, 96),
    ("trn3.48xlarge", 1, 128, 16, 144),
])
def test_instance_table(instance, lnc, cores, chips, memory):
    hardware = instance_hardware(instance, lnc=lnc)
    assert (hardware.backend, hardware.devices, hardware.chips, hardware.lnc) == ("neuron", cores, chips, lnc)
    assert hardware.chip_memory_gib == memory and not hardware.detected
    assert f"{cores} NeuronCores on {chips} chip(s), LNC={lnc}, {memory} GiB per chip" in hardware.describe()


@pytest.mark.fast
@pytest.mark.parametrize("instance", ["trn2.48xlarge", "trn2u.48xlarge", "trn3.48xlarge"])
def test_lnc1_on_16_chips_gives_128_cores_and_plans(instance):
    """128 logical cores at LNC=1: TorchNeuron's limit is 128 devices per process, and the
    studio's processes see one core each (or, naming none, the machine's 128)."""
    hardware = instance_hardware(instance, lnc=1)
    assert hardware.devices == 128 == MAX_DEVICES_PER_PROCESS
    assert check_layout(128, 1, 1, "0-127", hardware) == []
    assert check_layout(8, 8, 1, None, hardware) == []


@pytest.mark.fast
def test_no_listed_instance_shows_a_process_more_devices_than_torchneuron_allows():
    for instance in INSTANCES:
        for lnc in (1, 2):
            assert instance_hardware(instance, lnc=lnc).devices <= MAX_DEVICES_PER_PROCESS, (instance, lnc)


@pytest.mark.fast
@pytest.mark.parametrize("lnc", [0, 3, 4, "2", None, True])
def test_lnc_must_be_1_or_2(lnc):
    with pytest.raises(ValueError, match="use 1 or 2"):
        instance_hardware("trn2.3xlarge", lnc=lnc)


@pytest.mark.fast
def test_unknown_instance_lists_every_known_one():
    with pytest.raises(ValueError) as error:
        instance_hardware("trn1.2xlarge")
    assert all(name in str(error.value) for name in INSTANCES)


# --- neuron-ls --json-output ------------------------------------------------------------
# Written from the Neuron LS User Guide's `neuron-ls -j` example on a trn2 48xlarge (which
# prints devices 0 and 15 and elides the rest); the other 14 entries take their BDF and
# connected devices from the same page's table. Not output captured on hardware.
_DOC_TABLE = [("cc:00.0", [12, 3, 4, 1]), ("b5:00.0", [13, 0, 5, 2]), ("b6:00.0", [14, 1, 6, 3]),
              ("cb:00.0", [15, 2, 7, 0]), ("6f:00.0", [0, 7, 8, 5]), ("58:00.0", [1, 4, 9, 6]),
              ("59:00.0", [2, 5, 10, 7]), ("6e:00.0", [3, 6, 11, 4]), ("9b:00.0", [4, 11, 12, 9]),
              ("84:00.0", [5, 8, 13, 10]), ("85:00.0", [6, 9, 14, 11]), ("9a:00.0", [7, 10, 15, 8]),
              ("f8:00.0", [8, 15, 0, 13]), ("e1:00.0", [9, 12, 1, 14]), ("e2:00.0", [10, 13, 2, 15]),
              ("f7:00.0", [11, 14, 3, 12])]
TRN2_48XL_LS = json.dumps([
    {"neuron_device": index, "bdf": bdf, "connected_to": peers, "nc_count": 4,
     "logical_neuroncore_config": 2, "memory_size": 103079215104,
     "neuron_processes": [{"pid": 113985, "command": "neuron-bench exec --run-as-cc-neff --...",
                           "neuron_runtime_version": "2.0.0"}]}
    for index, (bdf, peers) in enumerate(_DOC_TABLE)], indent=4)
# One chip, with the per-device instance_type and neuroncore_ids that some versions add.
TRN2_3XL_LS = json.dumps([{"instance_type": "trn2.3xlarge", "neuron_device": 0, "bdf": "0000:33:00.0",
                           "connected_to": None, "nc_count": 4, "logical_neuroncore_config": 2,
                           "memory_size": 96 * GIB, "neuroncore_ids": [0, 1, 2, 3], "neuron_processes": []}])


@pytest.mark.fast
@pytest.mark.parametrize("text, expected", [
    (TRN2_48XL_LS, {"chips": 16, "cores_per_chip": 4, "lnc": 2, "memory_per_chip": 96 * GIB,
                    "instance_type": None}),
    (TRN2_3XL_LS, {"chips": 1, "cores_per_chip": 4, "lnc": 2, "memory_per_chip": 96 * GIB,
                   "instance_type": "trn2.3xlarge"}),
])
def test_parse_neuron_ls(text, expected):
    assert parse_neuron_ls(text) == expected


@pytest.mark.fast
@pytest.mark.parametrize("text, message", [
    ("instance-type: trn2.48xlarge", "not JSON"),
    ("{}", "not a list of Neuron devices"),
    ("[]", "not a list of Neuron devices"),
    ('[{"neuron_device": 0}]', "nc_count / memory_size"),
    ('[{"nc_count": 4, "memory_size": 1}, {"nc_count": 2, "memory_size": 1}]', "different core counts"),
])
def test_parse_neuron_ls_refuses_other_text(text, message):
    with pytest.raises(ValueError, match=message):
        parse_neuron_ls(text)


# --- detection --------------------------------------------------------------------------
@pytest.fixture
def fake_neuron(tmp_path, monkeypatch):
    """A torch_neuronx that reports 4 visible cores, and a place for a neuron-ls script."""
    package = tmp_path / "site" / "torch_neuronx"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import types, torch\n"
        "torch.neuron = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 4)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # this machine's own neuron-ls, if any, stays out of the way
    kept = [d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "neuron-ls"))]
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), *kept]))
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)

    def neuron_ls(stdout: str, code: int = 0):
        script = bin_dir / "neuron-ls"
        script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{stdout}\nEOF\nexit {code}\n")
        script.chmod(0o755)
    return neuron_ls


def test_detect_uses_neuron_ls_for_chips_and_memory(fake_neuron):
    fake_neuron(TRN2_48XL_LS)
    hardware = detect_hardware()
    assert (hardware.backend, hardware.devices, hardware.chips, hardware.lnc) == ("neuron", 64, 16, 2)
    assert hardware.chip_memory_gib == 96 and hardware.detected


def test_detect_falls_back_to_torch_when_neuron_ls_is_missing(fake_neuron):
    hardware = detect_hardware()
    assert (hardware.backend, hardware.devices, hardware.chips, hardware.lnc) == ("neuron", 4, 1, 2)
    assert hardware.chip_memory_gib is None


def test_detect_reads_lnc_from_the_environment_without_neuron_ls(fake_neuron, monkeypatch):
    """LNC=1: the 4 visible cores are 4 physical cores, half a Trn2 chip."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    hardware = detect_hardware()
    assert (hardware.backend, hardware.devices, hardware.chips, hardware.lnc) == ("neuron", 4, 1, 1)


@pytest.mark.parametrize("stdout, code", [("unknown option --json-output", 2), ("not json", 0)])
def test_detect_falls_back_to_torch_when_neuron_ls_fails(fake_neuron, caplog, stdout, code):
    fake_neuron(stdout, code)
    with caplog.at_level(logging.WARNING, logger="studio_core.machine.hardware"):
        hardware = detect_hardware()
    assert (hardware.backend, hardware.devices, hardware.chips) == ("neuron", 4, 1)
    assert "counting NeuronCores with torch-neuronx instead" in caplog.text


def test_neuron_ls_alone_does_not_make_a_neuron_machine(tmp_path, monkeypatch):
    """Without torch-neuronx nothing can train on the chips, whatever neuron-ls lists."""
    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("torch-neuronx is installed here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "neuron-ls").write_text(f"#!/bin/sh\ncat <<'EOF'\n{TRN2_48XL_LS}\nEOF\n")
    (bin_dir / "neuron-ls").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert detect_hardware().backend in ("cpu", "cuda")


@pytest.mark.fast
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_cpu_core_numbers_map_onto_the_cpus_this_process_may_use():
    """As in a container limited to some CPUs: started on the last CPU only, the studio's core 0
    is that CPU, not CPU 0 (which it may not use)."""
    last = max(os.sched_getaffinity(0))
    code = ("import os; from studio_core.machine.hardware import cpu_hardware, pin_to_cpu_cores; "
            "assert cpu_hardware().cpu_count == 1; pin_to_cpu_cores([0]); print(sorted(os.sched_getaffinity(0)))")
    done = subprocess.run(["taskset", "-c", str(last), sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{last}]"


@pytest.mark.fast
def test_studio_cpu_cores_orders_and_limits_the_cpus(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("STUDIO_CPU_CORES", ",".join(map(str, reversed(cpus))))
    assert studio_cpus() == cpus[::-1] and cpu_hardware().cpu_count == len(cpus)
    monkeypatch.setenv("STUDIO_CPU_CORES", f"{cpus[-1]},{max(cpus) + 1000}")  # a CPU not ours is left out
    assert studio_cpus() == [cpus[-1]]
    monkeypatch.setenv("STUDIO_CPU_CORES", str(max(cpus) + 1000))
    with pytest.raises(ValueError, match="names none of the CPUs this process may use"):
        studio_cpus()
    monkeypatch.setenv("STUDIO_CPU_CORES", "two")
    with pytest.raises(ValueError, match="STUDIO_CPU_CORES='two': 'two'"):
        studio_cpus()


def test_the_probe_answer_is_kept_for_the_boot_while_what_it_read_stays(fake_neuron, tmp_path, monkeypatch):
    """The probe's child (it imports torch) runs once: a second detection reads its answer, and a
    variable that hides devices asks it again."""
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path / "cache"))
    assert detect_hardware().devices == 4
    fake = tmp_path / "site" / "torch_neuronx" / "__init__.py"
    fake.write_text(fake.read_text().replace("device_count=lambda: 4", "device_count=lambda: 8"))
    assert detect_hardware().devices == 4  # the kept answer: the child was not asked
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-7")
    assert detect_hardware().devices == 8


def test_a_machine_without_accelerators_is_the_cpu_without_a_probe(tmp_path, monkeypatch):
    """No torch-neuronx and no GPU device files: the CPU, as the probe itself would answer."""
    if importlib.util.find_spec("torch_neuronx") or any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has torch-neuronx or a GPU")
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path / "cache"))
    assert detect_hardware().backend == "cpu"
    assert not (tmp_path / "cache").exists()  # nothing probed, so nothing kept
    done = subprocess.run([sys.executable, "-c", hardware_module._PROBE], capture_output=True, text=True, check=True)
    probed = json.loads(done.stdout.strip().splitlines()[-1])
    assert (probed["neuron"], probed["cuda"]) == (0, 0)
