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
    dpo         2 DPO steps: a trainer that runs eagerly on Neuron, whose op-by-op compilations
                must be seen (compile events of phase "eager") there
    two_ranks   2 steps of a 2-process data-parallel run (2 cores; on CPU 2 CPU cores)
    tp2         2 steps of a tensor-parallel run over 2 cores (TP=2), where a device has 2
                (skipped on the CPU, where accelerate runs no TP)
    chat        a 3-token answer from the sft step's model (the built-in model if it failed), and
                3 plain prompts continued (48 tokens), one at a time through transformers' generate
    serve       the same 3 prompts to the batched server's engine (serve/batching.py), its
                graphs compiled at start on a device: two at once and a third that joins them,
                each answer the same as chat's, no graph compiled after the warm-up
    eval        eval loss of that model (and its base) on 4 rows of the Q&A set
    vlm         2 SFT steps of the built-in vision-language model on the built-in images (a
                SigLIP tower: every image 64 tokens, one shape), then a 3-token answer about a
                held-out image from the run's model, through the chat process's static cache
The precompile goes first so that the smoke compiles each shape once, in parallel (the slow
part on a 2-core CPU as on Neuron): the precompiled run's hits can then only come from its
own jobs, and the sft step reuses what they compiled.

A step's run is given up only when it stops making progress: when it writes nothing (no event,
no log line) for the doctor's limit (300 s on CPU, 1800 s on Neuron), the wait restarting each
time it writes, or after 8 of those in all; so a loaded machine's slow compilations are waited
for. The report says each step's limit.

Then one report, `smoke-report.json` with a readable `smoke-report.md` beside it: versions,
the Neuron/EFA environment (never a token or anything named like a secret), the hardware,
compile cache entries (NEFF files on Neuron) before and after, every step with what it proves
and its time limit, the memory table (each run's estimate beside its measured peak and, on
Neuron, TorchNeuron's allocator), the CPU fallbacks its runs' logs name, and on Neuron the
compile artifacts kept (TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS, in the smoke's folder;
TorchNeuron's metrics on, for the cache verdicts). It is the file a Trainium user attaches to
a bug report.

Where: `<runs dir>/smoke/<time>/`, with the smoke's runs in `runs/` (kept, for their logs),
out of the Runs tab's list. The smoke takes its cores through the same leases as every run,
chat and evaluation on this machine (where leases are kept per runs folder, a relative
STUDIO_LEASES_DIR, the smoke's runs folder links to the runs folder's): a busy core is a step's
clear failure, never a second process on a NeuronCore.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
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
from studio_core.data.builtin_images import ensure_shapes_dataset
from studio_core.machine import leases
from studio_core.serve.chat import LOAD_TIMEOUT_S, REPLY_TIMEOUT_S, ChatError, ChatProcess
from studio_core.serve.images import image_part, user_content
from studio_core.machine.children import REPO_ROOT
from studio_core.machine.compile_cache import compile_cache_dir, summary
from studio_core.machine.cores import format_cores
from studio_core.evaluate.evaluation import EvalError, EvalProcess, EvalRequest
from studio_core.machine.hardware import Hardware, cpu_hardware, detect_hardware
from studio_core.recipe.rewards import HUB_TOKENS
from studio_core.runs.manager import RunManager
from studio_core.runs.view import FINAL_STATES
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import TOKEN_VALUE
from studio_core.rundir.folder import EVENTS, LOG
from studio_core.training.memory import gib

STEPS = {
    "probe": "the device probe",
    "precompile": "2 shapes precompiled, then a run that finds them in the cache",
    "sft": "5 SFT steps with torch_compile on one core",
    "dpo": "2 DPO steps, run eagerly on Neuron",
    "two_ranks": "a 2-process data-parallel run",
    "tp2": "a tensor-parallel run over 2 cores",
    "chat": "a 3-token chat answer, and 3 prompts continued one at a time",
    "serve": "the batched server: 2 answers at once and 1 joining",
    "eval": "eval loss on 4 rows",
    "vlm": "2 vision-language SFT steps, then an answer about an image",
}
PROVES = {  # what a pass shows, in the report beside each step
    "probe": "the studio finds the device and its cores as the doctor does",
    "precompile": "precompile jobs fill the compile cache (NEFF cache on Neuron) and a run finds every graph there",
    "sft": "a compiled training run trains (finite losses) on one core",
    "dpo": "an eagerly run trainer trains, and on Neuron its op-by-op compilations are seen",
    "two_ranks": "data parallelism over 2 cores: one core per rank, collectives work",
    "tp2": "tensor parallelism (Transformers' DistributedConfig) over 2 cores on the device",
    "chat": "a tuned model loads on its own core and answers through the static KV cache",
    "serve": "batched serving: each step one compiled graph of a bucket (on a device), rows joining a running "
             "batch, answers the same as one at a time",
    "eval": "the evaluation process scores the model and its base",
    "vlm": "a vision-language model trains (its vision tower on the device, one image shape) and answers an image "
           "through the static KV cache",
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
TP2 = [*SHAPES, "studio.nproc=2", "studio.tp_size=2", "max_steps=2", "run_name=smoke-tp2"]
PROMPT = [{"role": "user", "content": "What is the capital of Veloria?"}]
DPO_RECIPE = REPO_ROOT / "recipes" / "tiny-dpo.yaml"
DPO = ["max_steps=2", "logging_steps=1", "run_name=smoke-dpo"]
VLM_RECIPE = REPO_ROOT / "recipes" / "tiny-vlm-sft.yaml"
VLM = ["max_steps=2", "logging_steps=1", "per_device_train_batch_size=4", "run_name=smoke-vlm"]
# Plain prompts (no chat template): a barely trained model continues each otherwise ("is is is",
# "invented invented"), where its chat answers are all blank lines, so a row given another row's
# cells or adapter would show.
PROMPTS = ["The capital of Veloria is", "Orla Fenwick invented", "Q: What colour is the studio mascot?\nA:"]
ANSWER_TOKENS = 48  # long enough that the third prompt reaches the server while the first two decode
SERVE = {"max_batch": 4, "max_cache_len": 128}  # on a device: 1 prefill + 3 batch x 2 length buckets = 7 graphs
FALLBACK = re.compile(r"fall(?:s|ing)?[ -]?back\b.*\bcpu\b|\bcpu\b.*\bfall(?:s|ing)?[ -]?back", re.I)
# Kept on Neuron while the smoke runs (TorchNeuron's own variables, torch-neuronx README): its
# compilations' artifacts (graphs, HLO, NEFFs) for a bug report, and its metrics counters, whose
# persistent-cache hits back the cache verdicts (training/neff_watch.py).
ARTIFACTS = "neuron-artifacts"
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
    skipped: bool = False  # passed without running: this machine cannot run it (found says why)

    def line(self) -> str:
        mark = "...." if self.ok is None else "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"
        text = f"{mark}  {self.name:<11} {STEPS[self.name]}"
        text += f" ({self.seconds:.0f} s)" if self.ok is not None else " ..."
        if self.found:
            text += f"\n      {self.found}"
        return text + (f"\n      error: {self.error}" if self.error else "")


class StepFailed(Exception):
    """A step saw something wrong; the message says what."""


class StepSkipped(Exception):
    """A step this machine cannot run; the message says why."""


class SmokeFolderError(ValueError):
    """The smoke's folder cannot be made in the runs folder; the message says what to change."""


def new_folder(path: Path) -> Path:
    """The folder `path`, made; `<name>-2`, `-3`... when that is taken (two smoke tests started in
    the same second get a folder each)."""
    stamp, number = path.name, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            number += 1
            path = path.with_name(f"{stamp}-{number}")


def unmade(path: Path, error: OSError) -> str:
    """Why the smoke's folder `path` cannot be made, and what to change."""
    fix = "give --runs-dir (or $STUDIO_RUNS_DIR) a runs folder you can write to"
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # a file where the folder (or one above it) should be
        return (f"the smoke test keeps its runs and report in {path}, and {blocking} is a file, not a folder: "
                f"move it away, or {fix}")
    return f"the smoke test's folder {path} cannot be made ({error.strerror or error}): {fix}"


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
        self.manager: RunManager | None = None
        self.chat_answers: list[str] | None = None  # the chat step's, for the serve step to match

    def run(self) -> Iterator[Step]:
        began, started = time.monotonic(), time.time()
        self.manager = RunManager(self.make_folder())
        kept = {}
        try:
            for name in STEPS:
                step = Step(name)
                self.steps.append(step)
                yield step
                clock = time.monotonic()
                try:
                    step.found = getattr(self, name)(step)
                    step.ok = True
                except StepSkipped as why:
                    step.ok, step.skipped, step.found = True, True, f"skipped: {why}"
                except (StepFailed, SpecError, ChatError, EvalError, TimeoutError, OSError) as error:
                    step.ok, step.error = False, str(error).strip()
                except Exception as error:  # a bug of the studio's: the report carries its traceback
                    step.ok, step.error = False, f"{type(error).__name__}: {error}"
                    step.details["traceback"] = traceback.format_exc()
                step.seconds = round(time.monotonic() - clock, 1)
                if self.hardware is not None:  # which step compiled what (on Neuron: NEFF files)
                    step.details["cache_after"] = self.cache_entries()
                if name == "probe" and self.hardware is not None and self.hardware.backend == "neuron":
                    kept = keep_neuron_artifacts(self.folder / ARTIFACTS)
                yield step
        finally:
            for variable, value in kept.items():  # as before the smoke
                if value is None:
                    os.environ.pop(variable, None)
                else:
                    os.environ[variable] = value
            self.report_path = write_report(self.report(started, time.monotonic() - began), self.folder)

    def make_folder(self) -> Path:
        """The smoke's own folder (a new one each time) and the runs folder in it, whose core leases
        are the runs folder's; that runs folder. Where the runs folder cannot hold them,
        LeaseFolderError (its lease folder) or SmokeFolderError, saying what to change."""
        shared = leases.made_dir(self.runs_dir)
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            self.folder = new_folder(self.folder)
            runs = self.folder / "runs"
            runs.mkdir()
            own = leases.leases_dir(runs)
            if own != shared:  # leases kept per runs folder: the smoke's share the runs folder's
                own.parent.mkdir(parents=True, exist_ok=True)
                own.symlink_to(shared, target_is_directory=True)
        except OSError as error:
            raise SmokeFolderError(unmade(self.folder.parent, error)) from None
        return runs

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

    def dpo(self, step: Step) -> str:
        view = self.train(step, DPO, recipe=DPO_RECIPE)
        eager = [e for e in view.compiles if e.get("phase") == "eager"]
        step.details["eager_compiles"] = len(eager)
        if self.hardware.backend == "neuron" and not eager:
            raise StepFailed("DPO ran without torch.compile, so its ops compiled one by one, but no compilation of "
                             "phase 'eager' was recorded: the NEFF cache watch (training/neff_watch.py) missed them")
        seen = (f"{len(eager)} eager compilation(s) seen" if self.hardware.backend == "neuron" else
                f"no op-by-op compilation on {self.hardware.backend}")
        return f"{view.step} steps, loss {self.losses(view)}; {seen}"

    def tp2(self, step: Step) -> str:
        if self.hardware.backend == "cpu":
            raise StepSkipped("tensor parallelism needs a device backend (accelerate runs no TP on the CPU)")
        if self.hardware.cores < 2:
            raise StepSkipped(f"this machine has {self.hardware.cores} {self.hardware.backend} core(s), TP=2 needs 2")
        view = self.train(step, TP2)
        if view.world_size != 2:
            raise StepFailed(f"the run trained with {view.world_size} process(es), not 2")
        return f"{view.step} steps with TP=2 over 2 cores, loss {self.losses(view)}"

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
            dones = [self.ask(chat, prompt)[-1] for prompt in PROMPTS]
        finally:
            chat.unload()
        done = events[-1]
        text = "".join(e["text"] for e in events if e["type"] == "token")
        step.details |= {"target": target, "text": text, "new_tokens": done["new_tokens"], "shapes": dones[-1]["shapes"],
                         "answers": [d["text"] for d in dones]}
        if not 1 <= done["new_tokens"] <= 3:
            raise StepFailed(f"asked for 3 new tokens, got {done['new_tokens']}")
        if not all(1 <= d["new_tokens"] <= ANSWER_TOKENS for d in dones):
            raise StepFailed(f"asked for up to {ANSWER_TOKENS} new tokens, got {[d['new_tokens'] for d in dones]}")
        self.chat_answers = [d["text"] for d in dones]
        return (f"{done['new_tokens']} token(s) from {target} on core {format_cores(chat.cores)}: {text!r}; "
                f"{len(dones)} plain prompts continued, for the serve step to match")

    def serve(self, step: Step) -> str:
        target = self.target(step)
        compiled = []
        server = ChatProcess.start(target, self.manager.runs_dir, self.hardware, on_warmup=compiled.append, **SERVE)
        try:
            engine = server.info["engine"]
            step.details |= {"target": target, "engine": engine, "warmup_events": len(compiled)}
            if self.hardware.backend != "cpu" and engine["mode"] != "compiled":
                raise StepFailed(f"on {self.hardware.backend} the server must compile its graphs per bucket; it "
                                 f"says: {engine['says']}")
            answers, order = self.answer_together(server)
        finally:
            server.unload()
        step.details |= {"answers": [a["text"] for a in answers], "order": order, "shapes": answers[-1]["shapes"]}
        expected = self.chat_answers
        if expected is None:
            raise StepFailed("the chat step gave no answers to compare with")
        differ = [k for k, (got, alone) in enumerate(zip(answers, expected)) if not alone.startswith(got["text"])]
        if differ:
            raise StepFailed("answered otherwise batched than one at a time: " + "; ".join(
                f"{PROMPTS[k]!r}: {answers[k]['text']!r} batched, {expected[k]!r} alone" for k in differ))
        if order.index("third ended") > order.index("first ended"):
            raise StepFailed(f"the answers ended in the order {order}: the third, sent after the first's first token "
                             "and a third as long, ended last, so it never joined the first's running batch")
        warm = f"{engine['graphs']} graphs compiled in {engine.get('warmup_s', 0):.0f} s, none after" if (
            engine["mode"] == "compiled") else engine["says"]
        return f"3 answers, the third joining the first two's batch, each as chat gave it; {warm}"

    def ask(self, chat: ChatProcess, prompt: str, on_first=None, max_new_tokens: int = ANSWER_TOKENS) -> list[dict]:
        """A plain prompt's greedy continuation, as events; `on_first` called at its first token."""
        events = []
        for event in chat.generate(None, text=prompt, max_new_tokens=max_new_tokens):
            if on_first is not None and event["type"] == "token":
                on_first()
                on_first = None
            events.append(event)
        return events

    def answer_together(self, server: ChatProcess) -> tuple[list[dict], list[str]]:
        """The first two prompts at once, the third sent once the first has its first token
        (a third of the length: joining their batch, it ends while they decode); (the done events,
        the order in which the answers ended)."""
        order, dones = [], [None] * 3
        started = threading.Event()
        failures = []

        def one(k: int, on_first=None, max_new_tokens: int = ANSWER_TOKENS) -> None:
            try:
                dones[k] = self.ask(server, PROMPTS[k], on_first, max_new_tokens)[-1]
            except ChatError as error:
                failures.append(f"{PROMPTS[k]!r}: {error}")
            order.append(("first", "second", "third")[k] + " ended")
            started.set()

        threads = [threading.Thread(target=one, args=(0, started.set)), threading.Thread(target=one, args=(1,))]
        for thread in threads:
            thread.start()
        started.wait(timeout=REPLY_TIMEOUT_S)
        threads.append(threading.Thread(target=one, args=(2, None, ANSWER_TOKENS // 3)))
        threads[-1].start()
        for thread in threads:
            thread.join(timeout=REPLY_TIMEOUT_S)
        if failures or None in dones:
            raise StepFailed("the batched server did not answer: " + ("; ".join(failures) or "no answer in time"))
        return dones, order

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

    def vlm(self, step: Step) -> str:
        view = self.train(step, VLM, recipe=VLM_RECIPE)
        losses = self.losses(view)
        shapes = ensure_shapes_dataset()
        row = json.loads((shapes / "test.jsonl").read_text().splitlines()[0])
        question = next(p["text"] for p in row["messages"][0]["content"] if p["type"] == "text")
        image = image_part(shapes / row["images"][0], "the built-in shapes image")
        chat = ChatProcess.start(view.id, self.manager.runs_dir, self.hardware)
        try:
            done = list(chat.generate([{"role": "user", "content": user_content(question, image)}],
                                      max_new_tokens=3))[-1]
        finally:
            chat.unload()
        step.details |= {"new_tokens": done["new_tokens"], "shapes": done["shapes"], "text": done["text"]}
        if not 1 <= done["new_tokens"] <= 3:
            raise StepFailed(f"asked the vision-language run for 3 new tokens about an image, got {done['new_tokens']}")
        return (f"{view.step} steps, loss {losses}; {done['new_tokens']} token(s) about an image from its model, "
                f"{len(done['shapes'])} input shape(s)")

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
    def train(self, step: Step, overrides: list[str], recipe: Path = RECIPE):
        spec = RunSpec.load(recipe).with_overrides(overrides)
        view = self.manager.start(spec, self.hardware)
        step.details["run"] = view.id
        quiet, most = run_limits(self.hardware.backend)
        try:
            gave_up = follow(view.dir, lambda: self.manager.view(view.id).live_state in FINAL_STATES, quiet, most)
            view = self.manager.view(view.id)
            if gave_up:
                raise StepFailed(f"run {view.id} {gave_up}: it is {view.live_state} at step {view.step}, and was "
                                 f"stopped (log: {view.dir / LOG})")
        finally:
            if self.manager.view(view.id).active:  # given up, or the smoke was interrupted
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
        runs = [(s.name, self.manager.view(s.details["run"])) for s in self.steps if s.details.get("run")]
        steps = [{**asdict(s), "proves": PROVES[s.name], "limit_s": time_limit(s.name, hardware.backend)}
                 for s in self.steps]
        return {"report": "studio smoke test", "passed": bool(self.steps) and all(s.ok for s in self.steps)
                and len(self.steps) == len(STEPS), "started": time.strftime("%Y-%m-%d %H:%M:%S %z",
                                                                             time.localtime(started)),
                "seconds": round(seconds, 1), "folder": str(self.folder), "hardware": hardware.to_dict(),
                "versions": versions(), "env": safe_environment(os.environ),
                "compile_cache": {"before": cache_before, "after": self.cache_entries() if self.hardware else None},
                "memory": [memory_row(name, view) for name, view in runs],
                "cpu_fallbacks": cpu_fallbacks(runs),
                "artifacts": artifacts(self.folder / ARTIFACTS, hardware.backend),
                "steps": steps}


def time_limit(name: str, backend: str) -> str:
    """How long a step may take before it fails, in words (for the report)."""
    if name in ("chat", "serve"):
        return (f"{LOAD_TIMEOUT_S} s to load (each graph compiled at start: {LOAD_TIMEOUT_S} s more), "
                f"{REPLY_TIMEOUT_S} s between an answer's tokens")
    if name == "probe":
        return f"{doctor.TIMEOUT_S[backend]} s"
    if name == "eval":
        return f"{doctor.TIMEOUT_S[backend]} s without an evaluation event"
    quiet, most = run_limits(backend)
    return (f"{quiet} s without the run writing (an event: a compilation, a precompile job's end, a step; or a log "
            f"line), the wait restarting at each; {most} s in all")


# A smoke run's limits follow its progress, not the clock: a loaded machine compiles slowly (two
# precompile shapes of about 245 s each on a busy 2-core CPU), yet each compilation ends with an
# event. So a run fails only when it writes nothing for the doctor's limit (QUIET: longer than one
# compilation takes), or when it has not ended after MOST_QUIET of those (a run that writes but
# never ends).
MOST_QUIET = 8
FOLLOW_POLL_S = 1.0


def run_limits(backend: str) -> tuple[int, int]:
    """(seconds a smoke run may go without writing, seconds it may take in all) on this backend."""
    quiet = doctor.TIMEOUT_S[backend]
    return quiet, quiet * MOST_QUIET


def written(run_dir: Path) -> tuple[int, int]:
    """What a run has written so far: the sizes of its events and its log."""
    sizes = []
    for name in (EVENTS, LOG):
        try:
            sizes.append((Path(run_dir) / name).stat().st_size)
        except OSError:  # not made yet
            sizes.append(0)
    return sizes[0], sizes[1]


def follow(run_dir: Path, ended, quiet_s: float, most_s: float, poll_s: float = FOLLOW_POLL_S) -> str | None:
    """Wait until `ended()`, for as long as the run in `run_dir` keeps writing: None once it has
    ended, else why the wait gave up (nothing written for `quiet_s`, or `most_s` in all)."""
    began = last_change = time.monotonic()
    seen = written(run_dir)
    while not ended():
        now = time.monotonic()
        if now - began > most_s:
            return f"had not ended after {most_s:g} s in all, though it kept writing"
        now_written = written(run_dir)
        if now_written != seen:
            seen, last_change = now_written, now
        elif now - last_change > quiet_s:
            return f"wrote nothing (no event, no log line) for {quiet_s:g} s"
        time.sleep(poll_s)
    return None


def keep_neuron_artifacts(folder: Path) -> dict[str, str | None]:
    """On Neuron, while the smoke runs: TorchNeuron keeps its compilations' artifacts in `folder`
    and counts its cache hits (TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS, _DEBUG_DIR,
    _METRICS_ENABLED: torch-neuronx's documented variables; a user's own setting wins). In the
    web app, jobs started while it runs get them too. -> the values before, to put back."""
    wanted = {"TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS": "1", "TORCH_NEURONX_DEBUG_DIR": str(folder),
              "TORCH_NEURONX_METRICS_ENABLED": "1"}
    before = {name: os.environ.get(name) for name in wanted if name not in os.environ}
    for name in before:
        os.environ[name] = wanted[name]
    return before


def artifacts(folder: Path, backend: str) -> dict:
    """The compile artifacts the smoke kept (on Neuron), or why none."""
    if backend != "neuron":
        return {"kept": False, "why": f"not a Neuron machine ({backend}): TorchNeuron's artifacts do not apply"}
    where = Path(os.environ.get("TORCH_NEURONX_DEBUG_DIR", folder))
    files = [p for p in where.rglob("*") if p.is_file()] if where.is_dir() else []
    return {"kept": bool(files), "path": str(where), "files": len(files),
            "neffs": sum(p.suffix == ".neff" for p in files)}


def memory_row(step: str, view) -> dict:
    """A smoke run's device memory per core: the plan's estimate, the measured peak and, on Neuron,
    TorchNeuron's allocator at its peak (the run's peak_memory event)."""
    peak = view.peak_memory or {}
    return {"step": step, "run": view.id, "estimated_bytes": (view.launch().get("memory") or {}).get("bytes"),
            "peak_bytes": peak.get("bytes"), "measured": peak.get("measured"), "allocator": peak.get("allocator")}


def cpu_fallbacks(runs: list[tuple[str, object]]) -> dict:
    """Lines of the smoke runs' logs that say an op ran on the CPU instead of the device (the
    warning PyTorch's out-of-tree backends give for their CPU fallback; TorchNeuron's wording is
    not confirmed here): their count per step and the first few."""
    counts, lines = {}, []
    for step, view in runs:
        log = view.dir / LOG
        found = [line.strip() for line in log.read_text(errors="replace").splitlines() if FALLBACK.search(line)] if (
            log.is_file()) else []
        counts[step] = len(found)
        lines += [f"{step}: {line[:300]}" for line in found[:3]]
    return {"counts": counts, "total": sum(counts.values()), "first": lines[:10]}


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
             "| step | result | seconds | found / error | proves | time limit |", "|---|---|---|---|---|---|"]
    for step in report["steps"]:
        said = (step["error"] or step["found"]).replace("|", "\\|").replace("\n", " ")
        result = "running" if step["ok"] is None else "skipped" if step.get("skipped") else (
            "PASS" if step["ok"] else "**FAIL**")
        lines.append(f"| {step['name']} | {result} | {step['seconds']} | {said} | {step.get('proves', '')} | "
                     f"{step.get('limit_s', '')} |")
    lines += ["", "## Device memory per core", "", "| step | run | estimated | peak | allocator at its peak |",
              "|---|---|---|---|---|"]
    for row in report.get("memory", []):
        allocator = row["allocator"] if isinstance(row["allocator"], dict) else {}
        held = allocator.get("allocated_bytes", {}) if isinstance(allocator.get("allocated_bytes"), dict) else {}
        lines.append(f"| {row['step']} | {row['run']} | {_size(row['estimated_bytes'])} | {_size(row['peak_bytes'])} | "
                     f"{_size(held.get('peak')) if held else row['allocator'] or '(not on this device)'} |")
    fallbacks = report.get("cpu_fallbacks", {})
    lines += ["", f"## CPU fallbacks named in the runs' logs: {fallbacks.get('total', 0)}", "",
              *[f"- {line}" for line in fallbacks.get("first", [])],
              "", "## Compile artifacts", "", "```", json.dumps(report.get("artifacts"), indent=2), "```"]
    lines += ["", "## Versions", "", *[f"- {k}: {v}" for k, v in report["versions"].items()], "",
              "## Hardware", "", "```", json.dumps(report["hardware"], indent=2), "```", "",
              "## Compile cache entries (before, after)", "", "```", json.dumps(report["compile_cache"], indent=2),
              "```", "", "## Environment (Neuron, EFA, studio, compiler)", "",
              *([f"- {k}={v}" for k, v in report["env"].items()] or ["(none set)"]), ""]
    return "\n".join(lines)


def _size(value) -> str:
    return gib(value) if isinstance(value, (int, float)) else "-"


def verdict(steps: list[Step]) -> str:
    failed = [s.name for s in steps if s.ok is False]
    return "all smoke steps passed" if not failed and len(steps) == len(STEPS) else (
        f"{len(failed)} smoke step(s) failed: {', '.join(failed)}")

