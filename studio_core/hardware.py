"""What the run will execute on: detected on this machine, or a known instance type.

A `Hardware` is plain data, so the planner can plan for a trn2.48xlarge on a laptop.
Detection runs in a child process because answering "is there a NeuronCore?" means
importing torch (and torch-neuronx), which the web app's process should not carry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

BACKENDS = ("neuron", "cuda", "cpu")


@dataclass(frozen=True)
class Hardware:
    backend: str  # "neuron", "cuda" or "cpu"
    devices: int  # logical NeuronCores, CUDA devices, or CPU cores
    cpu_count: int
    instance_type: str | None = None
    chips: int = 0  # Neuron chips (0 elsewhere)
    lnc: int | None = None  # Logical NeuronCore config (NEURON_LOGICAL_NC_CONFIG)
    detected: bool = True  # False when chosen from the instance table

    def describe(self) -> str:
        if self.backend == "neuron":
            where = self.instance_type or "Neuron machine"
            return f"{where}: {self.devices} NeuronCores on {self.chips} chip(s), LNC={self.lnc}"
        if self.backend == "cuda":
            return f"{self.devices} CUDA device(s), {self.cpu_count} CPU cores"
        return f"CPU only: {self.cpu_count} cores (no Neuron or CUDA device found)"

    def to_dict(self) -> dict:
        return asdict(self)


# Trn2: 8 physical NeuronCores per chip, paired into 4 logical cores at the default LNC=2.
INSTANCES = {
    "trn2.3xlarge": {"chips": 1, "physical_cores_per_chip": 8},
    "trn2.48xlarge": {"chips": 16, "physical_cores_per_chip": 8},
}


def instance_hardware(instance_type: str, lnc: int = 2) -> Hardware:
    """The hardware of a known instance type, for planning on another machine."""
    if instance_type not in INSTANCES:
        known = ", ".join(INSTANCES)
        raise ValueError(f"unknown instance type {instance_type!r}: choose one of {known}")
    info = INSTANCES[instance_type]
    cores = info["chips"] * info["physical_cores_per_chip"] // lnc
    return Hardware("neuron", cores, cpu_count=os.cpu_count() or 1, instance_type=instance_type,
                    chips=info["chips"], lnc=lnc, detected=False)


def cpu_hardware() -> Hardware:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Hardware("cpu", cores, cpu_count=cores)


_PROBE = r"""
import importlib.util, json
found = {"neuron": 0, "cuda": 0}
try:
    import torch
    if importlib.util.find_spec("torch_neuronx") is not None:
        import torch_neuronx  # registers the "neuron" device
        if torch.neuron.is_available():
            found["neuron"] = torch.neuron.device_count()
    if torch.cuda.is_available():
        found["cuda"] = torch.cuda.device_count()
except ImportError as error:
    found["error"] = str(error)
print(json.dumps(found))
"""


def detect_hardware(timeout: float = 120) -> Hardware:
    """Probe this machine: neuron (torch-neuronx and visible cores), else cuda, else cpu."""
    base = cpu_hardware()
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hardware probe failed:\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if found["neuron"]:
        lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        chips = max(1, found["neuron"] * lnc // 8)
        return Hardware("neuron", found["neuron"], base.cpu_count, chips=chips, lnc=lnc)
    if found["cuda"]:
        return Hardware("cuda", found["cuda"], base.cpu_count)
    return base
