"""NeuronCores that programs outside the studio use: read from `neuron-ls --json-output`
before cores are chosen, so a start never picks a core another program holds.

The studio's leases (leases.py) only know the studio's own processes. A NeuronCore that any
other process has taken cannot be used by a second process until the first one ends (the
Neuron runtime reserves it: AWS Neuron docs, "Neuron Runtime configuration", NeuronCore
allocation), so a run placed there fails to start its runtime. neuron-ls lists, per Neuron
device, the processes using it.

`neuron-ls --json-output` (-j), as the Neuron LS User Guide documents it
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-sys-tools/neuron-ls.html,
"$ neuron-ls -j" and its Field Definitions), one object per Neuron device:

    [{"neuron_device": 0, "bdf": "cc:00.0", "nc_count": 4, "logical_neuroncore_config": 2,
      "memory_size": 103079215104, "neuroncore_ids": [0, 1, 2, 3],
      "neuron_processes": [{"pid": 113985, "command": "neuron-bench exec ...",
                            "neuron_runtime_version": "2.0.0"}]}, ...]

`neuroncore_ids` are the device's cores in the numbering NEURON_RT_VISIBLE_CORES uses (the
guide says so), which is the studio's core numbering; nc_count counts logical cores (4 on a
Trn2 device at LNC=2). Older versions leave neuroncore_ids out: the ids are then counted from
the devices in order, nc_count each. A process's "command" may be empty.

neuron-ls says which DEVICE a process uses, not which of its cores, so every core of that
device counts as busy; neuron-monitor's per-core view (`neuron_runtime_data[].report.
neuroncore_counters.neuroncores_in_use`, Neuron Monitor User Guide) would be finer, but it is
a stream that must be started and stopped, too slow for a start. A process is the studio's
when it holds a lease or descends from a holder (a run's ranks under its supervisor).

Written from the documentation, not from output captured on hardware. The docs announce that
Neuron 2.34 drops --json-output for `--output-format json`: that is tried when the first is
refused, its output read as the same list; when neither works the studio says neuron-ls failed
(plan warning, doctor) rather than guess.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import psutil

NEURON_LS = "neuron-ls"
TIMEOUT_S = 10
INSTALL = "install aws-neuronx-tools and put /opt/aws/neuron/bin on PATH"
KIND = "outside"  # the "kind" of a core another program uses, beside the leases' run, chat, ...


def parse_neuron_ls(json_text: str) -> list[dict]:
    """The devices in `neuron-ls --json-output`'s text, each {"device", "cores", "processes":
    [{"pid", "command"}]}. ValueError saying what is wrong when the text is not that format."""
    try:
        listed = json.loads(json_text)
    except json.JSONDecodeError as error:
        raise ValueError(f"neuron-ls output is not JSON: {error}") from error
    if not isinstance(listed, list) or not all(isinstance(d, dict) for d in listed):
        raise ValueError("neuron-ls output is not a list of Neuron devices (the --json-output format)")
    devices, first = [], 0
    for entry in sorted(listed, key=lambda d: d["neuron_device"] if isinstance(d.get("neuron_device"), int) else 0):
        try:
            count = int(entry["nc_count"])
            cores = [int(c) for c in entry["neuroncore_ids"]] if "neuroncore_ids" in entry else (
                list(range(first, first + count)))
            processes = [{"pid": int(p["pid"]), "command": str(p.get("command") or "").strip()}
                         for p in entry.get("neuron_processes") or []]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"neuron-ls device entry without usable nc_count, neuroncore_ids or "
                             f"neuron_processes: {error!r}") from error
        devices.append({"device": entry.get("neuron_device"), "cores": cores, "processes": processes})
        first += count
    return devices


def outside(devices: list[dict], studio_pids: set[int]) -> dict[int, dict]:
    """The cores of devices that a process outside `studio_pids` uses: core -> who, as a lease
    names its holder ({"holder", "kind": "outside", "pid"}; leases.describe reads it). The first
    such process of a device names all its cores."""
    busy = {}
    for device in devices:
        other = next((p for p in device["processes"] if p["pid"] not in studio_pids), None)
        if other is None:
            continue
        what = f"a program outside the studio on Neuron device {device['device']}"
        info = {"holder": f"{what} ({other['command']})" if other["command"] else what, "kind": KIND,
                "pid": other["pid"]}
        for core in device["cores"]:
            busy[core] = info
    return busy


# `--json-output` as documented; the docs announce `--output-format json` in its place from
# Neuron 2.34: tried when the first is refused (its output assumed to be the same list).
JSON_OPTIONS = (["--json-output"], ["--output-format", "json"])


def read() -> tuple[list[dict], str | None]:
    """This machine's devices from neuron-ls, or ([], why not) when it is missing or fails."""
    exe = shutil.which(NEURON_LS)
    if exe is None:
        return [], f"{NEURON_LS} is not on PATH ({INSTALL})"
    failures = []
    for option in JSON_OPTIONS:
        said = " ".join([NEURON_LS, *option])
        try:
            done = subprocess.run([exe, *option], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return [], f"{said} gave no answer in {TIMEOUT_S} s"
        except OSError as error:
            return [], f"{NEURON_LS} could not be run: {error}"
        if done.returncode != 0:
            failures.append(f"{said} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-200:]}")
            continue
        try:
            return parse_neuron_ls(done.stdout), None
        except ValueError as error:
            return [], f"{said}: {error}"
    return [], "; ".join(failures)


def family(pids: set[int]) -> set[int]:
    """`pids` and every live descendant of theirs (a run's torchrun and ranks under its supervisor)."""
    found = set(pids)
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # ended meanwhile: its children, if any are left, are not the studio's to vouch for
    return found


def busy_outside(held: dict[int, dict]) -> tuple[dict[int, dict], str | None]:
    """The cores programs outside the studio use on this machine, given what the studio's leases
    hold (leases.holders), and why that could not be read (None when it could)."""
    devices, problem = read()
    if problem or not any(device["processes"] for device in devices):
        return {}, problem
    pids = {info["pid"] for info in held.values() if isinstance(info.get("pid"), int)}
    return outside(devices, family(pids)), None
