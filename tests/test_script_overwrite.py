"""`launch.py plan --slurm-script FILE` (and --export-script) replace only a script the studio wrote:
anything else at FILE (another file, a symbolic link, a device) is refused before anything is
planned, saying what to do, and left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli.main import main

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"


def plan_script(tmp_path: Path, option: str, path: Path, capsys) -> tuple[int, str]:
    nodes = ["--nodes", "2"] if option == "--slurm-script" else []
    code = main(["plan", str(RECIPE), "--instance", "trn2.48xlarge", option, str(path), *nodes,
                 "--no-forecast", "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.fast
@pytest.mark.parametrize("option", ["--slurm-script", "--export-script"])
def test_a_file_the_studio_did_not_write_is_left_as_it_was(tmp_path, capsys, option):
    path = tmp_path / "notes.sh"
    path.write_text("#!/usr/bin/env bash\necho my own work\n")
    code, said = plan_script(tmp_path, option, path, capsys)
    assert code == 2
    assert f"{option} {path} already exists and is not a script the studio wrote: nothing is overwritten" in said
    assert f"rm {path}" in said and "Traceback" not in said
    assert path.read_text() == "#!/usr/bin/env bash\necho my own work\n"


@pytest.mark.fast
def test_a_symbolic_link_is_not_written_through(tmp_path, capsys):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me\n")
    link = tmp_path / "job.sh"
    link.symlink_to(target)
    code, said = plan_script(tmp_path, "--slurm-script", link, capsys)
    assert code == 2 and f"is a symbolic link (to {target})" in said and "remove the link" in said
    assert target.read_text() == "keep me\n" and link.is_symlink()


@pytest.mark.fast
def test_a_device_is_refused(tmp_path, capsys):
    fifo = tmp_path / "job.sh"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that a write there would not block this test
    try:
        code, said = plan_script(tmp_path, "--slurm-script", fifo, capsys)
    finally:
        os.close(reader)
    assert code == 2 and "is a device, a pipe or a socket, not a file: give a new file name" in said


@pytest.mark.parametrize("option, mark", [("--slurm-script", "written by the studio for run"),
                                          ("--export-script", "# Exported from the studio: ")])
def test_the_studios_own_script_is_replaced(tmp_path, capsys, option, mark):
    path = tmp_path / "job.sh"
    assert plan_script(tmp_path, option, path, capsys)[0] == 0
    first = path.read_text()
    assert mark in first
    code, said = plan_script(tmp_path, option, path, capsys)
    assert code == 0 and f"Wrote {path}" in said
    if option == "--slurm-script":  # a new run id: the file was written again
        assert path.read_text() != first
