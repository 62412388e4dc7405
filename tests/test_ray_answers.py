"""Issue 47: a server at the --ray address that answers, but not as a Ray cluster's dashboard does.
Each is a real HTTP server started here (http.server); the check before a Ray run says what
answered and what to give instead, never a traceback.

What a real dashboard answers at /api/version is built from the installed Ray's own code
(ray/dashboard/modules/job/job_head.py: its VersionResponse as JSON, Ray 2.60), so the server that
answers like Ray and has no state API differs from Ray in that one thing.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import RECIPES, launch_py
from studio_core.backends import get
from studio_core.recipe.spec import RunSpec

NOT_RAY = ("give the address of the Ray head's dashboard (http://HEAD:8265), which must run with the full dashboard "
           "(pip install 'ray[default]' on the head)")


def ray_version_answer() -> dict:
    """Ray's own answer at /api/version, as the installed Ray's dashboard makes it."""
    import ray
    from ray.dashboard.modules.version import CURRENT_VERSION, VersionResponse

    return dataclasses.asdict(VersionResponse(version=CURRENT_VERSION, ray_version=ray.__version__,
                                              ray_commit=ray.__commit__, session_name="session_2026-01-01_00-00-00"))


@pytest.fixture
def server():
    """Start a server answering GET paths from a dict {path: JSON value} (404 for any other path, as
    a server without that API does); returns its address."""
    started = []

    def start(answers: dict) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?")[0]
                if path not in answers:
                    self.send_error(404)
                    return
                body = json.dumps(answers[path]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                return

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # a short poll: shutdown() waits for the server loop's next look, 0.5 s by default
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def ray_check(address: str) -> list[str]:
    """The Ray backend's check of a one-node CPU run at `address`, as a start makes it."""
    spec = RunSpec.from_dict({"model_name_or_path": "builtin:tiny-qwen3", "dataset_name": "builtin:qa",
                              "studio": {"run_on": "ray", "ray": {"address": address}}})
    return get("ray").check(spec.layout, "cpu")


@pytest.mark.fast
def test_a_server_that_answers_its_version_like_ray_without_the_state_api_is_named(server):
    address = server({"/api/version": ray_version_answer()})
    assert ray_check(address) == [f"studio.ray.address: the server at {address} answers /api/version as a Ray "
                                  f"dashboard does, but not Ray's state API (/api/v0/nodes answered HTTP 404): "
                                  f"{NOT_RAY}"]


@pytest.mark.fast
@pytest.mark.parametrize("version, shown", [([1, 2], "[1, 2]"), ({"version": "4"}, '{"version": "4"}'),
                                            ({"ray_version": 2.6}, '{"ray_version": 2.6}')])
def test_a_version_answer_not_shaped_as_rays_is_named(server, version, shown):
    address = server({"/api/version": version})
    assert ray_check(address) == [f"studio.ray.address: the server at {address} is not a Ray dashboard: its "
                                  f"/api/version gave {shown}, where a Ray dashboard's names its ray_version: "
                                  f"{NOT_RAY}"]


@pytest.mark.fast
@pytest.mark.parametrize("nodes", [[], {"result": True, "data": {}}, {"result": True, "data": {"result": 7}}])
def test_a_state_api_answer_not_shaped_as_rays_is_named(server, nodes):
    address = server({"/api/version": ray_version_answer(), "/api/v0/nodes": nodes})
    [problem] = ray_check(address)
    assert problem.startswith(f"studio.ray.address: the server at {address} answers Ray's state API (/api/v0/nodes) "
                              "otherwise than Ray does (")
    assert problem.endswith(NOT_RAY)


def test_train_against_such_servers_says_so_without_a_traceback(server, tmp_path):
    """`launch.py train RECIPE --ray ADDRESS`, as the issue found it (RayStateApiException, TypeError)."""
    no_state_api = "answers /api/version as a Ray dashboard does, but not Ray's state API (/api/v0/nodes answered"
    for answers, said in [({"/api/version": ray_version_answer()}, no_state_api),
                          ({"/api/version": [1, 2]}, "is not a Ray dashboard: its /api/version gave [1, 2]")]:
        address = server(answers)
        done = launch_py("train", str(RECIPES / "tiny-sft.yaml"), "--ray", address, "--runs-dir", str(tmp_path))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"studio.ray.address: the server at {address} {said}" in done.stderr
        assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # no run folder left
