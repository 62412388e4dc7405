"""A child that loads torch ends without the interpreter's last garbage collection
(children.skip_final_collection): its atexit handlers and its output are kept, only the walk over
the heap is left out. It imports with the collector off (children.collection_off) and turns it on
again before its work (children.set_up)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.recipe import trl_schema

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app
ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import atexit, os, sys
if sys.argv[2] == "skip":
    from studio_core.machine.children import skip_final_collection
    skip_final_collection()

class Mark:
    def __init__(self, path):
        self.path = path
    def __del__(self, open_=os.open, write=os.write, close=os.close, flags=os.O_WRONLY | os.O_CREAT):
        fd = open_(self.path, flags); write(fd, b"finalized"); close(fd)

cycle = Mark(os.path.join(sys.argv[1], "cycle"))
cycle.me = cycle  # only a garbage collection frees it
del cycle
atexit.register(lambda: open(os.path.join(sys.argv[1], "atexit"), "w").write("ran"))
print("said, unflushed", end="")
"""

# The processes that load torch, Transformers or TRL: each ends by os._exit or skips the collection.
CHILDREN = ("studio_core/data/model_child.py", "studio_core/doctor/doctor_child.py",
            "studio_core/evaluate/eval_worker.py", "studio_core/export/export.py", "studio_core/recipe/rewards.py",
            "studio_core/serve/chat_worker.py", "studio_core/training/forecast.py",
            "studio_core/training/precompile_worker.py", "studio_core/training/worker.py",
            "studio_core/training/zygote.py", "launch.py")


@pytest.mark.parametrize("mode", ["normal", "skip"])
def test_the_last_collection_is_skipped_and_atexit_and_output_are_kept(mode, tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "said, unflushed"
    assert (tmp_path / "atexit").read_text() == "ran"
    # the collection at exit frees the cycle (and finalizes it) unless it is skipped
    assert (tmp_path / "cycle").exists() == (mode == "normal")


def heavy_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names & {"torch", "transformers", "trl", "peft", "datasets"}


def test_every_child_that_loads_torch_skips_it():
    entry_points = {str(p.relative_to(ROOT)) for p in (ROOT / "studio_core").rglob("*.py")
                    if '__name__ == "__main__"' in p.read_text()}
    assert {p for p in entry_points if heavy_imports(ROOT / p)} <= set(CHILDREN)  # a new one is listed
    for child in CHILDREN:
        text = (ROOT / child).read_text()
        main = text[text.index('if __name__ == "__main__":'):]
        assert "skip_final_collection()" in main or "os._exit(" in main, child
    # TRL's children, started with `python -c`, write the same two lines out first
    assert trl_schema._CONFIG_CHECK.startswith(trl_schema._QUICK_EXIT)
    assert trl_schema._INTROSPECT.startswith(trl_schema._QUICK_EXIT)


COLLECTOR = """
import gc, os, sys
from studio_core.machine.children import collection_off, set_up

class Mark:
    def __init__(self, name):
        self.name = name
    def __del__(self):
        open(os.path.join(sys.argv[1], self.name), "w").write("freed")

def garbage(name):
    cycle = Mark(name)
    cycle.me = cycle  # only a garbage collection frees it
    for _ in range(100_000):  # allocations enough for the collector's passes, when it is on
        [[], []]

collection_off()
garbage("while-off")
off = gc.isenabled()
set_up()
garbage("after-set-up")
print(off, gc.isenabled(), gc.get_freeze_count() > 1000)
"""


def test_the_collector_is_off_until_set_up_and_frees_cycles_after_it(tmp_path):
    done = subprocess.run([sys.executable, "-c", COLLECTOR, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"]  # off; then on, what was alive frozen
    assert (tmp_path / "after-set-up").exists()  # freed by the collector's own passes
    assert not (tmp_path / "while-off").exists()  # frozen with the rest: never freed (the imports leave few such)


# the children that may keep the collector off for their whole life: each gives one short answer and ends
ONE_ANSWER = ("studio_core/data/model_child.py",)


def test_every_child_that_turns_the_collector_off_turns_it_on_before_its_work():
    turned_off = [child for child in CHILDREN if "collection_off()" in (ROOT / child).read_text()]
    assert {"studio_core/training/worker.py", "studio_core/training/zygote.py", "studio_core/serve/chat_worker.py",
            "studio_core/evaluate/eval_worker.py"} <= set(turned_off)
    for child in turned_off:
        text = (ROOT / child).read_text()
        assert ("set_up()" in text) != (child in ONE_ANSWER), child
    check = trl_schema._CONFIG_CHECK  # the TRL config check child, long-lived: on again after its imports
    assert check.index("gc.disable()") < check.index("import torch, transformers, trl") < check.index("gc.enable()")
