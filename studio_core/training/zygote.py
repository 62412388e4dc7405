"""The zygote: imports once what a run's supervisor and worker import, then forks the supervisor of
each run it is sent (studio_core/backends/forking.py says when, and what each fork does). An entry
point, never imported.

    python -m studio_core.training.zygote      (started by forking.fork_supervisor, with a run's environment)

Its stdin brings one run a line (JSON: the run's folder and the supervisor's environment); its
stdout says `ready` once it has imported, then each fork's pid. What the libraries print goes to the
start of each run's log, as a worker's own imports would have printed it there. At the end of its
stdin (the owner let it go, or ended) it ends; its forks are runs, and go on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

from studio_core.backends import forking
from studio_core.machine.children import collection_off, set_up, skip_final_collection


def import_libraries() -> None:
    """What a run's supervisor and worker import before the worker's first step, whichever trainer."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import trl

    import studio_core.machine.monitor  # noqa: F401
    import studio_core.training.compile_watch  # noqa: F401
    import studio_core.training.peak_memory  # noqa: F401
    import studio_core.training.precompile  # noqa: F401
    import studio_core.training.train_data  # noqa: F401
    import studio_core.training.trainer_setup  # noqa: F401
    from studio_core.recipe.trainers import TRAINERS

    for entry in TRAINERS.values():
        getattr(trl, entry.trainer_class), getattr(trl, entry.config_class)
    transformers.TrainerCallback  # noqa: B018


def main() -> int:
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    printed = tempfile.TemporaryFile()
    os.dup2(printed.fileno(), 1)  # stdout carries only the answers; what the libraries print is kept
    os.dup2(printed.fileno(), 2)
    collection_off()  # while it imports (children.py)
    import_libraries()
    sys.stdout.flush()
    sys.stderr.flush()
    forking.early_output = os.pread(printed.fileno(), os.fstat(printed.fileno()).st_size, 0)
    set_up()  # what the imports made is frozen: the forks' collections do not walk it (nor copy it)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forks this process does not wait for
    answers.write(forking.READY)
    while line := sys.stdin.buffer.readline():
        pid = os.fork()
        if pid == 0:
            answers.close()
            code = 1
            try:
                code = forking.supervise(json.loads(line))
            finally:
                os._exit(code)
        answers.write(f"{pid}\n".encode())
    return 0


if __name__ == "__main__":
    skip_final_collection()  # ended: no last collection over the libraries' heap (children.py)
    sys.exit(main())
