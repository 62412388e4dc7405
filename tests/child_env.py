"""Reading the environment of a child process the studio starts, while it runs."""

from __future__ import annotations

import threading
import time

import psutil


def with_child_environment(module: str, action) -> tuple[object, dict]:
    """Run `action` in a thread; return its result and the environment of the `python -m module`
    child it starts (read while the child runs)."""
    result, seen = {}, {}
    thread = threading.Thread(target=lambda: result.setdefault("value", action()))
    thread.start()
    while thread.is_alive() and not seen:
        for child in psutil.Process().children(recursive=True):
            try:
                if module in child.cmdline():
                    seen.update(child.environ())
            except psutil.Error:  # it ended between the listing and the read
                continue
        time.sleep(0.01)
    thread.join()
    return result["value"], seen
