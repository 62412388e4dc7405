"""The memory a rank used at its busiest while it trained, measured by the rank itself, to set
beside the plan's estimate (training/memory.py) in the run's `peak_memory` event.

- CUDA, and Neuron where TorchNeuron's allocator reports it: `torch.accelerator.max_memory_allocated()`,
  PyTorch's device-generic form of `torch.cuda.max_memory_allocated()` (PyTorch 2.9 and later):
  the peak of the tensors' memory, not what the allocator keeps cached. On Neuron this is NOT
  verified on hardware (the Neuron notes list `torch.neuron.memory.*`, with max allocated, as
  TorchNeuron's; whether it reports through `torch.accelerator` is not known): where it raises,
  the peak of TorchNeuron's own statistics is taken (below), else the event says the device's peak
  was not measured, and the run's hardware samples (neuron-monitor's memory per core) remain.
- Neuron, beside it (`allocator` in the same event): what TorchNeuron's caching allocator says
  of the core, `torch.neuron.memory_stats()` read once training ended (its peaks cover the whole
  run, the first step's compiled graphs included): bytes allocated, reserved and active, now and
  at their peak, and its out-of-memory and retry counts (allocator_stats). The runtime's own
  memory (microcode, scratchpad, DMA rings) is outside these: the runtime prints it per loaded
  graph at NEURON_RT_LOG_LEVEL_TDRV=info (AWS Neuron docs, "Neuron Device Memory", its per-NEFF
  INFO logs), into the run's train.log (docs/trainium-first-run.md says how a first run uses it).
- CPU: the model's tensors (and the reference model's), resident when training begins, plus how far
  the process's resident memory rose above its level then (Linux's high-water mark, VmHWM, reset
  at that moment through /proc/self/clear_refs): gradients, the optimizer's state, activations and
  what the C allocator keeps of them, but not the tokenized dataset, the tokenizer or the code
  imported before training, which a device's memory would not hold either. Nor the libraries' code
  the first steps run: its pages are mapped from files, and come into resident memory as it first
  runs (about 20 MiB for TRL's SFT step), so what the file-backed part (RssFile) grew since
  training began is taken off the rise. Where the mark cannot be reset, the mark above the level
  before the model loaded (all of that included) is said.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil

from studio_core.training.memory import gib

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
# torch.neuron.memory_stats() (torch-neuronx's torch.neuron module hands it to
# torch_neuronx.memory_stats()): the AWS Neuron docs "How to profile memory usage in torch-neuronx"
# (call torch.neuron.synchronize() first: the allocator is asynchronous) and "Guidelines for memory
# management" (reserved >= allocated >= active). Its shape, as torch-neuronx's own tests of it read
# it (source, not seen on a device): {"allocated_bytes": {"current": B, "peak": B}, "reserved_bytes":
# {...}, "active_bytes": {...}, "num_alloc_retries": n, "num_ooms": n, "num_tensor_frees": n,
# "allocation_requests": n}. PyTorch's flat form of torch.cuda.memory_stats()
# ("allocated_bytes.all.peak") is read too, should a version follow it.
ALLOCATOR_BYTES = ("allocated_bytes", "reserved_bytes", "active_bytes")
ALLOCATOR_COUNTS = ("num_ooms", "num_alloc_retries")


def status_bytes(field: str) -> int:
    """A memory figure of /proc/self/status in bytes (kilobytes in the file): VmHWM, the peak
    resident memory; RssFile, the resident pages mapped from files."""
    return int(re.search(rf"{field}:\s+(\d+)", STATUS.read_text()).group(1)) * 1024


def tensor_bytes(*models) -> int:
    """Bytes of the parameters and buffers of the models given (None skipped; shared ones once)."""
    seen, total = set(), 0
    for model in models:
        if model is None:
            continue
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total


def allocator_stats(stats: dict) -> dict:
    """Bytes now and at the peak ({"allocated_bytes": {"current": B, "peak": B}, ...}) and the
    out-of-memory and retry counts in an answer of torch.neuron.memory_stats(), in either form;
    {} when it holds none of them."""
    found: dict = {}
    for name in ALLOCATOR_BYTES:
        nested = stats.get(name)
        values = nested if isinstance(nested, dict) else {when: stats.get(f"{name}.all.{when}")
                                                          for when in ("current", "peak")}
        pair = {when: int(values[when]) for when in ("current", "peak")
                if isinstance(values.get(when), (int, float)) and not isinstance(values.get(when), bool)}
        if pair:
            found[name] = pair
    found.update({name: int(stats[name]) for name in ALLOCATOR_COUNTS
                  if isinstance(stats.get(name), int) and not isinstance(stats.get(name), bool)})
    return found


def describe_allocator(allocator: dict | None) -> str | None:
    """The run summary's words for a peak_memory event's `allocator`: "TorchNeuron's allocator at
    its peak: 9.80 GiB allocated, 10.2 GiB reserved (no allocation retries or out-of-memory
    errors)"; why it was not read; None without one."""
    if not allocator:
        return None
    if allocator.get("error"):
        return f"TorchNeuron's allocator not read: {allocator['error']}"
    peaks = [f"{gib(allocator[name]['peak'])} {name.removesuffix('_bytes')}" for name in ALLOCATOR_BYTES[:2]
             if "peak" in allocator.get(name, {})]
    retries, ooms = allocator.get("num_alloc_retries"), allocator.get("num_ooms")
    counts = (f" ({retries or 0} allocation retries, {ooms or 0} out-of-memory errors)" if retries or ooms
              else " (no allocation retries or out-of-memory errors)" if 0 in (retries, ooms) else "")
    return f"TorchNeuron's allocator at its peak: {', '.join(peaks) or 'no peak reported'}{counts}"


# glibc's heap keeps blocks freed by tensors (and a model's tensors under 128 KiB all come from
# it), so the CPU's resident peak reads above what a device's allocator would count: bench/memory.py
# measures with MALLOC_MMAP_THRESHOLD_ set, where its 21 cases read 0.88-1.04 of the estimate, a plain
# run reads about half (the Qwen3 case: 761 MiB with it, 1.44 GiB without).
CPU_HEAP = ("; on the CPU it also counts memory freed tensors leave in the C library's heap, so it reads up to "
            "about twice a device's figure")


class PeakMemory:
    """Made before the model loads; `training_begins()` when training begins; `measured()` after."""

    def __init__(self):
        self.start_rss = psutil.Process().memory_info().rss
        # (resident bytes, its file-backed part, the models' tensor bytes) when training begins
        self.begin: tuple[int, int, int] | None = None

    def training_begins(self, *models) -> None:
        try:
            CLEAR_REFS.write_text("5")  # 5: reset the high-water mark to the memory resident now
        except OSError:
            return  # measured from the model's load instead, and said so
        self.begin = (psutil.Process().memory_info().rss, status_bytes("RssFile"), tensor_bytes(*models))

    def measured(self, device: str) -> tuple[int | None, str]:
        """(bytes, how they were measured), or (None, why not)."""
        if device == "cpu":
            if self.begin is None:
                return max(status_bytes("VmHWM") - self.start_rss, 0), ("resident memory high-water mark above "
                                                                        "its level before the model loaded" + CPU_HEAP)
            rss, files, tensors = self.begin
            code = max(status_bytes("RssFile") - files, 0)
            return tensors + max(status_bytes("VmHWM") - rss - code, 0), (
                "the model's tensors plus the resident memory high-water mark above its level when training began, "
                "less the libraries' code first run since" + CPU_HEAP)
        import torch

        try:
            return int(torch.accelerator.max_memory_allocated()), "torch.accelerator.max_memory_allocated()"
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            peak = ((self.allocator(device) or {}).get("allocated_bytes") or {}).get("peak")
            if peak is not None:
                return peak, "torch.neuron.memory_stats()'s allocated_bytes peak"
            return None, f"the {device} allocator does not report its peak ({type(error).__name__}: {error})"

    def allocator(self, device: str) -> dict | None:
        """On Neuron, TorchNeuron's allocator statistics of this rank's core (allocator_stats) with
        `source`, or {"error": why not}; None on other devices."""
        if device != "neuron":
            return None
        import torch

        try:
            torch.neuron.synchronize()  # the allocator is asynchronous: its figures lag the queued work
            found = allocator_stats(torch.neuron.memory_stats())
        except (AttributeError, RuntimeError, NotImplementedError, TypeError) as error:
            return {"error": f"torch.neuron.memory_stats() failed ({type(error).__name__}: {error})"}
        return {"source": "torch.neuron.memory_stats()", **found} if found else {
            "error": "torch.neuron.memory_stats() reported none of " + ", ".join(ALLOCATOR_BYTES)}
