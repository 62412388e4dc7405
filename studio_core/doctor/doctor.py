"""`launch.py doctor`: is this machine ready for the studio? One line per check, pass or fail
with what to do. The first thing to run on a new machine, and to paste into a bug report.

Every check runs for real on whatever backend the machine has (neuron, cuda, cpu): the
same code on a trn instance as on a laptop. In order:

    backend      what detection found (and what it found wrong, e.g. torch_xla beside torch-neuronx)
    versions     torch, torch-neuronx, transformers, TRL, ... against what the studio was built for
    torch_xla    absent next to torch-neuronx (Accelerate would take the retired XLA path)
    devices      the cores, LNC and instance type (from the instance metadata when it answers)
    compiler     on Neuron: an --lnc in the user's NEURON_CC_FLAGS agrees with the runtime's LNC
                 (TorchNeuron passes --lnc from NEURON_LOGICAL_NC_CONFIG itself; nothing is added)
    neuron-ls    on Neuron: neuron-ls answers, and which cores programs outside the studio use
                 (starts do not pick those)
    collective   2 processes under torchrun, each on its own core as a run places them,
                 all-reduce through the backend's process group (neuron, nccl, gloo)
    compile      a tiny compiled forward and backward, twice in new processes: its graph must
                 land in the compile cache and be a hit the second time
    cache        the compile cache folders are writable
    monitor      neuron-monitor, nvidia-smi or psutil answers
    runs folder  writable
    hub          the Hub answers (or offline, said)

The device checks take free cores through the same leases as runs (kind "doctor").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Iterator

from studio_core.machine import children, leases
from studio_core.machine.children import REPO_ROOT
from studio_core.machine.compile_cache import compile_cache_dir, compile_cache_root
from studio_core.machine.device_env import CC_FLAGS, CompilerFlagsError, device_env, flags_problem
from studio_core.machine.hardware import TORCH_XLA_PROBLEM, Hardware, detect_hardware, instance_type
from studio_core.machine.outside_use import KIND as OUTSIDE
from studio_core.serve import vllm_env

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "huggingface_hub", "gradio")
TIMEOUT_S = {"cpu": 300, "cuda": 300, "neuron": 1800}  # a first Neuron compile takes minutes
DOCTOR = "doctor"


@dataclass
class Check:
    name: str
    ok: bool
    found: str  # what the check saw
    fix: str = ""  # what to do when it failed

    def line(self) -> str:
        text = f"{'PASS' if self.ok else 'FAIL'}  {self.name:<12} {self.found}"
        return text + (f"\n      what to do: {self.fix}" if self.fix and not self.ok else "")


def checks(runs_dir: str | Path, hardware: Hardware | None = None) -> Iterator[Check]:
    """Run every check in turn, yielding each result as it is known."""
    runs_dir = Path(runs_dir).expanduser()
    try:
        hardware = hardware or detect_hardware()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        yield Check("backend", False, f"detection failed: {error}", "reinstall torch (pip install -r "
                    "requirements.txt, or requirements-cpu.txt on a CPU-only machine), then run the doctor again")
        return
    yield Check("backend", not hardware.problems, f"{hardware.backend}: {hardware.describe()}",
                " ".join(hardware.problems))
    yield versions(hardware.backend)
    yield torch_xla(hardware.backend)
    yield devices(hardware)
    if hardware.backend == "neuron":
        yield compiler_flags(hardware)
        yield other_programs(runs_dir, hardware)
    yield collective(runs_dir, hardware)
    yield compile_step(runs_dir, hardware)
    yield cache_writable(hardware.backend)
    yield monitor(hardware.backend)
    yield folder_writable("runs folder", runs_dir, "choose a runs folder you can write to: --runs-dir or "
                          "$STUDIO_RUNS_DIR")
    yield hub()
    yield vllm(hardware.backend)


# --- software -----------------------------------------------------------------------------
def vllm(backend: str) -> Check:
    """vLLM's own environment (serve/vllm_env.py), optional: importable, its version, its device and plugin."""
    env = vllm_env.find()
    if env.python is None:
        return Check("vllm", True, "not set up (optional: `launch.py serve` uses the studio's engine; "
                                   "`launch.py serve --setup-vllm` makes vLLM's environment)")
    if env.problem:
        return Check("vllm", False, env.describe(), vllm_env.SETUP_HINT)
    if env.device != backend:
        return Check("vllm", False, f"{env.describe()}: vLLM sees {env.device}, the studio {backend}",
                     "make the environment on this machine: `launch.py serve --setup-vllm`")
    if backend == "neuron" and not env.plugin:
        return Check("vllm", False, f"{env.describe()}, without the Neuron plugin", "install vllm-neuron there: "
                     "`launch.py serve --setup-vllm` (requirements-vllm-neuron.txt)")
    return Check("vllm", True, env.describe())


def built_for() -> dict[str, str]:
    """{package: specifier} from requirements.txt, the versions the studio is built and tested with."""
    from packaging.requirements import InvalidRequirement, Requirement

    wanted = {}
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        try:
            requirement = Requirement(line.split("#")[0].strip())
        except InvalidRequirement:
            continue  # a blank or comment line
        wanted[requirement.name.replace("-", "_").lower()] = str(requirement.specifier)
    return wanted


def versions(backend: str) -> Check:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    wanted, found, wrong = built_for(), [], []
    names = PACKAGES + (("torch_neuronx",) if backend == "neuron" else ())
    for name in names:
        try:
            version = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            wrong.append(f"{name} is not installed")
            continue
        found.append(f"{name} {version}")
        spec = wanted.get(name.lower(), "")
        if spec and not SpecifierSet(spec).contains(Version(version), prereleases=True):
            wrong.append(f"{name} {version}, built for {name}{spec}")
    if backend == "neuron" and "torch_neuronx" not in " ".join(wrong):
        torch_v, neuronx_v = Version(metadata.version("torch")), Version(metadata.version("torch-neuronx"))
        if torch_v.release[:2] != neuronx_v.release[:2]:
            wrong.append(f"torch-neuronx {neuronx_v} is built for torch {neuronx_v.major}.{neuronx_v.minor}, "
                         f"not {torch_v}")
    fix = ("pip install -r requirements.txt (on a trn instance keep the torch and torch-neuronx that the AWS "
           "Neuron setup installed: TorchNeuron 2.13.x with torch 2.13, 2.14.x with 2.14)")
    return Check("versions", not wrong, "; ".join(wrong or found), fix)


def torch_xla(backend: str) -> Check:
    present = util.find_spec("torch_xla") is not None
    if backend == "neuron":
        return Check("torch_xla", not present, "installed next to torch-neuronx" if present else "not installed",
                     TORCH_XLA_PROBLEM)
    return Check("torch_xla", True, ("installed (it matters only next to torch-neuronx)" if present else
                                     "not installed"))


def devices(hardware: Hardware) -> Check:
    where = hardware.instance_type or instance_type() or "instance type unknown (no instance metadata answered)"
    if hardware.backend == "neuron":
        found = f"{hardware.devices} NeuronCores on {hardware.chips} chip(s), LNC={hardware.lnc}; {where}"
        return Check("devices", hardware.devices > 0, found, "check `neuron-ls`: the Neuron driver sees no core")
    if hardware.backend == "cuda":
        return Check("devices", True, f"{hardware.devices} CUDA device(s); {where}")
    return Check("devices", True, f"no accelerator: {hardware.cpu_count} CPU cores train; {where}")


def compiler_flags(hardware: Hardware) -> Check:
    """The compiler must build for the runtime's LNC. TorchNeuron passes it --lnc from
    NEURON_LOGICAL_NC_CONFIG (which every process gets) and then the user's NEURON_CC_FLAGS,
    kept as given: an --lnc there must agree."""
    try:
        flags = device_env(hardware, compile_cache_root(), None).get(CC_FLAGS)
    except CompilerFlagsError as refused:
        return Check("compiler", False, refused.found, refused.fix)
    kept = f"{CC_FLAGS}={flags!r} kept as given" if flags is not None else f"{CC_FLAGS} not set"
    return Check("compiler", True, f"{kept}; TorchNeuron passes --lnc={hardware.lnc} from NEURON_LOGICAL_NC_CONFIG: "
                 f"compiled for LNC={hardware.lnc}, as the runtime runs")


# --- the device: a collective and a compiled step -----------------------------------------
def _take_cores(runs_dir: Path, hardware: Hardware, count: int):
    """A lease on `count` free device cores (CPU runs share the CPUs: no lease there)."""
    if hardware.backend == "cpu":
        return None, list(range(count))
    with leases.choosing(runs_dir):
        chosen = leases.choose(runs_dir, hardware, count, None)
        return leases.acquire(runs_dir, hardware.backend, chosen, holder=DOCTOR, kind="doctor"), chosen


def _child(argv: list[str], env: dict, backend: str) -> tuple[list[dict], str]:
    """Run a doctor child to its end: the results its processes wrote, or why it failed."""
    with tempfile.TemporaryDirectory(prefix="studio-doctor-") as out:
        try:
            done = subprocess.run(argv, env=children.environment({**env, "STUDIO_DOCTOR_OUT": out}),
                                  capture_output=True, text=True, timeout=TIMEOUT_S[backend], check=False)
        except subprocess.TimeoutExpired:
            return [], f"no answer within {TIMEOUT_S[backend]} s"
        results = [json.loads(path.read_text()) for path in sorted(Path(out).glob("*.json"))]
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
    return (results, "") if done.returncode == 0 else ([], f"exit code {done.returncode}: {tail}")


def collective(runs_dir: Path, hardware: Hardware) -> Check:
    if flags_problem(hardware):
        return Check("collective", False, "skipped: NEURON_CC_FLAGS sets another LNC", "see the compiler check")
    if hardware.cores < 2 and hardware.backend != "cpu":
        return Check("collective", True, f"skipped: one {hardware.backend} device, a collective needs two")
    try:
        lease, cores = _take_cores(runs_dir, hardware, 2)
    except (leases.NoFreeCores, leases.CoresBusy) as busy:
        return Check("collective", False, f"no 2 free cores: {busy}", "run it when a run or chat frees two cores")
    try:
        argv = children.module_argv("torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                                    "-m", "studio_core.doctor.doctor_child", "collective")
        ranks, failure = _child(argv, device_env(hardware, compile_cache_root(), cores, processes=2),
                                hardware.backend)
    finally:
        if lease:
            lease.release()
    ranks.sort(key=lambda r: r["rank"])
    seen = ", ".join(f"rank {r['rank']} on {r['visible'] or r['device']}" for r in ranks)
    ok = not failure and len(ranks) == 2 and all(r["value"] == 3.0 for r in ranks)
    if hardware.backend == "neuron":
        ok = ok and [r["visible"] for r in ranks] == [str(c) for c in cores]
    found = f"all-reduce over 2 processes: {seen}, sum {ranks[0]['value'] if ranks else '?'} (expected 3)"
    return Check("collective", ok, found if not failure else f"failed ({failure})",
                 "the processes cannot talk: on Neuron check the runtime and EFA set-up (neuron-ls, "
                 "NEURON_RT_ROOT_COMM_ID unset); elsewhere check that torch.distributed works (a firewall on "
                 "localhost?)")


def compile_step(runs_dir: Path, hardware: Hardware) -> Check:
    if flags_problem(hardware):
        return Check("compile", False, "skipped: NEURON_CC_FLAGS sets another LNC", "see the compiler check")
    try:
        lease, cores = _take_cores(runs_dir, hardware, 1)
    except (leases.NoFreeCores, leases.CoresBusy) as busy:
        return Check("compile", False, f"no free core: {busy}", "run it when a run or chat frees a core")
    env = device_env(hardware, compile_cache_root(), cores)
    argv = children.module_argv("studio_core.doctor.doctor_child", "step")
    try:
        first, failure = _child(argv, env, hardware.backend)
        second, failure = (_child(argv, env, hardware.backend) if first else ([], failure))
    finally:
        if lease:
            lease.release()
    fix = ("torch.compile cannot compile here: on Neuron see TORCH_NEURONX_DEBUG_DIR (default /tmp/neuron_backend) "
           "for the compiler's messages; on CPU Inductor needs a C++ compiler (apt install g++)")
    if failure:
        return Check("compile", False, f"a compiled forward and backward failed ({failure})", fix)
    first, second = first[0], second[0]
    if hardware.backend == "neuron":
        hit = second["neffs_after"] == second["neffs_before"] and first["neffs_after"] > 0
        cache = f"{first['neffs_after']} NEFF(s) in the cache; the second process added {second['neffs_after'] - second['neffs_before']}"
    else:
        hit = second["counters"]["inductor"].get("fxgraph_cache_hit", 0) > 0 and not second["counters"][
            "inductor"].get("fxgraph_cache_miss")
        counts = [(run["counters"]["inductor"].get("fxgraph_cache_miss", 0),
                   run["counters"]["inductor"].get("fxgraph_cache_hit", 0)) for run in (first, second)]
        cache = (f"Inductor FX graph cache: first process {counts[0][0]} graph(s) compiled, {counts[0][1]} from the "
                 f"cache; second process {counts[1][0]} compiled, {counts[1][1]} from the cache")
    found = f"forward and backward compiled in {first['seconds']} s, {second['seconds']} s the second time; {cache}"
    return Check("compile", hit, found, "the second process compiled again: the compile cache is not kept or "
                 "not shared; check `launch.py cache` and that the folder is not cleaned between processes")


# --- folders, monitor, Hub ----------------------------------------------------------------
def folder_writable(name: str, folder: Path, fix: str) -> Check:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
    except OSError as error:
        return Check(name, False, f"{folder}: {error}", fix)
    return Check(name, True, f"{folder} is writable")


def cache_writable(backend: str) -> Check:
    folders = [Path(p) for key, p in device_env(Hardware(backend, 1, 1), compile_cache_root(), None).items()
               if key.endswith("CACHE_DIR")]
    failed = [c for c in (folder_writable("cache", f, "") for f in folders) if not c.ok]
    fix = "set STUDIO_COMPILE_CACHE to a folder you can write to (on a cluster: one every node sees)"
    return Check("cache", not failed, "; ".join(c.found for c in failed) or
                 f"{compile_cache_dir(backend)} is writable ({', '.join(f.name for f in folders)})", fix)


def other_programs(runs_dir: Path, hardware: Hardware) -> Check:
    """neuron-ls must answer: it is how a start sees NeuronCores that programs outside the
    studio use (machine/outside_use.py). Cores in use are said, not a failure."""
    held, problem = leases.taken(runs_dir, hardware)
    if problem:
        return Check("neuron-ls", False, problem, "run `neuron-ls --json-output` by hand to see why; it comes with "
                     "aws-neuronx-tools (/opt/aws/neuron/bin). Neuron 2.34 and later drop --json-output: "
                     "report it, the studio reads only that format so far")
    outside = sorted({leases.describe(info) for info in held.values() if info.get("kind") == OUTSIDE})
    return Check("neuron-ls", True, f"answers; NeuronCores in use outside the studio: {'; '.join(outside)}"
                 if outside else "answers; no program outside the studio uses a NeuronCore")


def monitor(backend: str) -> Check:
    if backend == "neuron":
        from studio_core.machine.monitor import NeuronMonitor

        exe = shutil.which("neuron-monitor")
        if exe is None:
            return Check("monitor", False, "neuron-monitor is not on PATH", "install aws-neuronx-tools and add "
                         "/opt/aws/neuron/bin to PATH: without it the run page has no NeuronCore plots")
        watch = NeuronMonitor([0], exe).start()
        try:
            deadline = time.monotonic() + 10
            while watch.latest() is None and watch.exit_code() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            answered = watch.latest() is not None
        finally:
            watch.stop()
        return Check("monitor", answered, "neuron-monitor answered" if answered else "neuron-monitor gave no report "
                     "in 10 s", "run `neuron-monitor` by hand to see its error")
    if backend == "cuda":
        exe = shutil.which("nvidia-smi")
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=False) if exe else None
        ok = done is not None and done.returncode == 0
        return Check("monitor", ok, done.stdout.strip().splitlines()[0] if ok else "nvidia-smi did not answer",
                     "install the NVIDIA driver tools (nvidia-smi): without it the run page has no GPU memory plot")
    import psutil

    return Check("monitor", True, f"psutil: {psutil.cpu_count()} CPUs, "
                 f"{psutil.virtual_memory().total / 2**30:.1f} GiB memory")


def hub() -> Check:
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return Check("hub", True, "offline (HF_HUB_OFFLINE=1): models and datasets come from local folders and "
                     "the cache only; no push")
    import httpx2  # the HTTP client huggingface_hub 2 uses

    offline = "or set HF_HUB_OFFLINE=1 to work from local models and datasets only"
    try:
        answer = get_session().head(constants.ENDPOINT, timeout=10)
    except (httpx2.HTTPError, OSError) as error:
        found = f"cannot reach {constants.ENDPOINT}: {type(error).__name__}: {error}"
        return Check("hub", False, found, f"check the network or the proxy (HTTPS_PROXY); {offline}")
    # The Hub's home page answers 200; an error status is something else answering in its place
    # (a wrong HF_ENDPOINT, a proxy's or captive portal's page), from which no download would come.
    if answer.status_code >= 400:
        return Check("hub", False, f"{constants.ENDPOINT} answers HTTP {answer.status_code}, not as the Hub does",
                     f"check HF_ENDPOINT (it names the Hub or its mirror) and the proxy (HTTPS_PROXY); {offline}")
    return Check("hub", True, f"{constants.ENDPOINT} answers (HTTP {answer.status_code})")


def verdict(results: list[Check]) -> str:
    """The last line of the doctor's answer: all passed, or how many failed."""
    failed = sum(not c.ok for c in results)
    return "all checks passed" if not failed else f"{failed} check(s) failed: see \"what to do\" above"
