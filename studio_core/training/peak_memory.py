"""The memory a rank used at its busiest while it trained, measured by the rank itself, to set
beside the plan's estimate (training/memory.py) in the run's `peak_memory` event.

- CUDA, and Neuron where TorchNeuron's allocator reports it: `torch.accelerator.max_memory_allocated()`,
  PyTorch's device-generic form of `torch.cuda.max_memory_allocated()` (PyTorch 2.9 and later):
  the peak of the tensors' memory, not what the allocator keeps cached. On Neuron this is NOT
  verified on hardware (the Neuron notes list `torch.neuron.memory.*`, with max allocated, as
  TorchNeuron's; whether it reports through `torch.accelerator` is not known): where it raises, the
  event says the device's peak was not measured, and the run's hardware samples (neuron-monitor's
  memory per core) remain.
- CPU: the model's tensors (and the reference model's), resident when training begins, plus how far
  the process's resident memory rose above its level then (Linux's high-water mark, VmHWM, reset
  at that moment through /proc/self/clear_refs): gradients, the optimizer's state, activations and
  what the C allocator keeps of them, but not the tokenized dataset, the tokenizer or the code
  imported before training, which a device's memory would not hold either. Where the mark cannot
  be reset, the mark above the level before the model loaded (all of that included) is said.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def high_water_mark() -> int:
    """The process's peak resident memory in bytes (VmHWM; kilobytes in the file)."""
    return int(re.search(r"VmHWM:\s+(\d+)", STATUS.read_text()).group(1)) * 1024


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


class PeakMemory:
    """Made before the model loads; `training_begins()` when training begins; `measured()` after."""

    def __init__(self):
        self.start_rss = psutil.Process().memory_info().rss
        self.begin: tuple[int, int] | None = None  # (resident bytes, the models' tensor bytes) at train begin

    def training_begins(self, *models) -> None:
        try:
            CLEAR_REFS.write_text("5")  # 5: reset the high-water mark to the memory resident now
        except OSError:
            return  # measured from the model's load instead, and said so
        self.begin = (psutil.Process().memory_info().rss, tensor_bytes(*models))

    def measured(self, device: str) -> tuple[int | None, str]:
        """(bytes, how they were measured), or (None, why not)."""
        if device == "cpu":
            if self.begin is None:
                return max(high_water_mark() - self.start_rss, 0), ("resident memory high-water mark above its "
                                                                    "level before the model loaded")
            rss, tensors = self.begin
            return tensors + max(high_water_mark() - rss, 0), ("the model's tensors plus the resident memory "
                                                               "high-water mark above its level when training began")
        import torch

        try:
            return int(torch.accelerator.max_memory_allocated()), "torch.accelerator.max_memory_allocated()"
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            return None, f"the {device} allocator does not report its peak ({type(error).__name__}: {error})"
