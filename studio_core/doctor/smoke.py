"""`launch.py doctor --smoke` (and the Doctor tab's "Run smoke test"): the first-run kit.

Where the doctor checks the pieces, the smoke test runs the studio's own jobs end to end, on
whatever device this machine has, through the same code a user's jobs take (RunManager and
its supervisor and worker, the chat process, the evaluation process, precompile), with the
built-in tiny model and Q&A set, so it needs no download. Each step has its own pass/fail,
error and seconds; a failed step does not stop the others:

    probe       the doctor's device probe: the backend, its cores, what detection found wrong
    precompile  the 2 batch shapes of the Q&A set's first 2 batches (4 x 38, 4 x 34: padded to
                a multiple of 2) compiled by 2 precompile jobs, one core each, then a 2-step run
                whose compile_end events must all say "hit"
    sft         5 SFT steps with torch_compile on one core, over the same 2 shapes: a compiled
                run that passes whether it finds them in the cache or compiles them itself
    two_ranks   2 steps of a 2-process data-parallel run (2 cores; on CPU 2 CPU cores)
    chat        a 3-token answer from the sft step's model (the built-in model if it failed)
    eval        eval loss of that model (and its base) on 4 rows of the Q&A set

The precompile goes first so that the smoke compiles each shape once, in parallel (the slow
part on a 2-core CPU as on Neuron): the precompiled run's hits can then only come from its
own jobs, and the sft step reuses what they compiled.

Then one report, `smoke-report.json` with a readable `smoke-report.md` beside it: versions,
the Neuron/EFA environment (never a token or anything named like a secret), the hardware,
compile cache entries (NEFF files on Neuron) before and after, and every step. It is the
file a Trainium user attaches to a bug report.

Where: `<runs dir>/smoke/<time>/`, with the smoke's runs in `runs/` (kept, for their logs),
out of the Runs tab's list. That folder's `.leases` is a link to the runs folder's own, so
the smoke takes its cores through the same leases as every run, chat and evaluation there:
a busy core is a step's clear failure, never a second process on a NeuronCore.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Iterator

from studio_core.doctor import doctor
from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.serve.chat import ChatError, ChatProcess
from studio_core.machine.children import REPO_ROOT
from studio_core.machine.compile_cache import compile_cache_dir, summary
from studio_core.machine.cores import format_cores
from studio_core.evaluate.evaluation import EvalError, EvalProcess, EvalRequest
from studio_core.machine.hardware import Hardware, cpu_hardware, detect_hardware
from studio_core.recipe.rewards import HUB_TOKENS
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import TOKEN_VALUE

STEPS = {
    "probe": "the device probe",
    "precompile": "2 shapes precompiled, then a run that finds them in the cache",
    "sft": "5 SFT steps with torch_compile on one core",
    "two_ranks": "a 2-process data-parallel run",
    "chat": "a 3-token chat answer",
    "eval": "eval loss on 4 rows",
}
RECIPE = REPO_ROOT / "recipes" / "tiny-sft.yaml"
# The same padding on every backend (Neuron's default pads to 128, which would leave one shape):
# the first 2 batches of the Q&A set are 2 shapes, 4 x 38 and 4 x 34, and the sft step's 5
# steps take no other.
SHAPES = ["pad_to_multiple_of=2", "logging_steps=1"]
PRECOMPILE = [*SHAPES, "max_steps=2", "torch_compile=true", "studio.precompile=true", "studio.precompile_jobs=2",
              "run_name=smoke-precompile"]
SFT = [*SHAPES, "max_steps=5", "torch_compile=true", "run_name=smoke-sft"]
# torch_compile as the planner has it for the backend (on Neuron: on); DDP splits the graphs anew
TWO_RANKS = [*SHAPES, "studio.nproc=2", "max_steps=2", "run_name=smoke-2ranks"]
PROMPT = [{"role": "user", "content": "What is the capital of Veloria?"}]
VERSIONS = ("torch", "torch-neuronx", "neuronx-cc", "transformers", "trl", "peft", "accelerate", "datasets",
            "huggingface_hub")
ENV_PREFIXES = ("NEURON_", "TORCH_NEURONX_", "FI_", "STUDIO_", "TORCHINDUCTOR_", "XLA_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_DEACTIVATE_ASYNC_LOAD", "PJRT_DEVICE")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH", "COOKIE", "SESSION")
REPORT = "smoke-report"


@dataclass
class Step:
    name: str
    ok: bool | None = None  # None: running
    seconds: float = 0.0
    found: str = ""  # what it saw
    error: str = ""  # why it failed
    details: dict = field(default_factory=dict)

    def line(self) -> str:
        mark = "...." if self.ok is None else "PASS" if self.ok else "FAIL"
        text = f"{mark}  {self.name:<11} {STEPS[self.name]}"
        text += f" ({self.seconds:.0f} s)" if self.ok is not None else " ..."
        if self.found:
            text += f"\n      {self.found}"
        return text + (f"\n      error: {self.error}" if self.error else "")


class StepFailed(Exception):
    """A step saw something wrong; the message says what."""


class Smoke:
    """One smoke test: `run()` yields each step as it starts and again when it ends; then
    `report_path` names the report."""

    def __init__(self, runs_dir: str | Path, hardware: Hardware | None = None):
        self.runs_dir = Path(runs_dir).expanduser()
        self.hardware, self.given = hardware, hardware is not None
        self.folder = self.runs_dir / "smoke" / time.strftime("%Y%m%d-%H%M%S")  # -2, -3 when taken
        self.steps: list[Step] = []
        self.report_path: Path | None = None
        self.sft_run: str | None = None

    def run(self) -> Iterator[Step]:
        began, started = time.monotonic(), time.time()
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        stamp, number = self.folder.name, 1
        while True:  # two smoke tests started in the same second get a folder each
            try:
                self.folder.mkdir()
                break
            except FileExistsError:
                number += 1
                self.folder = self.folder.with_name(f"{stamp}-{number}")
        runs = self.folder / "runs"
        runs.mkdir()
        (self.runs_dir / ".leases").mkdir(exist_ok=True)
        # the smoke's runs folder shares the runs folder's core leases (one lock file per core)
        (runs / ".leases").symlink_to(self.runs_dir / ".leases", target_is_directory=True)
        self.manager = RunManager(runs)
        try:
            for name in STEPS:
                step = Step(name)
                self.steps.append(step)
                yield step
                clock = time.monotonic()
                try:
                    step.found = getattr(self, name)(step)
                    step.ok = True
                except (StepFailed, SpecError, ChatError, EvalError, TimeoutError, OSError) as error:
                    step.ok, step.error = False, str(error).strip()
                except Exception as error:  # a bug of the studio's: the report carries its traceback
                    step.ok, step.error = False, f"{type(error).__name__}: {error}"
                    step.details["traceback"] = traceback.format_exc()
                step.seconds = round(time.monotonic() - clock, 1)
                if self.hardware is not None:  # which step compiled what (on Neuron: NEFF files)
                    step.details["cache_after"] = self.cache_entries()
                yield step
        finally:
            self.report_path = write_report(self.report(started, time.monotonic() - began), self.folder)

    # --- the steps ---------------------------------------------------------------------
    def probe(self, step: Step) -> str:
        if not self.given:
            try:
                self.hardware = detect_hardware()
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                self.hardware = cpu_hardware()
                raise StepFailed(f"detection failed ({error}); the other steps run on the CPU") from error
        device = doctor.devices(self.hardware)
        step.details["hardware"] = self.hardware.to_dict()
        held = self.manager.core_holders(self.hardware)
        if held:
            step.details["held_at_start"] = held
        problems = list(self.hardware.problems) + ([] if device.ok else [f"{device.found}: {device.fix}"])
        if problems:
            raise StepFailed(" ".join(problems))
        busy = f"; held by others now: {', '.join(f'core {c}: {h}' for c, h in sorted(held.items()))}" if held else ""
        return f"{self.hardware.backend}: {device.found}{busy}"

    def sft(self, step: Step) -> str:
        view = self.train(step, SFT)
        if not view.compiles:
            raise StepFailed("the run finished but recorded no compilation: torch_compile did not take effect")
        self.sft_run = view.id
        answers = [e.get("cache") or "unknown" for e in view.compiles]
        step.details["run_cache"] = answers
        hits = f", {answers.count('hit')} of them found in the cache" if "hit" in answers else ""
        return f"{view.step} steps, loss {self.losses(view)}; {len(view.compiles)} graph compilation(s){hits}"

    def two_ranks(self, step: Step) -> str:
        view = self.train(step, TWO_RANKS)
        if view.world_size != 2:
            raise StepFailed(f"the run trained with {view.world_size} process(es), not 2")
        return f"{view.step} steps on 2 processes, loss {self.losses(view)}"

    def target(self, step: Step) -> str:
        if self.sft_run:
            return self.sft_run
        step.details["note"] = "the sft step has no model: the built-in model answers instead"
        return BUILTIN_MODEL

    def chat(self, step: Step) -> str:
        target = self.target(step)
        chat = ChatProcess.start(target, self.manager.runs_dir, self.hardware)
        try:
            events = list(chat.generate(PROMPT, max_new_tokens=3))
        finally:
            chat.unload()
        done = events[-1]
        text = "".join(e["text"] for e in events if e["type"] == "token")
        step.details |= {"target": target, "text": text, "new_tokens": done["new_tokens"], "shapes": done["shapes"]}
        if not 1 <= done["new_tokens"] <= 3:
            raise StepFailed(f"asked for 3 new tokens, got {done['new_tokens']}")
        return f"{done['new_tokens']} token(s) from {target} on core {format_cores(chat.cores)}: {text!r}"

    def eval(self, step: Step) -> str:
        target = self.target(step)
        request = EvalRequest(target, data="builtin:qa", metrics=("eval_loss",), limit=4, max_new_tokens=3)
        evaluation = EvalProcess.start(request, self.manager.runs_dir, self.hardware)
        try:
            done = [e for e in evaluation.events(timeout=doctor.TIMEOUT_S[self.hardware.backend])
                    if e["type"] == "done"][-1]
        finally:
            if evaluation.proc.poll() is None:  # interrupted: its core is freed now
                evaluation.kill()
        results = done["summary"]["results"]
        losses = {side: scores.get("eval_loss") for side, scores in results.items()}
        step.details |= {"target": target, "rows": done["summary"]["rows"], "eval_loss": losses}
        bad = [side for side, loss in losses.items() if not (isinstance(loss, float) and math.isfinite(loss))]
        if done["summary"]["rows"] != 4 or bad or not losses:
            raise StepFailed(f"{done['summary']['rows']} rows scored, eval loss {losses} (4 rows, finite losses "
                             "expected)")
        return f"{done['summary']['rows']} rows, eval loss " + ", ".join(f"{s} {v:.4g}" for s, v in losses.items())

    def precompile(self, step: Step) -> str:
        view = self.train(step, PRECOMPILE)
        jobs = view.precompile or {}
        done = jobs.get("done", [])
        step.details["jobs"] = [{k: e.get(k) for k in ("shape", "job", "seconds", "cache")} for e in done]
        # a step's eager ops (phase "eager", Neuron) are outside the graphs the jobs compiled
        answers = [e.get("cache") for e in view.compiles if e.get("cache") and e.get("phase") != "eager"]
        step.details["run_cache"] = answers
        step.details["eager_compiles"] = sum(e.get("phase") == "eager" for e in view.compiles)
        if jobs.get("failed") or len(done) != 2:
            raise StepFailed(f"precompile: {len(done)} of 2 shapes compiled (failed jobs: {jobs.get('failed')}); "
                             f"{view.dir / 'train.log'} has their output")
        if not answers or any(a != "hit" for a in answers):
            said = ", ".join(answers) if answers else "neither hit nor miss (unknown)"
            raise StepFailed(f"the run's compile_end events say {said}: the run did not find every graph the "
                             "precompile jobs compiled in the cache")
        jobs_said = ", ".join(f"{e['shape']}: {e.get('cache') or 'unknown'}" for e in done)
        return f"jobs compiled {jobs_said}; the run's {len(answers)} compilation(s) all hit the cache"

    # --- helpers ---------------------------------------------------------------------------
    def train(self, step: Step, overrides: list[str]):
        spec = RunSpec.load(RECIPE).with_overrides(overrides)
        view = self.manager.start(spec, self.hardware)
        step.details["run"] = view.id
        try:
            view = self.manager.wait(view.id, timeout=doctor.TIMEOUT_S[self.hardware.backend])
        finally:
            if self.manager.view(view.id).active:  # timed out, or the smoke was interrupted
                self.manager.stop(view.id)
        step.details["run_state"] = view.live_state
        if view.live_state != "finished":
            raise StepFailed(f"run {view.id} ended {view.live_state}: {view.error_text or view.reason or '?'} "
                             f"(log: {view.dir / 'train.log'})")
        return view

    @staticmethod
    def losses(view) -> str:
        values = [m["loss"] for m in view.metrics if isinstance(m.get("loss"), float)]
        if not values or not all(math.isfinite(v) for v in values):
            raise StepFailed(f"run {view.id}: its losses are {values or 'missing'}, not finite numbers")
        return f"{values[0]:.4g} -> {values[-1]:.4g}"

    def cache_entries(self) -> dict:
        cache = summary(compile_cache_dir(self.hardware.backend))
        return {"path": str(cache.path), "NEFFs": 0, **cache.entries}

    def report(self, started: float, seconds: float) -> dict:
        hardware = self.hardware or cpu_hardware()
        cache_before = self.steps[0].details.get("cache_after") if self.steps else None  # after the probe
        return {"report": "studio smoke test", "passed": bool(self.steps) and all(s.ok for s in self.steps)
                and len(self.steps) == len(STEPS), "started": time.strftime("%Y-%m-%d %H:%M:%S %z",
                                                                             time.localtime(started)),
                "seconds": round(seconds, 1), "folder": str(self.folder), "hardware": hardware.to_dict(),
                "versions": versions(), "env": safe_environment(os.environ),
                "compile_cache": {"before": cache_before, "after": self.cache_entries() if self.hardware else None},
                "steps": [asdict(s) for s in self.steps]}


# --- in the background (the web app) ---------------------------------------------------------
class Background:
    """A smoke test in a thread of this process, for a page to show as it goes: at most one at a
    time per process (`start` hands back the one going)."""

    _lock = threading.Lock()
    latest: Background | None = None

    def __init__(self, runs_dir: str | Path):
        self.smoke, self.done, self.failure = Smoke(runs_dir), False, ""
        self.thread = threading.Thread(target=self._run, name="smoke-test", daemon=True)

    @classmethod
    def start(cls, runs_dir: str | Path) -> tuple[Background, bool]:
        """(the smoke test going, whether this call started it)."""
        with cls._lock:
            if cls.latest is not None and not cls.latest.done:
                return cls.latest, False
            cls.latest = cls(runs_dir)
            cls.latest.thread.start()
            return cls.latest, True

    def _run(self) -> None:
        try:
            for _ in self.smoke.run():
                pass
        except Exception as error:  # the page says it, with the report written so far
            self.failure = f"{type(error).__name__}: {error}"
        finally:
            self.done = True


# --- the report -------------------------------------------------------------------------------
def versions() -> dict:
    found = {"python": platform.python_version(), "platform": platform.platform(), "studio": _commit()}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    compiler = shutil.which("neuronx-cc")
    if found["neuronx-cc"] is None and compiler:  # installed outside this Python's packages
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False)
        found["neuronx-cc"] = (done.stdout or done.stderr).strip().splitlines()[-1:] or None
    return found


def _commit() -> str | None:
    git = shutil.which("git")
    if git is None or not (REPO_ROOT / ".git").exists():
        return None
    done = subprocess.run([git, "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=10, check=False)
    return done.stdout.strip() or None


def safe_environment(environ) -> dict[str, str]:
    """The variables that decide how the device and compiler behave (Neuron, EFA, the studio's,
    Inductor's); never one whose name says it is a secret, and no value holding a Hub token."""
    kept = {}
    for name, value in sorted(environ.items()):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) or name in HUB_TOKENS:
            continue
        if any(word in name.upper() for word in SECRET_WORDS):
            continue
        kept[name] = scrub(value)
    return kept


def scrub(text: str) -> str:
    """`text` without a Hub token in it: the ones set in this environment, and any hf_... value."""
    for name in HUB_TOKENS:
        secret = os.environ.get(name)
        if secret and len(secret) >= 8:
            text = text.replace(secret, "<hidden>")
    return TOKEN_VALUE.sub("<hidden>", text)


def write_report(report: dict, folder: Path) -> Path:
    """smoke-report.json and its readable smoke-report.md in `folder`; the JSON file's path."""
    text = scrub(json.dumps(report, indent=2, default=str))
    path = folder / f"{REPORT}.json"
    path.write_text(text + "\n")
    (folder / f"{REPORT}.md").write_text(render(json.loads(text)))
    return path


def render(report: dict) -> str:
    """The report as Markdown: the verdict, a table of the steps, then what the machine runs."""
    lines = [f"# Studio smoke test: {'PASSED' if report['passed'] else 'FAILED'}", "",
             f"{report['started']}, {report['seconds']} s; {report['folder']}", "",
             "| step | result | seconds | found / error |", "|---|---|---|---|"]
    for step in report["steps"]:
        said = (step["error"] or step["found"]).replace("|", "\\|").replace("\n", " ")
        result = "running" if step["ok"] is None else "PASS" if step["ok"] else "**FAIL**"
        lines.append(f"| {step['name']} | {result} | {step['seconds']} | {said} |")
    lines += ["", "## Versions", "", *[f"- {k}: {v}" for k, v in report["versions"].items()], "",
              "## Hardware", "", "```", json.dumps(report["hardware"], indent=2), "```", "",
              "## Compile cache entries (before, after)", "", "```", json.dumps(report["compile_cache"], indent=2),
              "```", "", "## Environment (Neuron, EFA, studio, compiler)", "",
              *([f"- {k}={v}" for k, v in report["env"].items()] or ["(none set)"]), ""]
    return "\n".join(lines)


def verdict(steps: list[Step]) -> str:
    failed = [s.name for s in steps if s.ok is False]
    return "all smoke steps passed" if not failed and len(steps) == len(STEPS) else (
        f"{len(failed)} smoke step(s) failed: {', '.join(failed)}")

