"""What the run will execute on: detected on this machine, or a known instance type.

A `Hardware` is plain data, so the planner can plan for a trn2.48xlarge on a laptop.
Detection runs in a child process because answering "is there a NeuronCore?" means
importing torch (and torch-neuronx), which the web app's process should not carry; on a machine
that has neither torch-neuronx nor a GPU's device files no child is needed, and elsewhere its
answer is kept for the machine's boot (_probe).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from studio_core.machine.cache import cache_dir
from studio_core.machine.cores import parse_cores

DEVICES = ("neuron", "cuda", "cpu")  # the kinds of machine the studio runs on; the one list of them
# TorchNeuron allows up to 128 devices in one process (tested at LNC=1 on a trn2.48xlarge, whose
# 16 chips show 128 logical cores; torch-neuronx's native backend). The limit is per process, not
# per instance: the studio gives each rank one core (NEURON_RT_VISIBLE_CORES), so a rank sees one
# device; only a process that names no core (a cluster node's rank, an export) sees the whole
# machine, which on every instance in INSTANCES is at most 16 chips x 8 physical cores = 128.
# layout.check_layout refuses a machine whose processes could see more.
MAX_DEVICES_PER_PROCESS = 128
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hardware:
    backend: str  # "neuron", "cuda" or "cpu"
    devices: int  # logical NeuronCores, CUDA devices, or CPU cores
    cpu_count: int
    instance_type: str | None = None
    chips: int = 0  # Neuron chips (0 elsewhere)
    lnc: int | None = None  # Logical NeuronCore config (NEURON_LOGICAL_NC_CONFIG)
    detected: bool = True  # False when chosen from the instance table
    chip_memory_gib: int | None = None  # device memory (HBM) per chip, when known
    problems: tuple[str, ...] = ()  # what detection found wrong with this machine's software, with the fix
    # The host: what the compiler (neuronx-cc runs on the CPUs, in host memory) has to share
    # between parallel precompile jobs. vCPUs the studio may use and the memory, GiB; None: unknown.
    vcpus: int | None = None
    host_memory_gib: float | None = None

    @property
    def cores(self) -> int:
        """How many cores runs, chats and exports are placed on: logical NeuronCores, CUDA
        devices, or (on the CPU backend) the CPU cores the studio may use."""
        return self.cpu_count if self.backend == "cpu" else self.devices

    def describe(self) -> str:
        if self.backend == "neuron":
            where = self.instance_type or "Neuron machine (instance type unknown)"
            memory = f", {self.chip_memory_gib} GiB per chip" if self.chip_memory_gib else ""
            return f"{where}: {self.devices} NeuronCores on {self.chips} chip(s), LNC={self.lnc}{memory}"
        if self.backend == "cuda":
            return f"{self.devices} CUDA device(s), {self.cpu_count} CPU cores"
        return f"CPU only: {self.cpu_count} cores (no Neuron or CUDA device found)"

    def to_dict(self) -> dict:
        return asdict(self)


# Known instance types: chips, physical NeuronCores per chip, device memory (HBM) per chip.
# Logical cores = chips * physical_cores_per_chip / LNC; LNC=2 (the default) pairs cores.
# Where each number comes from (AWS Neuron documentation, read 2026; not checked on hardware):
# - Trainium2: 8 physical NeuronCore-v3 and 96 GiB per chip ("Trainium2 Architecture";
#   "Logical NeuronCore configuration"; neuron-ls -j example: memory_size 103079215104 B).
# - trn2.48xlarge, trn2u.48xlarge: 16 Trainium2 chips in a 4x4 2D torus, 192 vCPUs
#   ("Amazon EC2 Trn2 Architecture"); trn2u.48xlarge is the size that joins an UltraServer.
# - trn2.3xlarge: 1 Trainium2 chip (TRL's Trainium guide; the Neuron Trn2 page lists only the
#   48xlarge sizes).
# - Trainium3: 8 physical NeuronCore-v4 and 144 GiB per chip ("Trainium3 Architecture").
# - trn3.48xlarge: ASSUMPTION. The docs describe Trn3 only as UltraServers: Gen1 = 4 servers
#   of 16 Trainium3 chips (768 vCPUs, so 192 per server); Gen2 = 36 servers of 4 chips. The
#   name trn3.48xlarge for the 16-chip server comes from the Neuron driver's instance table,
#   not from documentation. The Gen2 4-chip server's name was not found, so it is not listed.
# - LNC=2 as the default on Trn3: ASSUMPTION ("similar to Trainium2" in the Trainium3 page;
#   the NKI guide says LNC 1 or 2 on Trn2 and Trn3).
# Host vCPUs and memory (what parallel precompile jobs share, studio_core/training/precompile.py):
# - trn2.48xlarge, trn2u.48xlarge: 192 vCPUs, 2,048 GiB ("Amazon EC2 Trn2 Architecture", its
#   instance specifications table).
# - trn2.3xlarge: 12 vCPUs, 128 GiB (AWS's EC2 Trn2 instance-types page; the Neuron pages list only
#   the 48xlarge sizes). A report from such an instance shows 124 GiB usable.
# - trn3.48xlarge: 192 vCPUs, derived (768 vCPUs per 4-server Gen1 UltraServer in the Trn3 page);
#   host memory: not found in the docs, so left unknown (no memory cap is applied there).
INSTANCES = {
    "trn2.3xlarge": {"chips": 1, "physical_cores_per_chip": 8, "chip_memory_gib": 96,
                     "vcpus": 12, "host_memory_gib": 128},
    "trn2.48xlarge": {"chips": 16, "physical_cores_per_chip": 8, "chip_memory_gib": 96,
                      "vcpus": 192, "host_memory_gib": 2048},
    "trn2u.48xlarge": {"chips": 16, "physical_cores_per_chip": 8, "chip_memory_gib": 96,
                       "vcpus": 192, "host_memory_gib": 2048},
    "trn3.48xlarge": {"chips": 16, "physical_cores_per_chip": 8, "chip_memory_gib": 144,
                      "vcpus": 192, "host_memory_gib": None},
}
LNC_VALUES = (1, 2)


def instance_hardware(instance_type: str, lnc: int = 2) -> Hardware:
    """The hardware of a known instance type, for planning on another machine."""
    if instance_type not in INSTANCES:
        known = ", ".join(INSTANCES)
        raise ValueError(f"unknown instance type {instance_type!r}: choose one of {known}")
    if isinstance(lnc, bool) or lnc not in LNC_VALUES:
        raise ValueError(f"LNC={lnc!r} is not a Logical NeuronCore configuration: use 1 or 2 "
                         "(NEURON_LOGICAL_NC_CONFIG; 2 is the default)")
    info = INSTANCES[instance_type]
    cores = info["chips"] * info["physical_cores_per_chip"] // lnc
    return Hardware("neuron", cores, cpu_count=os.cpu_count() or 1, instance_type=instance_type,
                    chips=info["chips"], lnc=lnc, detected=False, chip_memory_gib=info["chip_memory_gib"],
                    vcpus=info["vcpus"], host_memory_gib=info["host_memory_gib"])


@dataclass
class Target:
    """The hardware a plan is for: an instance type at an LNC, or (no instance) this machine's. Each
    field's metadata names its command line flag and form label (cli/ and app/ make them from it)."""

    instance: str | None = field(default=None, metadata={"flag": "--instance", "label": "Plan for"})
    lnc: int = field(default=2, metadata={"flag": "--lnc", "label": "LNC (instance types)"})

    def hardware(self, here) -> Hardware:
        """The instance type's hardware (ValueError saying what is wrong), else here() (this machine's)."""
        return instance_hardware(self.instance, lnc=self.lnc) if self.instance else here()


# `neuron-ls --json-output` (-j), as the Neuron LS User Guide shows it (Neuron 2.2x-2.33):
# a JSON list with one object per chip ("Neuron device"):
#   {"neuron_device": 0, "bdf": "cc:00.0", "connected_to": [12, 3, 4, 1], "nc_count": 4,
#    "logical_neuroncore_config": 2, "memory_size": 103079215104, "neuron_processes": [...]}
# nc_count counts logical cores (4 on a Trn2 chip at LNC=2); memory_size is in bytes. Some
# versions add "instance_type" and "neuroncore_ids" per device; both are optional here.
# Written from the documentation, NOT from output captured on hardware. The docs announce that
# Neuron 2.34 drops --json-output for a new `--output-format json`; when the flag fails,
# detect_hardware falls back to torch-neuronx's count.
def parse_neuron_ls(json_text: str) -> dict:
    """chips, logical cores per chip, LNC, memory per chip (bytes) and instance type, from
    `neuron-ls --json-output`. Raises ValueError when the text is not that format."""
    try:
        devices = json.loads(json_text)
    except json.JSONDecodeError as error:
        raise ValueError(f"neuron-ls output is not JSON: {error}") from error
    if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) for d in devices):
        raise ValueError("neuron-ls output is not a list of Neuron devices (the --json-output format)")
    try:
        per_chip = {int(d["nc_count"]) for d in devices}
        memory = min(int(d["memory_size"]) for d in devices)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"neuron-ls device entry without a usable nc_count / memory_size: {error!r}") from error
    if len(per_chip) != 1:
        raise ValueError(f"neuron-ls lists chips with different core counts {sorted(per_chip)}")
    lnc = {d.get("logical_neuroncore_config") for d in devices} - {None}
    types = {d.get("instance_type") for d in devices} - {None}
    return {"chips": len(devices), "cores_per_chip": per_chip.pop(),
            "lnc": int(lnc.pop()) if len(lnc) == 1 else None,
            "memory_per_chip": memory, "instance_type": types.pop() if len(types) == 1 else None}


def _neuron_ls(timeout: float = 10) -> dict | None:
    """parse_neuron_ls of this machine, or None (with the reason logged) when unavailable."""
    exe = shutil.which("neuron-ls")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "--json-output"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("neuron-ls failed (%s); counting NeuronCores with torch-neuronx instead", error)
        return None
    if done.returncode != 0:
        log.warning("neuron-ls --json-output exited %s: %s; counting NeuronCores with torch-neuronx instead",
                    done.returncode, done.stderr.strip()[-500:])
        return None
    try:
        return parse_neuron_ls(done.stdout)
    except ValueError as error:
        log.warning("%s; counting NeuronCores with torch-neuronx instead", error)
        return None


CPU_CORES_ENV = "STUDIO_CPU_CORES"


class CpuCoresError(ValueError):
    """STUDIO_CPU_CORES cannot be used as it is; the message says what to write instead."""


def studio_cpus() -> list[int]:
    """The OS CPUs that the CPU backend's cores 0..n-1 stand for: the CPUs this process may use
    (in a container limited to CPUs 4-7, core 0 is CPU 4), in the order STUDIO_CPU_CORES lists
    them when it is set (e.g. "2,3": runs, chats and exports stay off CPUs 0 and 1)."""
    allowed = os.sched_getaffinity(0)
    wanted = os.environ.get(CPU_CORES_ENV, "").strip()
    if not wanted:
        return sorted(allowed)
    try:
        listed = [cpu for cpu in parse_cores(wanted) if cpu in allowed]
    except ValueError as error:
        raise CpuCoresError(f"{CPU_CORES_ENV}={wanted!r}: {error}") from error
    if not listed:
        raise CpuCoresError(f"{CPU_CORES_ENV}={wanted!r} names none of the CPUs this process may use "
                            f"({','.join(map(str, sorted(allowed)))}): name some of those, or unset it")
    return listed


def host_resources() -> dict:
    """This machine's vCPUs (those this process may use: a container's limit counts) and memory."""
    import psutil

    return {"vcpus": len(os.sched_getaffinity(0)), "host_memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def cpu_hardware() -> Hardware:
    cores = len(studio_cpus())
    return Hardware("cpu", cores, cpu_count=cores, **host_resources())


def pin_to_cpu_cores(cores: list[int]) -> None:
    """Pin this process (and the children it starts) to the CPU backend's cores `cores`
    (studio_cpus says which OS CPUs they are)."""
    cpus = studio_cpus()
    os.sched_setaffinity(0, [cpus[core] for core in cores])


_PROBE = r"""
import importlib.util, json
found = {"neuron": 0, "cuda": 0, "torch_xla": importlib.util.find_spec("torch_xla") is not None}
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


# Accelerate chooses its distributed type by checking for torch_xla first: with the retired
# XLA stack importable it trains the XLA way even when torch-neuronx is there.
TORCH_XLA_PROBLEM = ("torch_xla is installed next to torch-neuronx: Accelerate (and so every TRL trainer) then "
                     "takes the retired XLA path instead of the native Neuron one. Use a clean TorchNeuron "
                     "environment: `pip uninstall torch-xla` (or a fresh venv made with the AWS Neuron setup's "
                     "TorchNeuron instructions, without the XLA packages)")


def detect_hardware(timeout: float = 120) -> Hardware:
    """Probe this machine: neuron (torch-neuronx and visible cores), else cuda, else cpu."""
    base = cpu_hardware()
    found = _probe(timeout)
    if found["neuron"]:
        # torch-neuronx must be there to train; neuron-ls, when installed, tells chips and memory.
        problems = (TORCH_XLA_PROBLEM,) if found.get("torch_xla") else ()
        listed = _neuron_ls()
        if listed:
            return Hardware("neuron", listed["chips"] * listed["cores_per_chip"], base.cpu_count,
                            instance_type=listed["instance_type"] or instance_type(), chips=listed["chips"],
                            lnc=listed["lnc"] or int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")),
                            chip_memory_gib=listed["memory_per_chip"] // 2**30, problems=problems,
                            vcpus=base.vcpus, host_memory_gib=base.host_memory_gib)
        lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        chips = max(1, found["neuron"] * lnc // 8)  # assumes 8 physical cores per chip (Trn2, Trn3)
        return Hardware("neuron", found["neuron"], base.cpu_count, instance_type=instance_type(), chips=chips,
                        lnc=lnc, problems=problems, vcpus=base.vcpus, host_memory_gib=base.host_memory_gib)
    if found["cuda"]:
        return Hardware("cuda", found["cuda"], base.cpu_count, vcpus=base.vcpus, host_memory_gib=base.host_memory_gib)
    return base


# What the probe can find needs torch-neuronx installed or a GPU's device files (NVIDIA's
# /dev/nvidia0..., ROCm's /dev/kfd, WSL's /dev/dxg): torch.cuda.is_available() is false without
# them. With neither, the answer is the CPU and no child is started (it imports torch: a second or
# more). Else the probe's answer is kept for this boot of the machine while the Python, its path,
# the device files, the libraries' versions and the variables that hide devices stay the same.
GPU_DEVICE_FILES = ("nvidia[0-9]*", "kfd", "dxg")
VISIBILITY_ENV = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                  "ROCR_VISIBLE_DEVICES", "PYTHONPATH")


def _probe(timeout: float) -> dict:
    from importlib.machinery import PathFinder

    child_path = [*filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), *sys.path]
    devices = sorted(str(p) for pattern in GPU_DEVICE_FILES for p in Path("/dev").glob(pattern))
    torch_xla = PathFinder.find_spec("torch_xla", child_path) is not None
    if PathFinder.find_spec("torch_neuronx", child_path) is None and not devices:
        return {"neuron": 0, "cuda": 0, "torch_xla": torch_xla}
    key = json.dumps([_boot_id(), sys.executable, devices, [os.environ.get(name) for name in VISIBILITY_ENV],
                      [_version(name) for name in ("torch", "torch-neuronx", "torch-xla")]])
    kept = cache_dir() / "hardware-probe.json"
    remembered = _read_probe(kept)
    if remembered.get("key") == key and isinstance(remembered.get("found"), dict):
        return remembered["found"]
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hardware probe failed:\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" not in found:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "found": found}), encoding="utf-8")
        tmp.replace(kept)
    return found


def _read_probe(kept: Path) -> dict:
    try:
        remembered = json.loads(kept.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: probed again and written anew
        return {}
    return remembered if isinstance(remembered, dict) else {}


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:  # not Linux: the probe's answer is kept for this process's parent's life only
        return str(os.getppid())


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# The EC2 instance metadata service (IMDSv2: a session token by PUT, then the GET), read with
# the names AWS's own SDKs read: AWS_EC2_METADATA_SERVICE_ENDPOINT moves it (the tests point it
# at a local server), AWS_EC2_METADATA_DISABLED=true turns it off. Off EC2 nothing answers at
# the link-local address and the short timeout ends the wait.
IMDS = "http://169.254.169.254"
IMDS_TIMEOUT_S = 1.0


def instance_type(timeout: float = IMDS_TIMEOUT_S) -> str | None:
    """This machine's EC2 instance type (e.g. "trn2.3xlarge"), or None when no metadata
    service answers (not on EC2, or it is turned off)."""
    import http.client
    import urllib.request

    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS).rstrip("/")
    try:
        token_request = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                               headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        with urllib.request.urlopen(token_request, timeout=timeout) as answer:
            token = answer.read().decode()
        request = urllib.request.Request(f"{base}/latest/meta-data/instance-type",
                                         headers={"X-aws-ec2-metadata-token": token})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            found = answer.read().decode().strip()
    except (OSError, http.client.HTTPException, ValueError) as error:  # URLError is an OSError
        log.info("no instance type from the instance metadata at %s: %s", base, error)
        return None
    return found or None
