"""Core leases: which process uses which accelerator core, held by OS file locks.

One lock file per core, `<lease folder>/<backend>-core-<n>.lock`, locked with
flock(LOCK_EX) by the process that uses the core (a run's supervisor, a chat process).
The lease folder is this machine's, whatever the runs folder: two studios on one machine, or
a CLI run with another --runs-dir, never take the same cores. It is `$STUDIO_LEASES_DIR`,
else `<studio cache>/leases/<host name>` (per user, writable without root; the host name
keeps the nodes of a cluster that share a home folder apart). A relative STUDIO_LEASES_DIR
is taken inside each runs folder: `.leases` gives every runs folder leases of its own, as
before (the tests do this, so that each test's runs folder is a machine of its own).

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

Before, the leases lived in each runs folder, `<runs_dir>/.leases/`. A process of an older
studio may still hold its cores there: where that folder exists (and is not the lease folder
itself), every lease is also taken there, after this machine's, and a core held there counts
as held, so an older studio's run and a newer one never share a core while both live.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from studio_core.machine import outside_use
from studio_core.machine.cache import cache_dir
from studio_core.machine.cores import parse_cores
from studio_core.machine.hardware import DEVICES
from studio_core.machine.layout import pick_cores

KINDS = ("run", "chat", "serve", "eval", "export", "doctor", "precompile")  # serve: a vLLM server
LEASES_ENV = "STUDIO_LEASES_DIR"
OLD_FOLDER = ".leases"  # where a runs folder kept its leases before they were machine-wide
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


class LeaseFolderError(ValueError):
    """The lease folder cannot be made or written; the message says what to set instead."""


class CoreLease:
    """Open, locked lock files, one per core; the cores are held until release() or exit."""

    def __init__(self, backend: str, holder: str, kind: str, fds: dict[int, int]):
        self.backend, self.holder, self.kind = backend, holder, kind
        self.fds = fds  # core -> open file descriptor carrying the lock
        self.old_fds: list[int] = []  # the same cores' locks in the runs folder's old lease folder

    @property
    def cores(self) -> list[int]:
        return sorted(self.fds)

    def descriptors(self) -> tuple[int, ...]:
        """The open lock files, for a child that is to hold the cores as long as it lives."""
        return (*self.fds.values(), *self.old_fds)

    def release(self) -> None:
        """Unlock and close every core's file; safe to call twice."""
        while self.fds or self.old_fds:
            fd = self.fds.popitem()[1] if self.fds else self.old_fds.pop()
            os.ftruncate(fd, 0)  # so the file no longer names a holder that has let go
            os.close(fd)  # closing the last descriptor of the open file drops the flock

    def __enter__(self) -> CoreLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def leases_dir(runs_dir: str | Path) -> Path:
    """This machine's lease folder: $STUDIO_LEASES_DIR (a relative one inside `runs_dir`), else
    <studio cache>/leases/<host name>."""
    configured = os.environ.get(LEASES_ENV, "").strip()
    if not configured:
        return cache_dir() / "leases" / (socket.gethostname() or "localhost")
    folder = Path(configured).expanduser()
    return folder if folder.is_absolute() else Path(runs_dir).expanduser() / folder


def _old_dir(runs_dir: str | Path) -> Path | None:
    """The runs folder's lease folder of before, when it exists and is not the lease folder
    itself: an older studio's process may hold cores there."""
    old = Path(runs_dir).expanduser() / OLD_FOLDER
    if not old.is_dir() or old.resolve() == leases_dir(runs_dir).resolve():
        return None
    return old


def _folders(runs_dir: str | Path) -> list[Path]:
    """Where a core's lock is looked for: the lease folder, then the runs folder's old one."""
    old = _old_dir(runs_dir)
    return [leases_dir(runs_dir)] + ([old] if old else [])


def made_dir(runs_dir: str | Path) -> Path:
    """This machine's lease folder (leases_dir), made if missing; LeaseFolderError saying what to
    change when it cannot be."""
    folder = leases_dir(runs_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LeaseFolderError(_unmade(folder, error)) from None
    return folder


def _unmade(folder: Path, error: OSError) -> str:
    """Why the lease folder `folder` cannot be made, and what to change."""
    fix = f"set {LEASES_ENV} to a folder you can write to"
    blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # a file where the folder (or one above it) should be
        return (f"the core lease folder {folder} cannot be made: {blocking} is a file, not a folder: move it "
                f"away, or {fix}")
    return f"the core lease folder {folder} cannot be made ({error.strerror or error}): {fix}"


def lock_path(runs_dir: str | Path, backend: str, core: int) -> Path:
    return leases_dir(runs_dir) / f"{backend}-core-{core}.lock"


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise LeaseFolderError(f"cannot open the core lease {path} ({error.strerror or error}): set "
                               f"{LEASES_ENV} to a folder you can write to") from None


def acquire(runs_dir: str | Path, backend: str, cores: list[int], holder: str, kind: str) -> CoreLease:
    """Take every one of `cores` for `holder`, or none of them (raises CoresBusy)."""
    _check(backend, cores, kind)
    made_dir(runs_dir)
    folders = _folders(runs_dir)
    lease, busy = CoreLease(backend, holder, kind, {}), {}
    identity = json.dumps({"holder": holder, "kind": kind, "pid": os.getpid(), "time": time.time()}).encode()
    try:
        for core in sorted(set(cores)):
            for i, folder in enumerate(folders):  # the lease folder first, always in this order
                fd = _open(folder / f"{backend}-core-{core}.lock")
                if not _try_lock(fd, fcntl.LOCK_EX, PROBE_RETRY_S):
                    busy[core] = _read_identity(fd)
                    os.close(fd)
                    break
                if i == 0:
                    lease.fds[core] = fd
                else:
                    lease.old_fds.append(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, identity, 0)
        if busy:
            raise CoresBusy(backend, busy)
    except BaseException:  # busy, or an OS error midway: all or none, give back what we took
        lease.release()
        raise
    return lease


@contextlib.contextmanager
def choosing(runs_dir: str | Path):
    """Held (machine-wide) while a process picks free cores and starts the process that will
    hold them, until that one holds them: two starts in the same moment never pick the same
    cores. Only choosers take it; acquire() does not. Where the runs folder has its old lease
    folder, its chooser lock is taken too (after this machine's), as an older studio takes it."""
    made_dir(runs_dir)
    fds = []
    try:
        for folder in _folders(runs_dir):  # this machine's first, always in this order
            fds.append(_open(folder / "choosing.lock"))
            fcntl.flock(fds[-1], fcntl.LOCK_EX)
        yield
    finally:
        for fd in fds:
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


def taken(runs_dir: str | Path, hardware) -> tuple[dict[int, dict], str | None]:
    """The cores of this machine that a start may not take, each with who holds it: the
    studio's leases and, on Neuron, the cores programs outside the studio use (neuron-ls:
    outside_use.py). The second value says why those programs could not be seen (None when
    they could, or when not on a Neuron machine)."""
    held = holders(runs_dir, hardware.backend, hardware.cores)
    if hardware.backend != "neuron" or not getattr(hardware, "detected", True):
        return held, None
    others, problem = outside_use.busy_outside(held)
    if problem:
        problem = (f"cannot see which NeuronCores programs outside the studio use: {problem}; a core one of "
                   "them holds may be picked, and the job then fails to start on it")
    return {**{c: info for c, info in others.items() if c < hardware.cores}, **held}, problem


def choose(runs_dir: str | Path, hardware, nproc: int, cores: str | None,
           warnings: list[str] | None = None) -> list[int]:
    """The cores a run or chat will hold: `cores` if all are free (NamedCoresHeld naming the
    holders if not; ValueError if there is no such core), else the first free valid block of
    `nproc` (NoFreeCores if none). On Neuron, cores other programs use are not free either;
    when they cannot be seen, `warnings` (if given) gets a line saying so.
    Call it inside choosing(), so no other start takes them before their holder does."""
    count = hardware.cores
    held, problem = taken(runs_dir, hardware)
    if problem and warnings is not None:
        warnings.append(problem)
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
    held, _ = taken(runs_dir, hardware)
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
    """The cores among 0..count-1 held now, each with what its holder wrote about itself; a
    core held in the runs folder's old lease folder (an older studio's process) counts too.

    The info is {"holder", "kind", "pid", "time"}, or {"holder": None} when the holder
    has locked but not yet written (or its text cannot be read).
    """
    _check(backend, None, "run")
    held = {}
    folders = _folders(runs_dir)
    for core in range(count):
        for folder in folders:
            try:
                fd = os.open(folder / f"{backend}-core-{core}.lock", os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError):
                continue  # never leased there since the folder was made: free there
            try:
                if _try_lock(fd, fcntl.LOCK_SH, 0):  # shared, so two probes never refuse each other
                    fcntl.flock(fd, fcntl.LOCK_UN)
                else:
                    held[core] = _read_identity(fd)
            finally:
                os.close(fd)
            if core in held:
                break
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
    if kind == outside_use.KIND or holder.startswith((f"{kind}-", f"{kind} ")):
        name = holder  # "a program outside the studio on ...", "chat-7f3a"
    else:
        name = f"{kind} {holder}".strip()
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
