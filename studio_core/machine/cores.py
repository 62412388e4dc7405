"""Core sets written as NEURON_RT_VISIBLE_CORES writes them: "0-3", "0,1", "0-1,2-3".

The one syntax for naming cores everywhere in the studio (recipes, the form, the CLI,
STUDIO_CPU_CORES), whatever the backend: NeuronCores, CUDA devices or CPU cores. Once
chosen, cores travel as lists of ints; text is only for people and files.
"""

from __future__ import annotations

import re

_PART = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES syntax ("0-3", "0,1", "0-1,2-3") -> the cores, in written order."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"no cores given ({text!r}): write a range like 0-3 or a list like 0,1")
    cores: list[int] = []
    for part in text.split(","):
        match = _PART.match(part.strip())
        if not match:
            raise ValueError(f"{part.strip()!r} in {text!r} is not a core number or a range: "
                             "write e.g. 0-3, 0,1 or 0-1,2-3")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise ValueError(f"{part.strip()} is a reversed range: write {last}-{first}")
        for core in range(first, last + 1):
            if core in cores:
                raise ValueError(f"core {core} appears twice in {text!r}: list each core once")
            cores.append(core)
    return cores


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3", [2] -> "2", [0, 1, 4] -> "0-1,4" (runs kept in the given order)."""
    if not cores:
        raise ValueError("no cores to format")
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
