"""What the hardware is doing for one run: CPU and memory of its processes, NeuronCore
utilisation and device memory (neuron-monitor), CUDA memory (nvidia-smi).

The run's supervisor (studio_core.training.supervisor) owns a `RunMonitor`, samples it every
SAMPLE_EVERY_S seconds in its wait loop and appends each sample as a `hardware` event;
the run page plots them. A source that is missing (neuron-monitor or nvidia-smi not on
PATH, the wrong backend) is named with the reason, in a `log` event at the start and in
the `sources` field of the hardware events, so the page says so instead of showing nothing.

Nothing here has run on Trainium: the neuron-monitor records this module reads were
written from the AWS Neuron documentation ("Neuron Monitor User Guide", its JSON output
format), not captured from a real neuron-monitor.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading

import psutil

SAMPLE_EVERY_S = 2.0
NVIDIA_SMI_TIMEOUT_S = 10
MiB = 1024 * 1024


class ProcessSampler:
    """CPU and resident memory of a process and all its descendants (torchrun and every rank).

    psutil's cpu_percent is the CPU time used since the previous call on the same Process
    object (the first call gives 0.0), so the objects are kept from one sample to the next.
    """

    def __init__(self):
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, root_pid: int) -> dict:
        """{cpu_percent (100 = one core busy, summed over the tree), rss_bytes, processes, pids}.

        RSS is summed per process, so memory pages shared between ranks count once per rank.
        """
        try:
            root = psutil.Process(root_pid)
            tree = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            tree = []  # the run ended between two samples
        seen: dict[int, psutil.Process] = {}
        cpu, rss = 0.0, 0
        for proc in tree:
            cached = self._procs.get(proc.pid)
            proc = cached if cached is not None and cached == proc else proc  # same pid and start time
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                memory = proc.memory_info().rss
                if memory == 0:  # exiting: its memory is already released, though not yet a zombie
                    continue
                cpu += proc.cpu_percent(interval=None)
                rss += memory
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue  # ended while we looked (or, never expected, not ours to read)
            seen[proc.pid] = proc
        self._procs = seen
        return {"cpu_percent": round(cpu, 1), "rss_bytes": rss, "processes": len(seen), "pids": sorted(seen)}


# neuron-monitor's JSON report, as the Neuron Monitor User Guide documents it (not seen on
# hardware): {"neuron_runtime_data": [{"pid", "neuron_runtime_tag", "error", "report": {
#   "neuroncore_counters": {"neuroncores_in_use": {"<core>": {"neuroncore_utilization": %}}},
#   "memory_used": {"neuron_runtime_used_bytes": {"neuron_device": B, "usage_breakdown": {
#       "neuroncore_memory_usage": {"<core>": {"constants": B, "model_code": B, "tensors": B, ...}}}}}}}],
#  "neuron_hardware_info": {...}, "instance_info": {...}}
# One entry per Neuron application (here: per rank). The core index is read as the machine's
# NeuronCore index (the guide lists "0" to "64" on a trn2.48xlarge), the numbering
# NEURON_RT_VISIBLE_CORES uses, not a process's own renumbering from 0: an assumption.


def parse_neuron_monitor(record: dict, cores: list[int]) -> dict:
    """Utilisation (%) and device memory (bytes) of the given NeuronCores in one report:
    {"cores": {"<core>": {"utilization": %, "memory_bytes": B}}, "errors": [...] when any}.
    A core no Neuron application reports on is left out."""
    wanted = {str(core) for core in cores}
    found: dict[str, dict] = {}
    errors = []
    for runtime in record.get("neuron_runtime_data") or []:
        if runtime.get("error"):
            errors.append(f"pid {runtime.get('pid')}: {runtime['error']}")
        report = runtime.get("report") or {}
        counters = report.get("neuroncore_counters") or {}
        for core, data in (counters.get("neuroncores_in_use") or {}).items():
            if core in wanted and isinstance(data.get("neuroncore_utilization"), (int, float)):
                entry = found.setdefault(core, {})
                entry["utilization"] = max(entry.get("utilization", 0.0), float(data["neuroncore_utilization"]))
        used = (report.get("memory_used") or {}).get("neuron_runtime_used_bytes") or {}
        per_core = (used.get("usage_breakdown") or {}).get("neuroncore_memory_usage") or {}
        for core, parts in per_core.items():
            if core in wanted and isinstance(parts, dict):
                entry = found.setdefault(core, {})
                entry["memory_bytes"] = entry.get("memory_bytes", 0) + sum(
                    v for v in parts.values() if isinstance(v, (int, float)))
        for group in ("neuroncore_counters", "memory_used"):
            if (report.get(group) or {}).get("error"):
                errors.append(f"{group}: {report[group]['error']}")
    hardware_error = (record.get("neuron_hardware_info") or {}).get("error")
    if hardware_error:
        errors.append(f"neuron_hardware_info: {hardware_error}")
    sample = {"cores": dict(sorted(found.items(), key=lambda item: int(item[0])))}
    if errors:
        sample["errors"] = errors
    return sample


# Only the two metric groups the page shows, every second, for every Neuron application.
# Written from the guide's configuration example; not checked against a real neuron-monitor.
NEURON_MONITOR_CONFIG = {
    "period": "1s",
    "neuron_runtimes": [{"tag_filter": ".*", "metrics": [{"type": "neuroncore_counters"}, {"type": "memory_used"}]}],
}


class NeuronMonitor:
    """Runs `neuron-monitor -c CONFIG` and keeps the newest report, parsed for the run's cores.

    A thread reads its stdout, where it writes one complete JSON report per period (one per
    line as documented; a report spread over several lines is read too). Its stderr goes
    where this process's does (the supervisor's: train.log).
    """

    def __init__(self, cores: list[int], executable: str = "neuron-monitor"):
        self.cores = list(cores)
        self.executable = executable
        self.reports = 0  # reports read so far
        self._latest: dict | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._config: str | None = None

    def start(self) -> NeuronMonitor:
        fd, self._config = tempfile.mkstemp(prefix="studio-neuron-monitor-", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            json.dump(NEURON_MONITOR_CONFIG, handle)
        self._proc = subprocess.Popen([self.executable, "-c", self._config], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._thread = threading.Thread(target=self._read, name="neuron-monitor", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        decoder = json.JSONDecoder()
        pending = ""
        for line in self._proc.stdout:
            pending = (pending + line).lstrip()
            if not pending:
                continue
            try:
                record, end = decoder.raw_decode(pending)
            except json.JSONDecodeError:
                continue  # a report not complete yet: read on
            pending = pending[end:]
            if isinstance(record, dict):
                sample = parse_neuron_monitor(record, self.cores)
                with self._lock:
                    self._latest, self.reports = sample, self.reports + 1

    def latest(self) -> dict | None:
        """The newest parsed report (see parse_neuron_monitor), None before the first."""
        with self._lock:
            return self._latest

    def exit_code(self) -> int | None:
        """None while neuron-monitor runs."""
        return None if self._proc is None else self._proc.poll()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._config:
            os.unlink(self._config)
            self._config = None


def cuda_memory(pids: list[int], nvidia_smi: str = "nvidia-smi") -> int:
    """CUDA memory (bytes) held by these processes, from nvidia-smi's compute-apps query.

    nvidia-smi reports host pids: inside a container with its own pid namespace none may
    match, and this reads 0. Raises RuntimeError when nvidia-smi fails.
    """
    argv = [nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nvidia-smi exited with code {done.returncode}: {done.stderr.strip()[:200]}")
    wanted, total = set(pids), 0
    for line in done.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and int(fields[0]) in wanted and fields[1].isdigit():
            total += int(fields[1]) * MiB  # MiB, as nvidia-smi's nounits reports used_memory
    return total


class RunMonitor:
    """Every source the supervisor samples for one run, and which are missing and why.

    `sources` is {"monitored": [...], "unavailable": [...]}, in words; it goes into the first
    hardware event and into every one after it changes (a source that failed), so a reader
    of the events can always say what the plots cover.
    """

    def __init__(self, backend: str, cores: list[int], root_pid: int, *,
                 neuron_monitor: str = "neuron-monitor", nvidia_smi: str = "nvidia-smi"):
        self.root_pid = root_pid
        self.processes = ProcessSampler()
        self.neuron: NeuronMonitor | None = None
        self.nvidia_smi: str | None = None
        monitored = ["CPU and memory (RSS) of torchrun and every rank (psutil)"]
        unavailable = []
        if backend != "neuron":
            unavailable.append(f"NeuronCore utilisation: not applicable on the {backend} backend")
        elif found := shutil.which(neuron_monitor):
            self.neuron = NeuronMonitor(cores, found).start()
            monitored.append(f"utilisation and device memory of NeuronCores {cores} (neuron-monitor)")
        else:
            unavailable.append("neuron-monitor not installed: no NeuronCore utilisation")
        if backend != "cuda":
            unavailable.append(f"CUDA memory: not applicable on the {backend} backend")
        elif found := shutil.which(nvidia_smi):
            self.nvidia_smi = found
            monitored.append("CUDA memory of the run's processes (nvidia-smi)")
        else:
            unavailable.append("nvidia-smi not found: no CUDA memory")
        self.sources = {"monitored": monitored, "unavailable": unavailable}
        self._sources_sent = False
        self.processes.sample(root_pid)  # psutil's first cpu_percent call per process only starts the clock

    def describe(self) -> str:
        """One line for the run's log: what is monitored and what is not available."""
        text = "hardware monitoring every %g s: %s" % (SAMPLE_EVERY_S, "; ".join(self.sources["monitored"]))
        return text + (f". Not available: {'; '.join(self.sources['unavailable'])}" if self.sources["unavailable"] else "")

    def sample(self) -> dict:
        """The fields of one `hardware` event."""
        procs = self.processes.sample(self.root_pid)
        fields = {k: procs[k] for k in ("cpu_percent", "rss_bytes", "processes")}
        if self.neuron is not None:
            if self.neuron.exit_code() is not None:
                self._lose("neuron", f"neuron-monitor ended with exit code {self.neuron.exit_code()} "
                                     "(its messages are in train.log): no NeuronCore utilisation")
            elif (latest := self.neuron.latest()) is not None:
                fields["neuron"] = latest
        if self.nvidia_smi is not None:
            try:
                fields["cuda_mem_bytes"] = cuda_memory(procs["pids"], self.nvidia_smi)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as failed:
                self._lose("cuda", f"nvidia-smi failed ({failed}): no CUDA memory")
        if not self._sources_sent:
            fields["sources"] = self.sources
            self._sources_sent = True
        return fields

    def _lose(self, source: str, why: str) -> None:
        """Stop sampling a source that failed, and say so in the next event's `sources`."""
        if source == "neuron":
            self.neuron.stop()
            self.neuron = None
            self.sources["monitored"] = [m for m in self.sources["monitored"] if "neuron-monitor" not in m]
        else:
            self.nvidia_smi = None
            self.sources["monitored"] = [m for m in self.sources["monitored"] if "nvidia-smi" not in m]
        self.sources["unavailable"].append(why)
        self._sources_sent = False

    def stop(self) -> None:
        if self.neuron is not None:
            self.neuron.stop()
