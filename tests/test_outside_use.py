"""NeuronCores that programs outside the studio use, read from `neuron-ls --json-output`.

The JSON below is written here in the format the Neuron LS User Guide shows for `neuron-ls -j`
on a trn2.48xlarge at LNC=2 (one object per Neuron device: nc_count 4 logical cores,
neuroncore_ids, neuron_processes with pid, command and runtime version; a command may be empty),
cut to the devices a test needs. On this CPU machine `neuron-ls` is a stand-in script on PATH that
prints it: the studio's own code runs as it would on a trn instance.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.doctor import doctor
from studio_core.machine import leases
from studio_core.machine.hardware import Hardware

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

REPO = Path(__file__).resolve().parents[1]
TRN2 = Hardware("neuron", 8, cpu_count=16, chips=2, lnc=2)  # two Trn2 devices at LNC=2: cores 0-3 and 4-7
RUN = "20261129-120000-sft-aaaaaa"
OTHER_PID = 4242


def device(index: int, processes: list[dict], ids: bool = True) -> dict:
    entry = {"neuron_device": index, "bdf": f"{0xcc + index:x}:00.0", "cpu_affinity": "48-95,144-191",
             "numa_node": "1", "connected_to": [12, 3, 4, 1], "nc_count": 4, "logical_neuroncore_config": 2,
             "memory_size": 103079215104, "neuroncore_ids": [index * 4 + k for k in range(4)],
             "neuron_processes": processes}
    if not ids:
        del entry["neuroncore_ids"]  # as older neuron-ls versions print it
    return entry


def proc(pid: int, command: str) -> dict:
    return {"pid": pid, "command": command, "neuron_runtime_version": "2.34.10"}


def test_the_parser_reads_each_device_its_cores_and_processes_and_names_the_outside_ones():
    from studio_core.machine.outside_use import outside, parse_neuron_ls

    text = json.dumps([device(0, [proc(111, "python -m studio_core.training.worker run")]),
                       device(1, [proc(OTHER_PID, "python serve.py --port 9000"), proc(111, "")]),
                       device(2, [proc(4343, "")]), device(3, [])], indent=4)
    devices = parse_neuron_ls(text)
    assert [d["cores"] for d in devices] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert devices[1]["processes"] == [{"pid": OTHER_PID, "command": "python serve.py --port 9000"},
                                       {"pid": 111, "command": ""}]
    busy = outside(devices, studio_pids={111})
    assert sorted(busy) == [4, 5, 6, 7, 8, 9, 10, 11]  # device 0: only the studio's process; device 3: none
    assert leases.describe(busy[5]) == ("a program outside the studio on Neuron device 1 (python serve.py --port 9000) "
                                        f"(pid {OTHER_PID})")
    assert leases.describe(busy[8]) == "a program outside the studio on Neuron device 2 (pid 4343)"
    assert outside(devices, studio_pids={111, OTHER_PID, 4343}) == {}


def test_the_parser_counts_core_ids_when_an_older_neuron_ls_leaves_them_out_and_refuses_other_text():
    from studio_core.machine.outside_use import parse_neuron_ls

    older = [device(1, [proc(OTHER_PID, "x")], ids=False), device(0, [], ids=False)]  # in any order
    assert [d["cores"] for d in parse_neuron_ls(json.dumps(older))] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for text, says in (("not json", "not JSON"), ('{"neuron_device": 0}', "not a list of Neuron devices"),
                       (json.dumps([{"neuron_device": 0, "neuron_processes": []}]), "nc_count"),
                       (json.dumps([device(0, [{"command": "no pid"}])]), "neuron_processes")):
        with pytest.raises(ValueError, match=says):
            parse_neuron_ls(text)


def stand_in(folder: Path, devices: list[dict] | None, exit_code: int = 0, stderr: str = "",
             takes: tuple[str, ...] = ("--json-output",)) -> None:
    """A `neuron-ls` on PATH that prints `devices` as --json-output does (or fails as told) when
    called with `takes`, and refuses other arguments as a neuron-ls without them would."""
    folder.mkdir(exist_ok=True)
    script = folder / "neuron-ls"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      f"if sys.argv[1:] != {list(takes)!r}:\n"
                      f"    sys.exit('error: unexpected argument ' + repr(sys.argv[1]) + ' found')\n"
                      f"print({json.dumps(json.dumps(devices, indent=4))})\n"
                      f"sys.stderr.write({stderr!r})\nsys.exit({exit_code})\n")
    script.chmod(0o755)


@pytest.fixture
def studio_run(tmp_path):
    """A process holding NeuronCore 4 as a run's supervisor does, with a child (its rank) that
    neuron-ls lists on device 1: (runs folder, the rank's pid)."""
    runs = tmp_path / "runs"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\nfrom studio_core.machine.leases import acquire\n"
        f"lease = acquire(sys.argv[1], 'neuron', [4], {RUN!r}, 'run')\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(rank.pid, flush=True)\ntime.sleep(120)\n"), str(runs)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    rank = int(holder.stdout.readline())
    yield runs, rank
    for pid in (rank, holder.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # already gone
    holder.wait(timeout=10)


def test_a_start_on_neuron_skips_the_cores_other_programs_use_and_names_them(tmp_path, monkeypatch, studio_run):
    runs, rank = studio_run
    stand_in(tmp_path / "bin", [device(0, [proc(OTHER_PID, "python serve.py --port 9000")]),
                                device(1, [proc(rank, "python -m studio_core.training.worker")])])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    warnings = []
    # device 0 is another program's; core 4 is the run's lease; its rank on device 1 is the studio's own
    assert leases.choose(runs, TRN2, 1, None, warnings) == [5] and warnings == []
    with pytest.raises(leases.NamedCoresHeld, match=f"core 2 is held by a program outside the studio on Neuron "
                                                    f"device 0 \\(python serve.py --port 9000\\) \\(pid {OTHER_PID}\\)"):
        leases.choose(runs, TRN2, 1, "2")
    with pytest.raises(leases.NoFreeCores, match="a program outside the studio on Neuron device 0"):
        leases.choose(runs, TRN2, 4, None)  # neither aligned block of 4 is free
    assert leases.has_free(runs, TRN2, 2) and not leases.has_free(runs, TRN2, 4)
    check = doctor.other_programs(runs, TRN2)
    assert check.ok and f"pid {OTHER_PID}" in check.found and "device 1" not in check.found, check.found
    assert leases.choose(runs, Hardware("cpu", 2, cpu_count=2), 1, None) == [0]  # only Neuron asks neuron-ls
    # a neuron-ls without --json-output (announced for Neuron 2.34): --output-format json instead
    stand_in(tmp_path / "bin", [device(0, [proc(OTHER_PID, "python serve.py --port 9000")])],
             takes=("--output-format", "json"))
    assert leases.choose(runs, TRN2, 1, None, warnings) == [5] and warnings == []


def test_without_neuron_ls_a_start_goes_on_and_the_plan_and_the_doctor_say_so(tmp_path, monkeypatch):
    from studio_core.recipe.spec import RunSpec
    from studio_core.runs.manager import RunManager

    runs = tmp_path / "runs"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    warnings = []
    assert leases.choose(runs, TRN2, 1, None, warnings) == [0]
    assert warnings == ["cannot see which NeuronCores programs outside the studio use: neuron-ls is not on PATH "
                        "(install aws-neuronx-tools and put /opt/aws/neuron/bin on PATH); a core one of them holds "
                        "may be picked, and the job then fails to start on it"]
    launch = RunManager(runs).plan(RunSpec.load(REPO / "recipes" / "tiny-sft.yaml"), TRN2, this_machine=True)
    assert not launch.errors and warnings[0] in launch.warnings
    assert not doctor.other_programs(runs, TRN2).ok
    stand_in(tmp_path / "bin", None, takes=("--no-json-at-all",))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    check = doctor.other_programs(runs, TRN2)
    assert not check.ok and "neuron-ls --json-output exited 1: error: unexpected argument" in check.found
    assert "neuron-ls --output-format json exited 1" in check.found
    assert "aws-neuronx-tools" in check.fix and check.line().startswith("FAIL  neuron-ls")
