"""The doctor's checks that run on the device, each in a process of its own.

    torchrun --nproc-per-node=2 -m studio_core.doctor.doctor_child collective
    python -m studio_core.doctor.doctor_child step

`collective`: every rank keeps its own core (device_env.use_rank_core, as the worker does),
joins the process group with the backend a run uses (neuron, nccl, gloo) and all-reduces
rank + 1; it writes {rank, visible, device, value}.
`step`: one compiled forward and backward of a tiny model, with the compile backend a run
uses (neuron on Neuron, inductor elsewhere), its graphs written to the compile cache the
environment names; it writes {seconds, device, counters, neffs_before, neffs_after}.
Each process writes its result as JSON to a file of its own in $STUDIO_DOCTOR_OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from studio_core.machine.device_env import use_rank_core

use_rank_core()  # before torch loads, as in the worker


def _neuron() -> bool:
    import importlib.util

    import torch

    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    import torch_neuronx  # noqa: F401 (registers the "neuron" device, as the hardware probe does)

    return torch.neuron.is_available()


def _device(local_rank: int = 0):
    import torch

    if _neuron():
        return torch.device("neuron")  # each process sees its one core as neuron:0
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "neuron":
        import torch_neuronx

        torch_neuronx.synchronize()  # what TorchNeuron's own get_dynamo_metrics calls to wait for the device
    elif device.type == "cuda":
        torch.cuda.synchronize()


def collective() -> None:
    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = _device(local_rank)
    dist.init_process_group(backend={"neuron": "neuron", "cuda": "nccl"}.get(device.type, "gloo"))
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    _sync(device)
    _write(f"rank{rank}", {"rank": rank, "visible": os.environ.get("NEURON_RT_VISIBLE_CORES"),
                           "device": str(device), "value": value.item()})
    dist.barrier()
    dist.destroy_process_group()


def _write(name: str, result: dict) -> None:
    (Path(os.environ["STUDIO_DOCTOR_OUT"]) / f"{name}.json").write_text(json.dumps(result))


def _neffs() -> int:
    folder = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    return sum(1 for _ in Path(folder).rglob("*.neff")) if folder and Path(folder).is_dir() else 0


def step() -> None:
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.config.automatic_dynamic_shapes = False  # as a run with torch_compile has it
    device, before, start = _device(), _neffs(), time.time()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
    compiled = torch.compile(model, backend="neuron" if device.type == "neuron" else "inductor")
    compiled(torch.randn(4, 16, device=device)).sum().backward()
    _sync(device)
    _write("step", {"seconds": round(time.time() - start, 2), "device": str(device), "neffs_before": before,
                    "neffs_after": _neffs(),
                    "counters": {k: dict(counters[k]) for k in ("inductor", "aot_autograd", "neuron")}})


if __name__ == "__main__":
    from studio_core.machine.children import skip_final_collection

    skip_final_collection()
    {"collective": collective, "step": step}[sys.argv[1]]()
