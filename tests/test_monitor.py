"""Hardware monitoring: the neuron-monitor parser, the process sampler on a real process
tree, the neuron-monitor reader and nvidia-smi query against stand-in executables, and the
hardware events a real tiny training run's supervisor wrote (conftest's trained_runs).

The neuron-monitor records below were written by hand from the AWS Neuron documentation
("Neuron Monitor User Guide", JSON output format); they were not captured on hardware.
The stand-in executables print documented output; they replace the external tools (absent
on this machine), not code of ours.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from studio_core.rundir.events import read as read_events
from studio_core.machine.monitor import (NEURON_MONITOR_CONFIG, NeuronMonitor, ProcessSampler, RunMonitor, cuda_memory,
                                 parse_neuron_monitor)


def runtime_entry(pid: int, cores: dict[str, float], memory: dict[str, dict], error: str = "") -> dict:
    """One `neuron_runtime_data` entry as the guide documents it (hand-written, not captured)."""
    return {
        "pid": pid, "address": "", "neuron_runtime_tag": str(pid), "error": error,
        "report": {
            "neuroncore_counters": {
                "period": 1.000113182, "error": "",
                "neuroncores_in_use": {core: {"neuroncore_utilization": util, "flops": 1234567891011,
                                              "v3d": {"nc_v3.0": {"neuroncore_utilization": util / 2}}}
                                       for core, util in cores.items()},
            },
            "memory_used": {
                "period": 1.00001, "error": "",
                "neuron_runtime_used_bytes": {
                    "host": 6997643264,
                    "neuron_device": sum(sum(parts.values()) for parts in memory.values()),
                    "usage_breakdown": {
                        "host": {"application_memory": 6996594688, "constants": 0, "dma_buffers": 1048576,
                                 "tensors": 0},
                        "neuroncore_memory_usage": memory,
                    },
                },
                "loaded_models": [],
            },
        },
    }


def core_memory(tensors: int) -> dict:
    return {"constants": 193986816, "model_code": 176285056, "model_shared_scratchpad": 0, "runtime_memory": 0,
            "tensors": tensors}


# Two ranks of one run on cores 2 and 3, and another program on core 0 (hand-written from the guide).
RECORD = {
    "neuron_runtime_data": [
        runtime_entry(4101, {"2": 42.01}, {"2": core_memory(20971520)}),
        runtime_entry(4102, {"3": 63.5}, {"3": core_memory(41943040)}),
        runtime_entry(5000, {"0": 99.0}, {"0": core_memory(1)}),
    ],
    "system_data": {},
    "instance_info": {"instance_type": "trn2.3xlarge", "error": ""},
    "neuron_hardware_info": {"neuron_device_type": "trainium2", "neuroncore_version": "v3d",
                             "neuron_device_count": 1, "neuron_device_memory_size": 103079215104,
                             "neuroncore_per_device_count": 4, "logical_neuroncore_config": 2, "error": ""},
}


@pytest.mark.fast
def test_parser_reads_the_run_cores_utilisation_and_memory():
    sample = parse_neuron_monitor(RECORD, [2, 3])
    assert sample == {"cores": {
        "2": {"utilization": 42.01, "memory_bytes": 193986816 + 176285056 + 20971520},
        "3": {"utilization": 63.5, "memory_bytes": 193986816 + 176285056 + 41943040},
    }}  # core 0 belongs to another program and is left out


@pytest.mark.fast
def test_parser_reports_errors_and_cores_not_active():
    record = {"neuron_runtime_data": [runtime_entry(4101, {}, {}, error="failed to connect to the runtime")],
              "neuron_hardware_info": {"error": "Neuron driver not loaded"}}
    sample = parse_neuron_monitor(record, [0, 1])
    assert sample["cores"] == {}
    assert sample["errors"] == ["pid 4101: failed to connect to the runtime",
                                "neuron_hardware_info: Neuron driver not loaded"]
    assert parse_neuron_monitor({"instance_info": {}}, [0]) == {"cores": {}}  # no Neuron application yet


BURNER = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(120)
""")


@pytest.mark.fast
def test_process_sampler_on_a_real_process_tree():
    parent = subprocess.Popen([sys.executable, "-c", BURNER])
    try:
        sampler = ProcessSampler()
        deadline = time.monotonic() + 30
        while (first := sampler.sample(parent.pid))["processes"] < 2:
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.1)
        time.sleep(1.0)
        sample = sampler.sample(parent.pid)
        assert sample["processes"] == 2 and parent.pid in sample["pids"]
        assert sample["cpu_percent"] > 20, sample  # the child burns a core; the first call only starts the clock
        assert sample["rss_bytes"] > 5_000_000, sample  # two Python interpreters
        child = [pid for pid in sample["pids"] if pid != parent.pid][0]
        subprocess.run(["kill", "-9", str(child)], check=True)
        deadline = time.monotonic() + 10
        while sampler.sample(parent.pid)["processes"] != 1:  # the killed child is a zombie until reaped: not counted
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
    assert sampler.sample(parent.pid) == {"cpu_percent": 0.0, "rss_bytes": 0, "processes": 0, "pids": []}


def stand_in(path: Path, body: str) -> str:
    """An executable Python script at `path`, standing in for an external tool."""
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


@pytest.mark.fast
def test_neuron_monitor_reader_with_a_stand_in(tmp_path):
    """The reader starts the tool with its config, reads one-line and multi-line reports, and stops it."""
    seen_config = tmp_path / "config-seen.json"
    exe = stand_in(tmp_path / "neuron-monitor", f"""
        import json, shutil, sys, time
        assert sys.argv[1] == "-c", sys.argv
        shutil.copy(sys.argv[2], {str(seen_config)!r})
        record = {json.dumps(RECORD)!r}
        print(record, flush=True)  # one report per line, as documented
        print(json.dumps(json.loads(record), indent=2), flush=True)  # a report over several lines
        time.sleep(300)
    """)
    monitor = NeuronMonitor([3], exe).start()
    try:
        deadline = time.monotonic() + 20
        while monitor.reports < 2:
            assert monitor.exit_code() is None, "the stand-in ended early"
            assert time.monotonic() < deadline, "no report read"
            time.sleep(0.05)
        assert monitor.latest() == {"cores": {"3": {"utilization": 63.5,
                                                    "memory_bytes": 193986816 + 176285056 + 41943040}}}
        assert json.loads(seen_config.read_text()) == NEURON_MONITOR_CONFIG
    finally:
        monitor.stop()
    assert monitor.exit_code() is not None  # stopped, not left running


@pytest.mark.fast
def test_run_monitor_says_what_is_missing_and_samples_what_is_there(tmp_path):
    missing = RunMonitor("neuron", [0, 1], os.getpid(), neuron_monitor=str(tmp_path / "absent"))
    assert "neuron-monitor not installed: no NeuronCore utilisation" in missing.describe()
    missing_smi = RunMonitor("cuda", [0], os.getpid(), nvidia_smi=str(tmp_path / "absent"))
    assert "nvidia-smi not found: no CUDA memory" in missing_smi.describe()

    exe = stand_in(tmp_path / "neuron-monitor", f"""
        import time
        print({json.dumps(RECORD)!r}, flush=True)
        time.sleep(300)
    """)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as rank:
        monitor = RunMonitor("neuron", [2, 3], rank.pid, neuron_monitor=exe)
        try:
            deadline = time.monotonic() + 20
            while "neuron" not in (sample := monitor.sample()):
                assert time.monotonic() < deadline, sample
                time.sleep(0.1)
            assert set(sample["neuron"]["cores"]) == {"2", "3"} and sample["processes"] == 1
            assert monitor.sources["monitored"][1] == "utilisation and device memory of NeuronCores [2, 3] (neuron-monitor)"
        finally:
            monitor.stop()
            rank.kill()


@pytest.mark.fast
def test_run_monitor_reports_a_neuron_monitor_that_ends(tmp_path):
    go = tmp_path / "end-now"  # the stand-in ends once the first sample is taken, never before
    exe = stand_in(tmp_path / "neuron-monitor", f"""
        import pathlib, sys, time
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.05)
        sys.exit(3)
    """)
    monitor = RunMonitor("neuron", [0], os.getpid(), neuron_monitor=exe)
    first = monitor.sample()  # the first event says what is monitored
    assert any("neuron-monitor" in m for m in first["sources"]["monitored"])
    go.touch()
    deadline = time.monotonic() + 10
    while "sources" not in (sample := monitor.sample()):
        assert time.monotonic() < deadline, "the ended neuron-monitor was never reported"
        time.sleep(0.1)
    assert "neuron-monitor ended with exit code 3" in sample["sources"]["unavailable"][-1]
    assert "sources" not in monitor.sample()  # said once, until something changes again


@pytest.mark.fast
def test_cuda_memory_with_a_stand_in_nvidia_smi(tmp_path):
    smi = stand_in(tmp_path / "nvidia-smi", """
        import sys
        assert sys.argv[1:] == ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        print("1234, 500")
        print("5678, 100")
        print("42, 7")
    """)
    assert cuda_memory([1234, 5678, 999], smi) == 600 * 1024 * 1024
    assert cuda_memory([999], smi) == 0
    failing = stand_in(tmp_path / "failing-smi", "import sys; print('NVIDIA-SMI has failed', file=sys.stderr); sys.exit(9)\n")
    with pytest.raises(RuntimeError, match="exited with code 9: NVIDIA-SMI has failed"):
        cuda_memory([1], failing)


def test_a_real_run_writes_hardware_events(trained_runs):
    import gradio as gr

    from app import hardware_panel

    manager, ids = trained_runs  # recipes/tiny-sft.yaml: 300 steps, finished
    view = manager.view(ids["full"])
    assert view.live_state == "finished", view.error_text
    events = read_events(view.dir / "events.jsonl")
    logs = [e["message"] for e in events if e["type"] == "log"]
    assert any("NeuronCore utilisation: not applicable on the cpu backend" in m for m in logs), logs
    samples = [e for e in events if e["type"] == "hardware"]
    assert len(samples) >= 2 and samples == view.hardware
    assert samples[0]["sources"]["unavailable"] == ["NeuronCore utilisation: not applicable on the cpu backend",
                                                    "CUDA memory: not applicable on the cpu backend"]
    assert all("sources" not in s for s in samples[1:])
    assert all(s["rss_bytes"] > 0 and s["processes"] >= 1 for s in samples)
    assert max(s["cpu_percent"] for s in samples) > 10  # a rank trains: it uses CPU
    assert max(s["processes"] for s in samples) >= 1  # its one rank (a one-process run has no torchrun)
    assert all("neuron" not in s and "cuda_mem_bytes" not in s for s in samples)

    with gr.Blocks():
        panel = hardware_panel.HardwarePanel()
    shown = panel.render(view)
    cpu, rss = shown[panel.cpu], shown[panel.rss]
    assert len(cpu) == len(samples) and (rss["rss_mb"] > 0).all()
    assert "Not available: NeuronCore utilisation: not applicable on the cpu backend" in shown[panel.note]
    assert shown[panel.neuron_util]["visible"] is False and shown[panel.cuda_mem]["visible"] is False
