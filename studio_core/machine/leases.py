"""Core leases: which process uses which accelerator core, held by OS file locks.

One lock file per core, `<runs_dir>/.leases/<backend>-core-<n>.lock`, locked with
flock(LOCK_EX) by the process that uses the core (a run's supervisor, a chat process).
The OS drops the lock when that process dies, however it dies, so a crash never leaves
a core held, and a file whose lock can be taken is free whatever its stale text says.
After locking, the holder writes who it is (JSON: holder, kind, pid, time) into the
file, so that a refusal and the core map can name it.

    with acquire(runs_dir, "neuron", [0, 1], holder=run_id, kind="run"):
        ...  # cores 0 and 1 are ours until the block ends or this process dies

Children do not inherit the lock unless asked: the descriptors are close-on-exec, and an
flock belongs to the open file, shared by every inherited copy, released only when the
last copy is closed. The run's supervisor hands copies to torchrun on purpose
(`descriptors()`, Popen's pass_fds): if the supervisor is SIGKILLed, the cores stay held
until torchrun, which ends its ranks first, has ended too. A plain os.fork() without exec
(multiprocessing's "fork") shares the lock as well.
Lock files are never deleted: unlinking a file another process has open and locked
would let a third process lock a new file of the same name while the first still runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

from studio_core.machine.cores import parse_cores
from studio_core.machine.hardware import DEVICES
from studio_core.machine.layout import pick_cores

KINDS = ("run", "chat", "eval", "export", "doctor", "precompile")
# A probe (holders) holds a shared lock for microseconds; acquire retries this long
# so a probe from the UI never makes a start fail.
PROBE_RETRY_S = 0.2


class CoresBusy(ValueError):
    """Some requested cores are held by another process; `busy` maps core -> holder info."""

    def __init__(self, backend: str, busy: dict[int, dict]):
        self.backend, self.busy = backend, busy
        named = "; ".join(f"core {core} is held by {describe(info)}" for core, info in sorted(busy.items()))
        super().__init__(f"{backend} cores busy: {named}. Pick other cores (the core map shows "
                         "which are free), or stop the run or chat that holds them first.")


class CoreLease:
    """Open, locked lock files, one per core; the cores are held until release() or exit."""

    def __init__(self, backend: str, holder: str, kind: str, fds: dict[int, int]):
        self.backend, self.holder, self.kind = backend, holder, kind
        self.fds = fds  # core -> open file descriptor carrying the lock

    @property
    def cores(self) -> list[int]:
        return sorted(self.fds)

    def descriptors(self) -> tuple[int, ...]:
        """The open lock files, for a child that is to hold the cores as long as it lives."""
        return tuple(self.fds.values())

    def release(self) -> None:
        """Unlock and close every core's file; safe to call twice."""
        while self.fds:
            _, fd = self.fds.popitem()
            os.ftruncate(fd, 0)  # so the file no longer names a holder that has let go
            os.close(fd)  # closing the last descriptor of the open file drops the flock

    def __enter__(self) -> CoreLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path(runs_dir: str | Path, backend: str, core: int) -> Path:
    return Path(runs_dir).expanduser() / ".leases" / f"{backend}-core-{core}.lock"


def acquire(runs_dir: str | Path, backend: str, cores: list[int], holder: str, kind: str) -> CoreLease:
    """Take every one of `cores` for `holder`, or none of them (raises CoresBusy)."""
    _check(backend, cores, kind)
    lock_path(runs_dir, backend, 0).parent.mkdir(parents=True, exist_ok=True)
    lease, busy = CoreLease(backend, holder, kind, {}), {}
    identity = json.dumps({"holder": holder, "kind": kind, "pid": os.getpid(), "time": time.time()})
    try:
        for core in sorted(set(cores)):
            fd = os.open(lock_path(runs_dir, backend, core), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if _try_lock(fd, fcntl.LOCK_EX, PROBE_RETRY_S):
                lease.fds[core] = fd
                os.ftruncate(fd, 0)
                os.pwrite(fd, identity.encode(), 0)
            else:
                busy[core] = _read_identity(fd)
                os.close(fd)
        if busy:
            raise CoresBusy(backend, busy)
    except BaseException:  # busy, or an OS error midway: all or none, give back what we took
        lease.release()
        raise
    return lease


@contextlib.contextmanager
def choosing(runs_dir: str | Path):
    """Held (machine-wide, per runs folder) while a process picks free cores and starts the
    process that will hold them, until that one holds them: two starts in the same moment
    never pick the same cores. Only choosers take it; acquire() does not."""
    path = Path(runs_dir).expanduser() / ".leases" / "choosing.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class NoFreeCores(ValueError):
    """No valid block of `wanted` free cores is left; `holding` names who holds the others."""

    def __init__(self, count: int, held: dict[int, dict], wanted: int = 1):
        self.count, self.held, self.wanted = count, held, wanted
        self.holding = "; ".join(sorted({describe(info) for info in held.values()}))
        if wanted > count:  # no wait frees enough: the machine is too small
            super().__init__(f"the machine has {count} cores and {wanted} are asked for: ask for at most {count}")
        elif not held:
            super().__init__(f"no {wanted} of the {count} cores make a valid core set")
        else:
            super().__init__(f"{len(held)} of {count} are held ({self.holding})")


class NamedCoresHeld(ValueError):
    """Cores asked for by name are held by others; the message names who holds them."""


def choose(runs_dir: str | Path, hardware, nproc: int, cores: str | None) -> list[int]:
    """The cores a run or chat will hold: `cores` if all are free (NamedCoresHeld naming the
    holders if not; ValueError if there is no such core), else the first free valid block of
    `nproc` (NoFreeCores if none).
    Call it inside choosing(), so no other start takes them before their holder does."""
    count = hardware.cores
    held = holders(runs_dir, hardware.backend, count)
    if cores is not None:
        wanted = parse_cores(cores)
        beyond = [c for c in wanted if c >= count]
        if beyond:
            raise ValueError(f"this machine has {hardware.backend} cores 0-{count - 1}; there is no core "
                             f"{', '.join(map(str, beyond))}: name cores from that range")
        busy = [f"core {c} is held by {describe(held[c])}" for c in wanted if c in held]
        if busy:
            raise NamedCoresHeld(f"{'; '.join(busy)}: choose free cores, or stop what holds them first")
        return wanted
    block = pick_cores(nproc, set(range(count)) - set(held), hardware)
    if block is None:
        raise NoFreeCores(count, held, nproc)
    return block


def has_free(runs_dir: str | Path, hardware, nproc: int = 1) -> bool:
    """Whether `nproc` cores that a run or an evaluation could take are free now."""
    held = holders(runs_dir, hardware.backend, hardware.cores)
    return pick_cores(nproc, set(range(hardware.cores)) - set(held), hardware) is not None


def wait_held(runs_dir: str | Path, backend: str, cores: list[int], proc, timeout: float = 30) -> bool:
    """Wait until the child process `proc` (a Popen) holds all of `cores`; False if it ends
    first or does not hold them within `timeout`."""
    deadline, pid = time.monotonic() + timeout, proc.pid
    while time.monotonic() < deadline and proc.poll() is None:
        held = holders(runs_dir, backend, max(cores) + 1)
        if all(held.get(core, {}).get("pid") == pid for core in cores):
            return True
        time.sleep(0.05)
    return False


def holders(runs_dir: str | Path, backend: str, count: int) -> dict[int, dict]:
    """The cores among 0..count-1 held now, each with what its holder wrote about itself.

    The info is {"holder", "kind", "pid", "time"}, or {"holder": None} when the holder
    has locked but not yet written (or its text cannot be read).
    """
    _check(backend, None, "run")
    held = {}
    for core in range(count):
        try:
            fd = os.open(lock_path(runs_dir, backend, core), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # never leased since the folder was made: free
        try:
            if _try_lock(fd, fcntl.LOCK_SH, 0):  # shared, so two probes never refuse each other
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                held[core] = _read_identity(fd)
        finally:
            os.close(fd)
    return held


def free_cores(runs_dir: str | Path, backend: str, count: int) -> set[int]:
    """The cores among 0..count-1 that no live process holds."""
    return set(range(count)) - set(holders(runs_dir, backend, count))


def _try_lock(fd: int, operation: int, retry_s: float) -> bool:
    deadline = time.monotonic() + retry_s
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _read_identity(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"holder": None}  # locked a moment ago, identity not written yet
    return info if isinstance(info, dict) else {"holder": None}


def describe(info: dict) -> str:
    """Who holds a core, for messages: "run <id> (pid 123)"."""
    if not info.get("holder"):
        return "another process (it has not said who it is yet)"
    kind, holder = info.get("kind") or "", info["holder"]
    name = holder if holder.startswith((f"{kind}-", f"{kind} ")) else f"{kind} {holder}".strip()
    return f"{name} (pid {info['pid']})" if info.get("pid") else name


def _check(backend: str, cores: list[int] | None, kind: str) -> None:
    if backend not in DEVICES:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(DEVICES)}")
    if kind not in KINDS:
        raise ValueError(f"unknown lease kind {kind!r}: use one of {', '.join(KINDS)}")
    if cores is not None and not cores:
        raise ValueError("ask for at least one core")
    bad = [c for c in cores or [] if not isinstance(c, int) or isinstance(c, bool) or c < 0]
    if bad:
        raise ValueError(f"core numbers must be whole numbers from 0 up, got {bad}")
