"""The Neuron paths that cannot run here, checked on what they are made of: each rank's core,
the environment of every process that loads a model, the instance type, what detection
says about the software next to torch-neuronx.

A rank's core is checked in a real worker process started with the environment a Neuron
plan gives, without torch-neuronx: importing the worker must set the rank's core before
anything imports torch (not in the fast subset: it starts the worker module).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from child_env import with_child_environment
from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.serve.chat import ChatError, ChatProcess
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.training.compile_watch import CompileWatch, NeffCompileTimes
from studio_core.machine.device_env import RANK_CORES, VISIBLE, device_env, rank_cores, use_rank_core
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.rundir.events import read as read_events
from studio_core.recipe.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
TINY = RunSpec.load(REPO / "recipes" / "tiny-sft.yaml")
TP_FSDP = RunSpec.load(REPO / "recipes" / "qwen3-8b-sft-tp4-fsdp8.yaml")

WORKER_SETUP = """
import json, os, sys
import studio_core.training.worker
print(json.dumps({"visible": os.environ.get("NEURON_RT_VISIBLE_CORES"), "torch": "torch" in sys.modules}))
"""


def worker_setup(env: dict, local_rank: int) -> dict:
    """Import the worker as torchrun's rank `local_rank` would, under the plan's environment."""
    child = {k: v for k, v in os.environ.items() if k not in (VISIBLE, RANK_CORES)}
    child.update(env, LOCAL_RANK=str(local_rank), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", WORKER_SETUP], env=child, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("spec, instance, ranks", [
    (TINY.with_overrides(["studio.nproc=4"]), "trn2.3xlarge", [0, 3]),
    (TINY.with_overrides(["studio.nproc=2", "studio.cores='2,3'"]), "trn2.3xlarge", [1]),
    (TP_FSDP, "trn2.48xlarge", [0, 31]),
], ids=["4-cores", "cores-2,3", "tp4xfsdp8"])
def test_the_worker_gives_rank_r_core_r_of_the_block_before_torch_loads(spec, instance, ranks):
    launch = plan(spec, instance_hardware(instance))
    assert VISIBLE not in launch.env  # no range every rank would share
    block = rank_cores(launch.env)
    assert len(block) == launch.spec.layout.nproc == len(set(block))
    for rank in ranks:
        assert worker_setup(launch.env, rank) == {"visible": block[rank], "torch": False}


def test_a_one_process_run_keeps_its_core_and_a_cpu_rank_is_left_alone():
    one = plan(TINY.with_overrides(["studio.cores='3'"]), instance_hardware("trn2.3xlarge"))
    assert one.env[VISIBLE] == "3" and RANK_CORES not in one.env
    assert worker_setup(one.env, 0)["visible"] == "3"
    assert worker_setup(plan(TINY, cpu_hardware()).env, 0)["visible"] is None


@pytest.mark.fast
def test_a_rank_beyond_the_block_is_told_what_to_change():
    environ = {RANK_CORES: "0-1", "LOCAL_RANK": "2"}
    with pytest.raises(RuntimeError, match="local rank 2 has no core: STUDIO_NEURON_CORES=0-1 names 2"):
        use_rank_core(environ)
    assert use_rank_core({"LOCAL_RANK": "0"}) is None  # nothing named: torch-neuronx picks


# --- every process that loads a model gets the same Neuron environment -------------------
@pytest.mark.fast
def test_one_function_gives_every_model_process_neurons_settings(tmp_path):
    trn = instance_hardware("trn2.3xlarge")
    run = plan(TINY.with_overrides(["studio.nproc=2"]), trn, compile_cache=tmp_path).env
    chat = device_env(trn, tmp_path, [3])
    export = device_env(trn, tmp_path, None)
    for env in (run, chat, export):
        assert env["HF_DEACTIVATE_ASYNC_LOAD"] == "1"
        assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "neuron" / "neff")  # not /tmp/neff_cache
        assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert chat[VISIBLE] == "3" and VISIBLE not in export and RANK_CORES not in export
    assert device_env(instance_hardware("trn2.3xlarge", lnc=1), tmp_path, [0])["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert "HF_DEACTIVATE_ASYNC_LOAD" not in device_env(cpu_hardware(), tmp_path, [0])


def test_the_chat_process_loads_with_the_neuron_environment_on_its_own_core(tmp_path):
    """As on a trn2.3xlarge: the chat child starts with the Neuron settings and core 0 (loading
    onto a NeuronCore then fails here, with a message, since this machine has none)."""
    def load():
        with pytest.raises(ChatError, match="cannot load") as refused:
            ChatProcess.start(BUILTIN_MODEL, tmp_path, instance_hardware("trn2.3xlarge"))
        return refused.value
    error, env = with_child_environment("studio_core.serve.chat_worker", load)
    assert env["HF_DEACTIVATE_ASYNC_LOAD"] == "1" and env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(compile_cache_root() / "neuron" / "neff")
    assert env["NEURON_RT_VISIBLE_CORES"] == "0" and "STUDIO_NEURON_CORES" not in env
    assert "neuron" in str(error)


# --- neuronx-cc's compile time, from TorchNeuron's per-graph records -----------------------
def neuron_record(name: str, compile_us: int) -> SimpleNamespace:
    """A record as torch.neuron.get_dynamo_metrics() gives it (NeuronCompilationMetrics' fields)."""
    return SimpleNamespace(graph_id=f"key-{name}", graph_name=name, model_name="m", has_collectives=False,
                           graph_node_count=12, timestamp="0", torch_neuronx_fx_passes_us=900,
                           torch_neuronx_lower_us=40_000, torch_neuronx_compile_us=compile_us)


@pytest.mark.fast
def test_neff_compile_time_is_read_only_on_steps_that_recorded_a_graph(tmp_path):
    records, reads = [], []

    def metrics():  # the real one syncs the device: read only when a graph was recorded
        reads.append(len(records))
        return list(records)

    watch = CompileWatch(tmp_path / "events.jsonl", step=lambda: 7)
    watch.neff = NeffCompileTimes(metrics, recorded=lambda: len(records))
    watch.step_ended()
    assert reads == [] and watch.compile_seconds() == 0
    records += [neuron_record("m_0_fwd_0", 95_000_000), neuron_record("m_0_bwd_0", 130_500_000)]
    watch.step_ended()
    watch.step_ended()  # nothing new: no read, nothing added
    assert reads == [2] and watch.compile_seconds() == pytest.approx(225.5)
    ended = [e for e in read_events(tmp_path / "events.jsonl") if e["type"] == "compile_end"]
    assert [(e["graph"], e["phase"], e["step"], e["seconds"]) for e in ended] == [
        ("m_0_fwd_0", "neff", 7, 95.0), ("m_0_bwd_0", "neff", 7, 130.5)]
    records.append(neuron_record("m_1_fwd_0", 0))  # a NEFF cache hit compiles nothing
    watch.step_ended()
    assert reads == [2, 3] and watch.compile_seconds() == pytest.approx(225.5) and watch.compiles == 3
