"""The environment of every process that puts a model on a device: a run's ranks, the chat
process (and the server behind it), the export, the doctor's checks. One function builds it,
so none of them loads onto Neuron without the settings Neuron needs.

On Neuron:
- `HF_DEACTIVATE_ASYNC_LOAD=1`: Transformers' asynchronous weight loading hangs there.
- `TORCH_NEURONX_NEFF_CACHE_DIR`: compiled graphs land in the studio's compile cache, shared
  by runs, chat and the doctor (TorchNeuron's own default is /tmp/neff_cache).
- `NEURON_LOGICAL_NC_CONFIG`: the machine's Logical NeuronCore setting, so a process sees
  cores as the studio counted them.
- Cores. The Neuron backend keeps a `NEURON_RT_VISIBLE_CORES` it finds set, gives every
  core of it to the one process, and then requires exactly one device per process (read
  in the torch-neuronx source; not tried on a device). So a one-process job gets
  `NEURON_RT_VISIBLE_CORES` directly, and a torchrun of N ranks gets the block in
  `STUDIO_NEURON_CORES`: each rank calls `use_rank_core()` before torch is imported and
  keeps core block[LOCAL_RANK] (what torch-xla's core remapping used to do). A Slurm
  job's nodes are its own: no core is named and torch-neuronx picks by LOCAL_RANK.
Elsewhere: `CUDA_VISIBLE_DEVICES` on CUDA, `OMP_NUM_THREADS` on CPU, and Inductor's cache.
"""

from __future__ import annotations

import os

from studio_core.compile_cache import compile_cache_env
from studio_core.cores import format_cores, parse_cores

RANK_CORES = "STUDIO_NEURON_CORES"  # a multi-rank Neuron job's core block; each rank keeps one
VISIBLE = "NEURON_RT_VISIBLE_CORES"

REASONS = {
    "TORCHINDUCTOR_CACHE_DIR": "with torch.compile's inductor backend, compiled graphs (FX graph and AOTAutograd "
                               "caches) are kept and reused by later runs on this backend",
    "HF_DEACTIVATE_ASYNC_LOAD": "Transformers' async weight loading hangs on Neuron",
    "TORCH_NEURONX_NEFF_CACHE_DIR": "compiled graphs (NEFFs) are kept and reused by later steps and runs with "
                                    "identical graphs: same model, shapes, dtype, layout and compiler version",
    VISIBLE: "the NeuronCores of this one process, held for it alone while it runs",
    RANK_CORES: "one NeuronCore per rank: the Neuron backend gives a process every core it sees and allows one "
                "device per process, so each rank keeps block[LOCAL_RANK] as its NEURON_RT_VISIBLE_CORES, set by "
                "the worker before torch loads",
}


def device_env(hardware, compile_cache, cores: list[int] | None, processes: int = 1,
               written: str | None = None) -> dict[str, str]:
    """What a process (or each of `processes` ranks) needs on `hardware`, placed on `cores`
    (None: no core is named, as on a Slurm node). `written`: the cores as the user wrote
    them ("0,1"), kept when they name the same cores. Pure: `compile_cache` is the root."""
    env = compile_cache_env(hardware.backend, compile_cache)
    text = written if written and cores is not None and parse_cores(written) == cores else (
        format_cores(cores) if cores else None)
    if hardware.backend == "neuron":
        env["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
        if hardware.lnc:
            env["NEURON_LOGICAL_NC_CONFIG"] = str(hardware.lnc)
        if text is not None:
            env[VISIBLE if processes == 1 else RANK_CORES] = text
    elif hardware.backend == "cuda" and cores is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cores))
    elif hardware.backend == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (len(cores) if cores else hardware.cpu_count) // processes))
    return env


def rank_cores(env: dict[str, str]) -> list[str]:
    """Each rank's NEURON_RT_VISIBLE_CORES under `env` (one entry for a one-process job, none
    when no core is named): what the plan and Preview show."""
    if RANK_CORES in env:
        return [str(core) for core in parse_cores(env[RANK_CORES])]
    return [env[VISIBLE]] if VISIBLE in env else []


def describe_rank_cores(cores: list[str]) -> str:
    """"rank 0: 4, rank 1: 5, ..." (the first four and the last of a long list)."""
    shown = [f"rank {rank}: {core}" for rank, core in enumerate(cores)]
    return ", ".join(shown if len(shown) <= 6 else [*shown[:4], "...", shown[-1]])


def use_rank_core(environ=os.environ) -> str | None:
    """In a rank of a multi-rank Neuron job (STUDIO_NEURON_CORES and LOCAL_RANK set): keep
    only this rank's core in NEURON_RT_VISIBLE_CORES and return it. Call it before torch is
    imported: the Neuron runtime reads the variable once, when it starts."""
    block = environ.get(RANK_CORES)
    if not block or "LOCAL_RANK" not in environ:
        return None
    cores, rank = parse_cores(block), int(environ["LOCAL_RANK"])
    if rank >= len(cores):
        raise RuntimeError(f"local rank {rank} has no core: {RANK_CORES}={block} names {len(cores)}; "
                           "start as many processes per node as cores")
    environ[VISIBLE] = str(cores[rank])
    return environ[VISIBLE]
