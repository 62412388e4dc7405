"""Runs forked from a zygote: a process that has imported torch, Transformers, TRL, PEFT and
datasets once, so that a run's supervisor and worker do not each import them again (about 6 s of
CPU a run on a 2-core machine, and as long before the first step).

A process that starts one run after another (the web app, a test session) keeps one zygote
(keep_zygote turns it on; the command line, which starts one run, does not). It starts it with the
environment of its first one-process run on this machine's CPU, which itself starts as before:

    python -m studio_core.training.zygote        (its own session; a child of this process)

The zygote imports what a run's supervisor and worker import, says it is ready, and waits on its
stdin. Each later such run whose environment is exactly the zygote's, but for the variables the
studio sets late (LATE: the run's id, its rendezvous port, a checkpoint to resume from; no library
reads them as it is imported), is sent to it: it forks the run's supervisor, which starts a session
of its own, takes the run's environment (os.environ, and the strings /proc/PID/environ shows:
studio_core.machine.own_environment, so the run's marker finds it), folder and log, and goes on as
any run's supervisor does (studio_core/training/supervisor.py); where it would start the worker, it
forks it, with the worker's environment, as its child with the same parent-death signal, the
lease's descriptors and the CPU pinning (a fork inherits them). The supervisor is then no longer
the zygote's business: it outlives it as any run's supervisor outlives the app (the kernel reaps
it, or init once the zygote is gone). Any other run (another environment, several processes, a
device: Neuron's and CUDA's libraries read variables as they are imported, and a device runtime
is not to be started in a process that forks) starts as before. A run of another environment
keeps the zygote there is; a second one in a row lets it go and starts one with that environment
(each zygote's imports cost what a run's worker's do: one is started only where runs repeat).

Nothing of a zygote outlives its owner: it holds no core and no lease, and when the owner ends
(its end of the zygote's stdin closes) or lets it go, it ends.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from studio_core.machine import children
from studio_core.machine.own_environment import ROOM, fits, fits_here, replace, with_room
from studio_core.machine.procs import die_with_parent
from studio_core.rundir.checkpoints import RESUME_ENV
from studio_core.rundir.folder import LOG

ZYGOTE = "studio_core.training.zygote"
SUPERVISOR = "studio_core.training.supervisor"
WORKER = "studio_core.training.worker"
RUN_ID = "STUDIO_RUN_ID"
LATE = (RUN_ID, "MASTER_PORT", RESUME_ENV, ROOM)  # set by the studio after the libraries are imported
READY = b"ready\n"
ANSWER_S = 10  # how long a zygote may take to fork a run's supervisor

# torchrun's variables for the one rank of a one-process run (as precompile's jobs get them);
# MASTER_PORT is chosen free when it starts, for a process group of one (the run's ddp_backend).
ONE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}

forked = False  # this process is a run's supervisor forked from a zygote
early_output = b""  # what the zygote printed as it imported: at the start of each forked run's log


def one_rank(argv: list[str]) -> list[str] | None:
    """The command of a one-process run of this machine without torchrun: `python -m WORKER
    RUN_DIR` from the plan's `python -m torch.distributed.run --standalone ... --nproc-per-node=1
    -m WORKER RUN_DIR`; None for any other command (several processes, a cluster's node). The
    worker is the supervisor's child then: it dies with it (its own parent-death signal), gets
    the stop's SIGTERM directly, and holds the lease's copies as torchrun did."""
    if argv[1:3] != ["-m", "torch.distributed.run"] or "--standalone" not in argv \
            or "--nproc-per-node=1" not in argv or "-m" not in argv[3:]:
        return None
    return [argv[0], *argv[argv.index("-m", 3):]]


def same(started: Mapping[str, str], env: Mapping[str, str], ignored) -> bool:
    """Whether a process started with `started` may take `env`: equal but for `ignored`."""
    return ({k: v for k, v in started.items() if k not in ignored}
            == {k: v for k, v in env.items() if k not in ignored})


# --- the owner's side ------------------------------------------------------------------------

class _Owner:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ignored: tuple[str, ...] | None = None  # None: no zygote in this process
        self.zygote: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # what it was started with
        self.last: dict[str, str] = {}  # the environment of the last run that could fork
        self.ready = False


_owner = _Owner()


def keep_zygote(ignored: tuple[str, ...] = ()) -> None:
    """Keep a zygote in this process from its first run on. `ignored`: more variables that differ
    from run to run and that no library reads (the test runner's PYTEST_CURRENT_TEST)."""
    _owner.ignored = (*LATE, *ignored)


class ForkedSupervisor:
    """A run's supervisor forked by the zygote (not this process's child: the zygote's)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.process = pid, psutil.Process(pid)

    def poll(self) -> int | None:
        """None while it runs; 0 once it has ended (its exit code is the zygote's to collect)."""
        try:
            return None if self.process.status() != psutil.STATUS_ZOMBIE else 0
        except psutil.NoSuchProcess:
            return 0


def fork_supervisor(run_dir: Path, env: dict[str, str], argv: list[str], device: str) -> ForkedSupervisor | None:
    """The run's supervisor, forked by this process's zygote, if it keeps one that can take the run
    (its plan's `env` and `argv`, on `device`); else None, and the caller starts the supervisor."""
    ignored = _owner.ignored
    if ignored is None or device != "cpu" or one_rank(argv) is None:
        return None
    wanted = children.environment(env)
    with _owner.lock:
        zygote, last, _owner.last = _owner.zygote, _owner.last, wanted
        if zygote is not None and zygote.poll() is not None:  # it ended by itself (killed, or its imports failed):
            _owner.ignored, _owner.zygote = None, None  # no more zygotes here, each would cost a run's imports
            return None
        if zygote is None or not (same(_owner.env, wanted, ignored) and fits(_owner.env, wanted)):
            # this run starts as before; a zygote for runs after it is started with its environment when
            # the run before had it too (one run of another environment keeps the zygote there is)
            if zygote is None or same(last, wanted, ignored):
                if zygote is not None:
                    _let_go(zygote)
                _start_zygote(env)
            return None
        if not _ready(0):  # still importing: this run starts as before
            return None
        try:
            zygote.stdin.write(json.dumps({"run_dir": str(run_dir), "env": wanted}).encode() + b"\n")
            zygote.stdin.flush()
            return ForkedSupervisor(int(_answered(zygote, ANSWER_S)))
        except (OSError, ValueError, psutil.NoSuchProcess):  # it ended, or did not answer in time
            _let_go(zygote)
            _owner.zygote = None
            return None


def ready(timeout: float = 0) -> bool:
    """Whether this process keeps a zygote that has imported its libraries (waiting up to `timeout`)."""
    with _owner.lock:
        return _ready(timeout)


def _ready(timeout: float) -> bool:
    """ready(), with the owner's lock held."""
    if _owner.zygote is not None and not _owner.ready:
        _owner.ready = _answered(_owner.zygote, timeout) == READY
    return _owner.zygote is not None and _owner.ready


def _start_zygote(env: dict[str, str]) -> None:
    _owner.env = children.environment(with_room({**env, RUN_ID: f"zygote-of-{os.getpid()}"}))
    _owner.zygote = subprocess.Popen(children.module_argv(ZYGOTE), env=_owner.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                     cwd=children.REPO_ROOT)
    _owner.ready = False
    threading.Thread(target=_owner.zygote.wait, name="reap-zygote", daemon=True).start()


def _answered(zygote: subprocess.Popen, timeout: float) -> bytes:
    if not select.select([zygote.stdout], [], [], timeout)[0]:
        return b""
    return zygote.stdout.readline()


def _let_go(zygote: subprocess.Popen) -> None:
    """End a zygote: its stdin closes, it ends (reaped by its own thread). Its forks are runs."""
    try:
        zygote.stdin.close()
    except BrokenPipeError:
        return  # already gone


# --- in the zygote's forks -------------------------------------------------------------------

def supervise(claim: dict) -> int:
    """In a fork of the zygote: be the supervisor of the run `claim` names, as if started with
    `python -m studio_core.training.supervisor RUN_DIR` in its folder (local.py's start)."""
    global forked
    forked = True
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote's SIG_IGN: this process waits for its worker
    os.setsid()
    run_dir = Path(claim["run_dir"])
    replace(claim["env"])
    os.chdir(run_dir)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(run_dir / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(log, early_output)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    return _run_module(SUPERVISOR, run_dir)


class Forked:
    """The worker this supervisor forked: what supervisor.py uses of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(WORKER, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_worker(run_dir: Path, env: dict[str, str]) -> Forked | None:
    """In a forked supervisor: fork the run's worker, as `python -m studio_core.training.worker
    RUN_DIR` with `env` would be started (its output, folder, CPUs and the lease's descriptors are
    this process's already). None if `env` is longer than the room the zygote was started with."""
    if not fits_here(env):
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid)
    code = 1
    try:
        die_with_parent(signal.SIGTERM)  # as the supervisor starts a worker; the worker makes it SIGKILL
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the supervisor's handlers are not the worker's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        replace(env)
        code = _run_module(WORKER, run_dir)
    finally:
        os._exit(code)


def _run_module(module: str, run_dir: Path) -> int:
    """Run `python -m module RUN_DIR`'s main in this process; its exit code."""
    sys.argv[:] = ["", str(run_dir)]
    sys.path[0] = str(run_dir)  # where `python -m` started in the run's folder puts it
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0
