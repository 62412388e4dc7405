"""Precompile: the run's batch shapes compiled before step 1, in parallel processes.

On Trainium a run with eight batch shapes compiles eight graphs one after another, minutes
each, at the steps where each shape first appears, while the host's CPU cores sit idle. With
`studio.precompile: true` (the page's "Precompile", `launch.py train --precompile --jobs N`)
the run's supervisor first starts N precompile jobs (studio_core/training/precompile_worker.py). Each
builds the run's own trainer (studio_core/training/trainer_setup.py: the same model, LoRA, compile
settings and data order), finds the first batch of every distinct shape the run will take
(the same walk over the run's data loader that the shape forecast makes), and trains one
step on each of its share of them (every Nth shape): a forward and a backward, which compile
them into the compile cache the run uses. Then the run starts, and a shape's first step finds
its graphs in the cache: its compile_end events say `hit`.

What is cached, per backend (studio_core/machine/compile_cache.py has the folders):
- CPU and CUDA, Inductor: its FX graph cache and AOTAutograd cache, under
  TORCHINDUCTOR_CACHE_DIR. Dynamo still traces each new shape in the run (its bytecode
  analysis is not cached across processes): seconds on the tiny model, against the tens of
  seconds Inductor's code generation and C++ compile cost.
- Neuron: TorchNeuron's NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR), which its documentation
  says is safe for concurrent processes; each job holds a NeuronCore, as a graph is compiled
  at its first run on the device. Written from the documentation, not run on a Trainium
  machine here.

Where the jobs run: on the run's own cores plus the free cores of this machine (CPU cores on
the CPU backend, NeuronCores on Neuron), leased for the precompile's length (kind
"precompile"); one job per core. Unless the spec names a number, the planner picks one job per
core, at most 8, and on Neuron no more than the host's vCPUs and memory hold (neuronx-cc runs on
the host: `default_jobs`, which says which limit set the number); a number above those is warned
of in the plan. A job that fails costs nothing but its time: the run compiles that job's shapes
at their first step, as without precompile.

Limits: one-process runs only (with data parallelism the training step's graphs are split at
DDP's gradient buckets, so a one-process job compiles different graphs); not for GRPO and
RLOO, whose shapes come from what the model generates; local runs only.
"""

from __future__ import annotations

import math

from studio_core.machine.device_env import RANK_CORES, VISIBLE

WORKER_MODULE = "studio_core.training.precompile_worker"
MAX_BATCHES = 20_000  # walk at most this many batches for shapes (the forecast's cap)


def problems(spec, trainer, args: dict) -> list[str]:
    """Why this run cannot be precompiled (empty: it can). `args`: the planned TRL arguments."""
    if not spec.precompile:
        return []
    found = []
    if not args.get("torch_compile"):
        found.append("studio.precompile: nothing compiles without torch_compile: true; set it (on Neuron the "
                     "studio turns it on) or turn precompile off")
    if not trainer.forecast:
        found.append(f"studio.precompile: {trainer.name} runs are not precompiled: {trainer.not_forecast}")
    if spec.layout.nproc > 1 or spec.layout.nodes > 1:
        found.append(f"studio.precompile: one-process runs only (this one has {spec.layout.nproc * spec.layout.nodes}): "
                     "with data parallelism the training step's graphs are split at DDP's gradient buckets, so a "
                     "one-process precompile job would compile other graphs; set nproc 1 or turn precompile off")
    if spec.layout.run_on != "local":
        found.append("studio.precompile: local runs only for now (studio.run_on: local)")
    return found


MAX_DEFAULT_JOBS = 8
# What one Neuron precompile job takes from the host while neuronx-cc compiles its graphs.
# ASSUMPTIONS: no AWS page read gives a figure per compile. A job is a whole training process
# (torch, Transformers, the model in host memory: a few GiB for a sub-1B model) that hands each
# graph to neuronx-cc, which runs on the host CPUs in several threads and is killed when host
# memory runs out (its F137 error, "neuronx-cc was forcibly killed ... insufficient system
# memory", reported on a trn2.3xlarge compiling a small ViT). So: 4 vCPUs (one for the Python
# process, three for the compiler's threads) and 16 GiB of host memory per job. A trn2.3xlarge
# (12 vCPUs, 128 GiB, 4 NeuronCores at LNC=2) then runs 3 jobs, not 4.
# On CPU and CUDA these caps do not apply: there a CPU job is pinned to one CPU core of its own
# (the free cores already count the CPUs), and Inductor's compile of a CUDA graph is light.
NEURON_JOB_VCPUS = 4
NEURON_JOB_HOST_GIB = 16


def host_limits(hardware) -> list[tuple[int, str]]:
    """The host's bounds on parallel precompile jobs (on Neuron: its vCPUs and its memory, where
    known), each with what sets it."""
    where = hardware.instance_type or "this machine"
    limits = []
    if hardware.backend == "neuron" and hardware.vcpus:
        limits.append((hardware.vcpus // NEURON_JOB_VCPUS, f"{where} has {hardware.vcpus} vCPUs, "
                       f"~{NEURON_JOB_VCPUS} per compile job (the compiler runs on the host's CPUs)"))
    if hardware.backend == "neuron" and hardware.host_memory_gib:
        limits.append((int(hardware.host_memory_gib // NEURON_JOB_HOST_GIB), f"{where} has "
                       f"{hardware.host_memory_gib:g} GiB of host memory, ~{NEURON_JOB_HOST_GIB} GiB per compile job"))
    return limits


def default_jobs(hardware) -> tuple[int, str]:
    """Jobs when the spec names none, and why: one per core the precompile can have (the run's
    and the free ones, which the supervisor leases at the start), within the host's vCPUs and
    memory on Neuron, at most 8; at least 1."""
    unit = "CPU cores" if hardware.backend == "cpu" else "NeuronCores" if hardware.backend == "neuron" else "devices"
    where = hardware.instance_type or "this machine"
    limits = [(hardware.cores, f"one precompile job per core, and {where} has {hardware.cores} {unit}"),
              (MAX_DEFAULT_JOBS, f"at most {MAX_DEFAULT_JOBS} by default"), *host_limits(hardware)]
    count, why = min(limits, key=lambda limit: limit[0])
    count = max(1, count)
    return count, f"{count} precompile job{'s' if count > 1 else ''}: {why}; a core busy at the start is skipped"


def jobs_warning(hardware, jobs: int) -> str | None:
    """A warning when the spec's own precompile_jobs is above what the host's vCPUs or memory
    hold (not refused: the user may know the graphs are small)."""
    host = [(count, why) for count, why in host_limits(hardware) if jobs > max(1, count)]
    if not host:
        return None
    count, why = min(host, key=lambda limit: limit[0])
    return (f"studio.precompile_jobs: {jobs} parallel compile jobs, but {why}: {max(1, count)} fit; more may run "
            "the host out of memory (neuronx-cc is then killed) or slow every job; set it lower, or leave it "
            "unset and the studio picks")


def job_environment(backend: str, env: dict[str, str], core: int, port: int) -> dict[str, str]:
    """A precompile job's environment: the run's, on one core of its own, as torchrun would give
    its one rank (a process group of one, on its own rendezvous `port`), since the run's config
    (its ddp_backend) expects one."""
    env = {k: v for k, v in env.items() if k != RANK_CORES}
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}
    if backend == "neuron":
        env[VISIBLE] = str(core)
    elif backend == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(core)
    elif backend == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # the job is pinned to one CPU (the supervisor does it)
    return env


def signature(batch: dict) -> tuple:
    """What makes a batch compile graphs of its own: its tensors' names and shapes."""
    return tuple(sorted((key, tuple(value.shape)) for key, value in batch.items() if hasattr(value, "shape")))


def first_batch_of_each_shape(trainer) -> list[dict]:
    """The first batch of each distinct shape the run takes, in the order it meets them: the
    run's own data loader (sampler, seed, collator), pass after pass as the run reads it, up to
    the batches the run takes (at most MAX_BATCHES). A loader that yields nothing (a dataset
    smaller than one batch under drop_last) has no shape to precompile."""
    args = trainer.args
    loader = trainer.get_train_dataloader()
    wanted = args.max_steps * args.gradient_accumulation_steps if args.max_steps > 0 else math.ceil(
        args.num_train_epochs * max(1, len(loader)))
    wanted = min(wanted, MAX_BATCHES)
    first: dict[tuple, dict] = {}
    read = 0
    while read < wanted:
        before = read
        for batch in loader:
            first.setdefault(signature(batch), batch)
            read += 1
            if read >= wanted:
                break
        if read == before:  # a pass with no batch: the next would have none either
            break
    return list(first.values())


def shape_of(batch: dict) -> list[int]:
    """The batch shape the page shows (input_ids', else the first tensor's)."""
    ids = batch.get("input_ids")
    tensor = ids if ids is not None else next(v for v in batch.values() if hasattr(v, "shape"))
    return list(tensor.shape)


def describe(state: dict | None) -> str | None:
    """One line on a run's precompile, from RunState.precompile."""
    if not state:
        return None
    done, total = len(state["done"]), state["total"]
    if total is None:  # the first job has not yet said how many shapes there are
        return f"precompile: {done} shape(s) compiled, finding the run's batch shapes"
    seconds = [d["seconds"] for d in state["done"]]
    each = f", {min(seconds):.1f}-{max(seconds):.1f} s each" if seconds else ""
    hits = sum(d.get("cache") == "hit" for d in state["done"])
    unknown = sum(d.get("cache") == "unknown" for d in state["done"])  # a 0 ms NEFF record alone proves no hit
    cached = (f", {hits} already in the cache" if hits else "") + (
        f", {unknown} not known to have been in the cache or compiled" if unknown else "")
    if state.get("seconds") is None:
        return f"precompile: {done}/{total} shapes compiled in {state['jobs']} parallel job(s){each}{cached}"
    failed = f"; {len(state['failed'])} job(s) failed (their shapes compile at their first step)" \
        if state["failed"] else ""
    return (f"precompile: {done}/{total} shapes compiled in {state['seconds']:.1f} s by {state['jobs']} parallel "
            f"job(s){each}{cached}{failed}")
