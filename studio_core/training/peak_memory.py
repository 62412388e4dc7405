"""The memory a rank used at its busiest while it trained, measured by the rank itself, to set
beside the plan's estimate (training/memory.py) in the run's `peak_memory` event.

- CUDA, and Neuron where TorchNeuron's allocator reports it: `torch.accelerator.max_memory_allocated()`,
  PyTorch's device-generic form of `torch.cuda.max_memory_allocated()` (PyTorch 2.9 and later):
  the peak of the tensors' memory, not what the allocator keeps cached. On Neuron this is NOT
  verified on hardware (the Neuron notes list `torch.neuron.memory.*`, with max allocated, as
  TorchNeuron's; whether it reports through `torch.accelerator` is not known): where it raises, the
  event says the device's peak was not measured, and the run's hardware samples (neuron-monitor's
  memory per core) remain.
- CPU: the process's resident-memory high-water mark (getrusage's ru_maxrss) above its resident
  memory just before the model was loaded: the model, its gradients, the optimizer's state and
  the activations, with what the C allocator keeps and what training imports after that point.
"""

from __future__ import annotations

import resource

import psutil


class PeakMemory:
    """Made before the model loads (the CPU's starting point); `measured()` after training."""

    def __init__(self):
        self.start_rss = psutil.Process().memory_info().rss

    def measured(self, device: str) -> tuple[int | None, str]:
        """(bytes, how they were measured), or (None, why not)."""
        if device == "cpu":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
            return max(peak - self.start_rss, 0), "resident memory high-water mark above its level before the " \
                "model loaded"
        import torch

        try:
            return int(torch.accelerator.max_memory_allocated()), "torch.accelerator.max_memory_allocated()"
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            return None, f"the {device} allocator does not report its peak ({type(error).__name__}: {error})"
