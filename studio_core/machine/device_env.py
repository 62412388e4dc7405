"""The environment of every process that puts a model on a device: a run's ranks, the chat
process (and the server behind it), the export, the doctor's checks. One function builds it,
so none of them loads onto Neuron without the settings Neuron needs.

On Neuron:
- `HF_DEACTIVATE_ASYNC_LOAD=1`: Transformers' asynchronous weight loading hangs there.
- `TORCH_NEURONX_NEFF_CACHE_DIR`: compiled graphs land in the studio's compile cache, shared
  by runs, chat and the doctor (TorchNeuron's own default is /tmp/neff_cache).
- `NEURON_LOGICAL_NC_CONFIG`: the machine's Logical NeuronCore setting, so a process sees
  cores as the studio counted them, and the compiler builds for it (TorchNeuron's `--lnc`).
- `NEURON_CC_FLAGS`: the user's own, kept exactly as given; the studio adds no `--lnc`, since
  TorchNeuron passes the runtime's LNC to the compiler itself (`compiler_flags`). A user
  `--lnc` that names another LNC than the runtime's is refused with what to change.
- Cores. The Neuron backend keeps a `NEURON_RT_VISIBLE_CORES` it finds set, gives every
  core of it to the one process, and then requires exactly one device per process (read
  in the torch-neuronx source; not tried on a device). So a one-process job gets
  `NEURON_RT_VISIBLE_CORES` directly, and a torchrun of N ranks gets the block in
  `STUDIO_NEURON_CORES`: each rank calls `use_rank_core()` before torch is imported and
  keeps core block[LOCAL_RANK] (what torch-xla's core remapping used to do). A Slurm
  job's nodes are its own: no core is named and torch-neuronx picks by LOCAL_RANK.
- Between machines (`between_nodes`: a cluster's nodes): libfabric over the nodes' EFA adapters
  (AWS's multi-node settings: FI_PROVIDER=efa, device RDMA, fork safety).
Elsewhere: `CUDA_VISIBLE_DEVICES` on CUDA, `OMP_NUM_THREADS` on CPU, and Inductor's cache.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from studio_core.machine.compile_cache import compile_cache_env
from studio_core.machine.cores import format_cores, parse_cores

RANK_CORES = "STUDIO_NEURON_CORES"  # a multi-rank Neuron job's core block; each rank keeps one
VISIBLE = "NEURON_RT_VISIBLE_CORES"
CC_FLAGS = "NEURON_CC_FLAGS"  # the options torch-neuronx hands neuronx-cc
# neuronx-cc's spellings of the LNC option: "--logical-nc-config" and "-lnc" (AWS Neuron
# "Logical NeuronCore configuration" page), "--lnc" (the compiler's error pages NCC_EARG001 and
# NCC_EVRF066, the latter with NEURON_CC_FLAGS="--lnc=1"); each as "--lnc=2" or "--lnc 2".
LNC_OPTIONS = ("--lnc", "-lnc", "--logical-nc-config")
LNC_PAGE = ("the compiler must build for the runtime's LNC (AWS Neuron docs, \"Logical NeuronCore "
            "configuration\": a different one is not supported)")

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
    "NEURON_LOGICAL_NC_CONFIG": "the runtime's Logical NeuronCore setting (physical cores per logical core), so "
                                "each process sees the cores as the studio counted them; TorchNeuron passes it to "
                                "the compiler as --lnc, so NEFFs are built for the same LNC",
    "FI_PROVIDER": "libfabric talks to the nodes' EFA adapters: collectives between nodes go over EFA",
    "FI_EFA_USE_DEVICE_RDMA": "the Neuron devices read and write across nodes directly (RDMA), without a copy "
                              "through host memory",
    "FI_EFA_FORK_SAFE": "data loader workers fork; without it, forked processes can break registered EFA memory "
                        "(needed on Amazon Linux 2)",
    CC_FLAGS: "your own compiler options, kept exactly as given: TorchNeuron passes --lnc from "
              "NEURON_LOGICAL_NC_CONFIG itself and appends these (they are part of every NEFF cache key, so the "
              f"studio adds nothing); an --lnc in them must name the runtime's LNC: {LNC_PAGE}",
}


class CompilerFlagsError(ValueError):
    """NEURON_CC_FLAGS cannot be used on this hardware: `found` says what is wrong, `fix` what to change."""

    def __init__(self, found: str, fix: str):
        super().__init__(f"{found}: {fix}")
        self.found, self.fix = found, fix


# Not set by the studio. TorchNeuron passes the compiler `--lnc` itself, from
# NEURON_LOGICAL_NC_CONFIG (else the platform's default, 2 on trn2 and trn3), and then appends
# NEURON_CC_FLAGS, which are also part of every NEFF cache key (torch-neuronx source: the native
# backend's neuronx-cc invocation and its NEFF cache key). An `--lnc` added here would reach the
# compiler twice and give the studio's NEFFs other cache keys than a plain TorchNeuron run of the
# same graph. The studio sets NEURON_LOGICAL_NC_CONFIG (device_env), so the compiler builds for the
# runtime's LNC; what it still checks is a user `--lnc` that contradicts it, since a NEFF compiled
# for another LNC does not run (AWS Neuron docs, "Logical NeuronCore configuration").
def compiler_flags(lnc: int, flags: str | None) -> str | None:
    """`flags` (the user's NEURON_CC_FLAGS, or None when unset), exactly as given: nothing is added.
    CompilerFlagsError when they name an LNC other than `lnc` (the runtime's), or cannot be read
    as shell words."""
    if flags is None:
        return None
    try:
        words = shlex.split(flags)
    except ValueError as error:
        raise CompilerFlagsError(f"{CC_FLAGS}={flags!r} cannot be read as shell words ({error})",
                                 "fix its quoting, or unset it") from None
    for at, word in enumerate(words):
        option, equals, value = word.partition("=")
        if option not in LNC_OPTIONS:
            continue
        value = value if equals else (words[at + 1] if at + 1 < len(words) else "")
        if value.strip() != str(lnc):
            raise CompilerFlagsError(
                f"{CC_FLAGS} in the studio's environment sets {option} {value or '(no value)'}, but the runtime "
                f"runs at LNC={lnc} (NEURON_LOGICAL_NC_CONFIG={lnc}) and {LNC_PAGE}",
                f"remove {option} from {CC_FLAGS} (TorchNeuron passes --lnc={lnc} from NEURON_LOGICAL_NC_CONFIG "
                f"itself), or plan for LNC={value or 'N'} instead (--instance with --lnc, or the LNC field; on this "
                "machine, the Neuron runtime's setting)")
    return flags


EFA = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}  # Neuron between nodes


def device_env(hardware, compile_cache, cores: list[int] | None, processes: int = 1,
               written: str | None = None, environ: Mapping[str, str] | None = None,
               between_nodes: bool = False) -> dict[str, str]:
    """What a process (or each of `processes` ranks) needs on `hardware`, placed on `cores`
    (None: no core is named, as on a Slurm node). `written`: the cores as the user wrote
    them ("0,1"), kept when they name the same cores. `environ`: the environment the process
    inherits (default: this one's), whose NEURON_CC_FLAGS are kept as given; CompilerFlagsError when
    they set another LNC. `between_nodes`: the processes are on a cluster's nodes and talk over its
    network. Pure but for that: `compile_cache` is the root."""
    env = compile_cache_env(hardware.backend, compile_cache)
    text = written if written and cores is not None and parse_cores(written) == cores else (
        format_cores(cores) if cores else None)
    if hardware.backend == "neuron":
        env["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
        if hardware.lnc:
            env["NEURON_LOGICAL_NC_CONFIG"] = str(hardware.lnc)
            flags = compiler_flags(hardware.lnc, (os.environ if environ is None else environ).get(CC_FLAGS))
            if flags is not None:  # the user's own, as given; unset stays unset
                env[CC_FLAGS] = flags
        if text is not None:
            env[VISIBLE if processes == 1 else RANK_CORES] = text
        if between_nodes:
            env |= EFA
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


def given_cores(backend: str, nproc: int, environ=os.environ) -> list[int]:
    """The cores a cluster node's processes were given in `environ` (a Ray actor's ids, handed on
    as a local run's leased cores are: STUDIO_NEURON_CORES, NEURON_RT_VISIBLE_CORES,
    CUDA_VISIBLE_DEVICES), else the node's first `nproc` (a Slurm node is the job's alone)."""
    named = {"neuron": environ.get(RANK_CORES) or environ.get(VISIBLE),
             "cuda": environ.get("CUDA_VISIBLE_DEVICES")}.get(backend)
    return parse_cores(named) if named else list(range(nproc))


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


def flags_problem(hardware, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the inherited NEURON_CC_FLAGS (`environ`'s, default this process's) cannot be used on
    `hardware`, or None: what the planner and the doctor say before anything starts."""
    if hardware.backend != "neuron" or not hardware.lnc:
        return None
    try:
        compiler_flags(hardware.lnc, (os.environ if environ is None else environ).get(CC_FLAGS))
    except CompilerFlagsError as error:
        return str(error)
    return None
