"""`launch.py` (serve): local-only by default; a login is required to listen elsewhere."""

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import launch_py

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::"])
def test_a_non_loopback_host_without_a_login_is_refused(host, tmp_path):
    done = launch_py("--host", host, "--runs-dir", str(tmp_path))
    assert done.returncode == 2
    assert f"Refusing to listen on {host}" in done.stderr and "--auth" in done.stderr


@pytest.mark.fast
def test_a_malformed_login_is_refused(tmp_path):
    auth_file = tmp_path / "logins"
    auth_file.write_text("alice:secret\nbob-without-password\n")
    done = launch_py("--host", "0.0.0.0", "--auth-file", str(auth_file), "--runs-dir", str(tmp_path))
    assert done.returncode != 0 and "user:password" in done.stderr


def test_with_a_login_the_app_asks_for_it_and_shows_nothing_of_the_runs_before(tmp_path, sft_runs):
    """The page Gradio serves before a login holds its API description and the widgets' first
    values: no run id, model, dataset path or folder of this machine may be among them."""
    runs_dir = tmp_path / "runs"
    run_id = sft_runs.ids["full"]
    sft_runs.copy_to(runs_dir, "full")
    spec_file = runs_dir / run_id / "spec.yaml"
    data = tmp_path / "private-data.jsonl"
    spec_file.write_text(spec_file.read_text().replace("builtin:qa", str(data)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--auth", "alice:secret",
                             "--runs-dir", str(runs_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().strip() == f"Studio on http://127.0.0.1:{port}"
        # the line is printed once the port answers: a request right after it is answered, never refused
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=30)
        assert refused.value.code == 401  # Gradio's API description, not without a login
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:
            page = answer.read().decode()
        assert "auth_required" in page  # the login page, with Gradio's API description in it
        for private in (run_id, str(data), str(tmp_path)):
            assert private not in page, f"{private!r} is in the page served before a login"
        login = urllib.request.Request(f"http://127.0.0.1:{port}/login", method="POST",
                                       data=b"username=alice&password=wrong")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(login, timeout=5)
        assert refused.value.code in (400, 401)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
