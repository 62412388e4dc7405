"""Issue 47, "Tracebacks on odd surroundings": a runs folder with a file where the studio keeps a
folder, a --ray address that is no address, --ray with --slurm, a queue move of a run that is not
there. Each is refused with exit code 2 and a message that says what to change, at once, never a
traceback. The command line is called in this process (main(argv)), as launch.py does; nothing
here gets as far as a run.
"""

from __future__ import annotations

import time

import pytest

from cli.main import main
from conftest import RECIPES
from studio_core.machine.leases import LEASES_ENV
from studio_core.rundir import events, folder
from studio_core.runs import queue

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

TINY = str(RECIPES / "tiny-sft.yaml")


def refused(capsys, *argv: str) -> str:
    """What `launch.py ARGV` says on stderr, refused with exit code 2."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def test_a_smoke_folder_that_is_a_file_is_named_and_nothing_is_made(tmp_path, capsys):
    (tmp_path / "smoke").write_text("not a folder")
    said = refused(capsys, "doctor", "--smoke", "--runs-dir", str(tmp_path))
    assert said == (f"Smoke test not started: the smoke test keeps its runs and report in {tmp_path / 'smoke'}, "
                    f"and {tmp_path / 'smoke'} is a file, not a folder: move it away, or give --runs-dir (or "
                    "$STUDIO_RUNS_DIR) a runs folder you can write to\n")
    assert (tmp_path / "smoke").read_text() == "not a folder"


def test_a_lease_folder_that_is_a_file_stops_the_smoke_before_it_makes_its_folder(tmp_path, capsys):
    """The tests keep leases per runs folder (conftest: STUDIO_LEASES_DIR=.leases), as a user may:
    the smoke's runs share the runs folder's lease folder, which here is a file."""
    (tmp_path / ".leases").write_text("not a folder")
    said = refused(capsys, "doctor", "--smoke", "--runs-dir", str(tmp_path))
    assert said == (f"the core lease folder {tmp_path / '.leases'} cannot be made: {tmp_path / '.leases'} is a "
                    f"file, not a folder: move it away, or set {LEASES_ENV} to a folder you can write to\n")
    assert not (tmp_path / "smoke").exists()  # nothing half made


@pytest.mark.parametrize("address, why", [
    ("http://[::1", "is not a Ray dashboard address: write http://HOST:PORT"),
    ("http://127.0.0.1:99999", "is not a Ray dashboard address: port 99999 is out of range (1 to 65535)"),
    ("http://10.0.0.5:0", "is not a Ray dashboard address: port 0 is out of range (1 to 65535)"),
    ("http://[fd00::zz]:8265", "is not a Ray dashboard address: write http://HOST:PORT"),
])
def test_a_ray_address_that_is_no_address_is_refused_at_once(tmp_path, capsys, address, why):
    began = time.monotonic()
    said = refused(capsys, "train", TINY, "--ray", address, "--runs-dir", str(tmp_path))
    assert f"--ray: {address!r} {why}" in said and "no Ray cluster answers" not in said
    assert time.monotonic() - began < 5  # asks no server (it waited for one 9 s)


@pytest.mark.parametrize("command", ["train", "plan"])
def test_ray_and_slurm_together_are_refused_as_two_places(tmp_path, capsys, command):
    said = refused(capsys, command, TINY, "--slurm", "--ray", "http://10.0.0.5:8265", "--runs-dir", str(tmp_path))
    assert "--slurm and --ray ADDRESS cannot go together: a run goes to one place, give only one of them" in said
    assert "add --ray" not in said


def test_moving_a_run_that_is_not_there_says_there_is_no_such_run(tmp_path, capsys):
    said = refused(capsys, "queue", "nosuchrun", "--to", "1", "--runs-dir", str(tmp_path))
    assert said == f"there is no run 'nosuchrun' in {tmp_path}: `launch.py queue` lists the queued runs\n"


def run_folder(runs_dir, run_id: str, *states: str, place: str | None = None) -> None:
    """A run folder with the tiny recipe as its spec, these status events and, given, this queue.json."""
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True)
    (run_dir / folder.SPEC).write_text((RECIPES / "tiny-sft.yaml").read_text())
    for state in states:
        events.append(run_dir / folder.EVENTS, events.status(state))
    if place is not None:
        (run_dir / queue.QUEUE).write_text(place)


def test_moving_a_run_out_of_the_queue_says_why_it_has_no_place(tmp_path, capsys):
    """A run that ended is not queued; one whose place cannot be read is named as such (both were "it
    has started or ended")."""
    ended, damaged = "20260101-000000-tiny-sft-aaaaaa", "20260101-000001-tiny-sft-bbbbbb"
    run_folder(tmp_path, ended, "starting", "finished")
    run_folder(tmp_path, damaged, "queued", place='{"order": "first"}')
    said = refused(capsys, "queue", ended, "--to", "1", "--runs-dir", str(tmp_path))
    assert said.startswith(f"run {ended} is not queued (it has started or ended)")
    said = refused(capsys, "queue", damaged, "--to", "1", "--runs-dir", str(tmp_path))
    assert said.startswith(f"run {damaged} is queued, but its place cannot be read (queue.json is damaged): cancel it "
                           f"(`launch.py stop {damaged}`) and start it again")
