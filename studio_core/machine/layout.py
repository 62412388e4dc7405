"""Process layouts: which NeuronCores a run uses and how TP x FSDP splits its processes.

Pure functions over plain data (a `Hardware`, lists of ints, a model's config.json as a
dict), so every rule here is checked on a machine without Trainium.

    cores = parse_cores("0-3")                      # studio_core.machine.cores: NEURON_RT_VISIBLE_CORES syntax
    problems = check_layout(4, 1, 1, cores, instance_hardware("trn2.3xlarge"), None)
    block = pick_cores(4, free={0, 1, 2, 3}, hardware=...)   # "next free": [0, 1, 2, 3]

Which core sets work. The Neuron runtime wants a contiguous, increasing set, and TRL's
Trainium guide adds that on a trn2.3xlarge only `0,1`, `2,3` and `0-3` set up collectives
(`1,2` fails). The rule the studio takes from that: a multi-core set has a power-of-two
size and starts on a multiple of its size, so half a trn2.48xlarge is 0-31 or 32-63, not
16-47. Beyond the TRL guide's three sets this rule is not measured here, and
Trn3 gets the same rule.

Ranks and cores: torchrun's ranks take the visible cores in order, and Transformers puts
TP innermost in its mesh (see `tp_groups`), so each TP group is a run of consecutive cores.
"""

from __future__ import annotations

import math

from studio_core.machine.cores import format_cores, parse_cores
from studio_core.machine.hardware import MAX_DEVICES_PER_PROCESS, Hardware

def _show(cores: list[int]) -> str:
    """Two cores as TRL's guide writes them ("0,1"), more as ranges; out of order as written."""
    plain = len(cores) == 2 or cores != sorted(cores)
    return ",".join(map(str, cores)) if plain else format_cores(cores)


def _blocks_near(size: int, start: int, hardware: Hardware) -> list[str]:
    """Valid sets of `size` cores around `start` (else the first ones), to suggest instead."""
    step = size
    base = max(0, start) // step * step
    near = [s for s in (base, base + step) if s + size <= hardware.devices]
    near = near or [s for s in range(0, hardware.devices - size + 1, step)][:2]
    return [_show(list(range(s, s + size))) for s in near]


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_core_set(cores: list[int], hardware: Hardware) -> list[str]:
    """Why this set of cores cannot run one job's collectives, each saying what to use instead."""
    if not cores:
        return ["no cores given: name at least one core, e.g. 0"]
    shown = _show(cores)
    problems = []
    outside = [c for c in cores if not 0 <= c < hardware.devices]
    if outside:
        problems.append(f"core{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside))} "
                        f"not on {hardware.describe()}: use cores 0-{hardware.devices - 1}")
    if len(set(cores)) != len(cores):
        return problems + [f"{shown} lists a core twice: list each core once"]
    size, start = len(cores), min(cores)
    if size == 1:
        return problems
    if cores != sorted(cores):
        return problems + [f"{shown} is not in increasing order: write {format_cores(sorted(cores))}"]
    if cores[-1] - cores[0] + 1 != size:
        fix = _blocks_near(size, start, hardware) if _is_power_of_two(size) else []
        hint = f": use {' or '.join(fix)}" if fix else ": name a range without gaps, e.g. 0-3"
        return problems + [f"{shown} is not contiguous{hint}"]
    if not _is_power_of_two(size):
        lower, upper = 1 << (size.bit_length() - 1), 1 << size.bit_length()
        options = [f"{n} cores ({' or '.join(_blocks_near(n, start, hardware))})"
                   for n in (lower, upper) if n <= hardware.devices]
        return problems + [f"{shown} is {size} cores: a multi-core set must be 2, 4, 8, ... cores "
                           f"(collectives fail otherwise); use {' or '.join(options)}"]
    if start % size:
        fix = _blocks_near(size, start, hardware)
        return problems + [f"{shown} is not aligned (it must start at a multiple of {size}): use {' or '.join(fix)}"]
    return problems


def _heads(model_config: dict) -> tuple[int | None, int | None]:
    """(attention heads, key/value heads) from a config.json, looking into text_config too."""
    for config in (model_config, model_config.get("text_config") or {}):
        heads = config.get("num_attention_heads")
        if isinstance(heads, int):
            kv = config.get("num_key_value_heads")
            return heads, kv if isinstance(kv, int) else heads
    return None, None


def _not_whole(nproc, tp_size, fsdp_size) -> list[str]:
    sizes = {"nproc": nproc, "tp_size": tp_size, "fsdp_size": fsdp_size}
    return [f"studio.{name}: got {value!r}; use a whole number of at least 1" for name, value in sizes.items()
            if not isinstance(value, int) or isinstance(value, bool) or value < 1]


def check_sizes(nproc: int, tp_size: int, fsdp_size: int) -> list[str]:
    """The rules on the sizes alone, whatever the hardware: whole numbers, TP x FSDP = processes."""
    bad = _not_whole(nproc, tp_size, fsdp_size)
    if bad:
        return bad
    if (tp_size > 1 or fsdp_size > 1) and tp_size * fsdp_size != nproc:
        return [f"studio.tp_size x studio.fsdp_size = {tp_size} x {fsdp_size} = {tp_size * fsdp_size} "
                f"must equal studio.nproc = {nproc}: change one of them"]
    return []


def check_layout(nproc: int, tp_size: int, fsdp_size: int, cores: list[int] | str | None,
                 hardware: Hardware, model_config: dict | None = None) -> list[str]:
    """Every reason this process layout cannot run on `hardware`, each saying what to change.
    `model_config` is the model's config.json as a dict (the caller reads it), or None."""
    bad = _not_whole(nproc, tp_size, fsdp_size)
    if bad:
        return bad  # nothing else can be checked
    problems = check_sizes(nproc, tp_size, fsdp_size)
    parallel = tp_size > 1 or fsdp_size > 1
    if hardware.backend == "cpu":
        if parallel:
            problems.append("studio.tp_size / studio.fsdp_size: tensor and FSDP parallelism are not supported "
                            "on the CPU backend: use data parallel (tp_size 1, fsdp_size 1)")
        if nproc > hardware.cpu_count:
            problems.append(f"studio.nproc: {nproc} processes but this machine has {hardware.cpu_count} "
                            f"CPU cores: use at most {hardware.cpu_count}")
    elif nproc > hardware.devices:
        unit = "NeuronCores" if hardware.backend == "neuron" else "CUDA devices"
        problems.append(f"studio.nproc: {nproc} processes but {hardware.describe()} has {hardware.devices} "
                        f"{unit}: use at most {hardware.devices}")
    if hardware.backend == "neuron" and hardware.devices > MAX_DEVICES_PER_PROCESS:
        # per process: a rank sees its one core, but a process that names none sees them all
        problems.append(f"{hardware.devices} NeuronCores at LNC={hardware.lnc}: a process that names no core sees "
                        f"them all, and TorchNeuron allows {MAX_DEVICES_PER_PROCESS} devices per process: use LNC=2 "
                        "(NEURON_LOGICAL_NC_CONFIG=2)")
    if isinstance(cores, str):
        try:
            cores = parse_cores(cores)
        except ValueError as error:
            return problems + [f"studio.cores: {error}"]
    if cores is not None and hardware.backend != "neuron":
        count = hardware.cores
        if len(cores) != nproc:
            problems.append(f"studio.cores: {_show(cores)} is {len(cores)} core(s) but studio.nproc is {nproc} "
                            "(one process per core): make them match")
        if any(c >= count for c in cores):
            problems.append(f"studio.cores: {_show(cores)} goes past the {count} {hardware.backend} cores "
                            f"(0-{count - 1}): choose cores below {count}")
    elif cores is not None:
        if len(cores) != nproc:
            problems.append(f"studio.cores: {_show(cores)} is {len(cores)} core(s) but studio.nproc is {nproc} "
                            "(one process per core): make them match")
        problems += [f"studio.cores: {message}" for message in check_core_set(cores, hardware)]
    elif hardware.backend == "neuron" and nproc > 1 and not _is_power_of_two(nproc):
        problems.append(f"studio.nproc: {nproc} NeuronCores cannot run collectives together; use 2, 4, 8, ... "
                        "processes")
    if model_config and tp_size > 1:
        heads, kv_heads = _heads(model_config)
        for count, what in ((heads, "attention heads"), (kv_heads, "key/value heads")):
            if count is not None and count % tp_size:
                both = math.gcd(heads, kv_heads)  # each rank must hold whole heads of both kinds
                fits = [n for n in range(1, both + 1) if both % n == 0]
                problems.append(f"studio.tp_size: {tp_size} does not divide the model's {count} {what} "
                                f"({heads} attention, {kv_heads} key/value): use {', '.join(map(str, fits))}")
                break
    return problems


def pick_cores(nproc: int, free: set[int], hardware: Hardware) -> list[int] | None:
    """The lowest valid block of `nproc` cores that are all free ("next free"), or None."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    count = hardware.cores
    for start in range(0, count - nproc + 1):
        block = list(range(start, start + nproc))
        # CPU cores and CUDA devices need no alignment; NeuronCores do (check_core_set)
        if free.issuperset(block) and (hardware.backend != "neuron" or not check_core_set(block, hardware)):
            return block
    return None


def mesh_sizes(tp_size: int, fsdp_size: int, world_size: int) -> dict[str, int]:
    """DistributedConfig's sizes for a run of `world_size` processes: one TP x FSDP mesh per
    node, and on several nodes (the exported Slurm script) each node is one replica
    (dp_replicate_size = nodes: HSDP, FSDP inside a node, gradients averaged across nodes)."""
    per_node = tp_size * fsdp_size
    if world_size % per_node:
        raise ValueError(f"{world_size} processes cannot hold whole TP {tp_size} x FSDP {fsdp_size} meshes: run "
                         f"a multiple of {per_node} processes")
    return {"tp_size": tp_size, "fsdp_size": fsdp_size, "dp_replicate_size": world_size // per_node}


def tp_groups(nproc: int, tp_size: int) -> list[list[int]]:
    """The ranks of each tensor-parallel group, as Transformers groups them.

    transformers 5.24 (distributed/utils.py, initialize_distributed_mesh) builds its dense
    mesh with torch.distributed.init_device_mesh(device, (pp, dp_replicate, fsdp, tp)),
    row-major with "tp" last, so a TP group is tp_size consecutive ranks: with 32 processes
    and TP 4, ranks 0-3, 4-7, ... and FSDP shards across the 8 groups."""
    if tp_size < 1 or nproc % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide {nproc} processes")
    return [list(range(first, first + tp_size)) for first in range(0, nproc, tp_size)]
