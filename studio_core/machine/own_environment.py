"""Giving a running process a new environment that `/proc/PID/environ` shows too.

The kernel's /proc/PID/environ is the memory where execve(2) put the process's environment
strings (between the env_start and env_end addresses of /proc/PID/stat, proc(5)); a later
setenv(3) copies strings elsewhere and does not show there. The studio finds every process of
a run by the STUDIO_RUN_ID in that file (studio_core.machine.procs), and a process started
ahead of its run (studio_core.backends.forking: a fork of a zygote) only learns its run later: so the new environment
is written over the old strings, in place, with a padding variable (ROOM) filling what is left.
It is what the setproctitle library does for /proc/PID/cmdline. The process is started with a
ROOM variable so that the new environment fits (with_room; fits says whether one does).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

ROOM = "STUDIO_ENV_ROOM"
ROOM_BYTES = 4096  # what a process started ahead gets: a run id, a port and a few variables more


def block_size(env: Mapping[str, str]) -> int:
    """The bytes execve(2) gives these variables: each `KEY=VALUE` and its NUL."""
    return sum(len(os.fsencode(f"{key}={value}")) + 1 for key, value in env.items())


def with_room(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the padding variable that leaves ROOM_BYTES for a later, longer environment."""
    return {**env, ROOM: "-" * ROOM_BYTES}


def fits(started_with: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether `env` (with its padding variable, however short) fits where `started_with` was put."""
    return block_size({**env, ROOM: ""}) <= block_size(started_with)


def fits_here(env: Mapping[str, str]) -> bool:
    """Whether replace(env) fits in this process's environment strings."""
    start, end = _area()
    return block_size({**env, ROOM: ""}) <= end - start


def _area() -> tuple[int, int]:
    stat = open("/proc/self/stat", "rb").read()
    fields = stat[stat.rindex(b")") + 2:].split()  # field 3 (state) onwards: the name may hold spaces
    return int(fields[50 - 3]), int(fields[51 - 3])  # env_start, env_end: fields 50 and 51 (Linux 3.5+)


def replace(env: Mapping[str, str]) -> None:
    """Make `env` this process's whole environment: os.environ, the C library's (what native code
    reads with getenv) and the strings /proc/self/environ shows. Raises ValueError if it does not
    fit (fits() says so beforehand) and changes nothing then."""
    start, end = _area()
    data = b"".join(os.fsencode(f"{key}={value}") + b"\0" for key, value in env.items() if key != ROOM)
    pad = end - start - len(data) - len(ROOM) - 2  # "ROOM=" ... "\0"
    if pad < 0:
        raise ValueError(f"the new environment needs {len(data) + len(ROOM) + 2} bytes; the process has {end - start}")
    # first the C library lets go of the old strings (unsetenv drops its pointers to them), so no
    # getenv reads them while, or after, they are overwritten; then each variable is set anew (a copy)
    os.environ.clear()
    ctypes.memmove(start, data + os.fsencode(f"{ROOM}=") + b"-" * pad + b"\0", end - start)
    os.environ.update({key: value for key, value in env.items() if key != ROOM})
