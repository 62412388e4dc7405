"""Chat with a run's model, or any model, in a chat process of its own.

The model lives in `studio_core.serve.chat_worker`, a child process, never in the web app:
the app stays light, and Unload gives the memory and the cores back. The chat takes
its core through the same leases as training runs (kind "chat"): a core a run holds is
refused with the run's name, and a run cannot take the chat's core.

    chat = ChatProcess.start("20261130-...-tiny-sft-1a2b3c", runs_dir, hardware)
    for event in chat.generate([{"role": "user", "content": "Hi"}]):
        ...  # {"type": "token", "text": ...} as they come, then {"type": "done", ...}
    chat.unload()

The prompt is rendered as training rendered the turn before an answer (`template_kwargs`:
Qwen3's template needs enable_thinking=False for that). What a model writes is shown through
`split_reasoning` and `shown`: a <think>...</think> block apart from the answer, no tags,
no runs of blank lines, and a placeholder for an empty answer.

No torch import here: this module runs in the web app's process.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from studio_core.machine import children, leases
# the batch sizes a server decodes at (--max-batch); the smallest prompt bucket
from studio_core.serve.batching import BATCH_BUCKETS, SMALLEST_LENGTH, EnginePlan, engine_plan
from studio_core.serve.row_adapters import config_problem
from studio_core.data import model_check
from studio_core.data.sources import BUILTIN_MODELS, builtin_folder, check_model, is_vision_model
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.machine.device_env import device_env, flags_problem
from studio_core.machine.hardware import Hardware
from studio_core.rundir import folder

MAX_CACHE_LEN = 1024  # the static cache's fixed length: prompt bucket + answer must fit
LOAD_TIMEOUT_S = 600
REPLY_TIMEOUT_S = 600
HALT_POLL_S = 0.1  # how often a generation waiting for its next event looks whether it was halted
THINK, END_THINK = "<think>", "</think>"
EMPTY_ANSWER = "(empty answer: the model produced only special tokens or whitespace)"
UNTRAINED = "untrained: a built-in model is randomly initialised, so its answers are noise or empty"


class ChatError(ValueError):
    """The chat cannot start or answer; the message says what to change. `code`: what kind of
    failure, where the chat process says (context_length_exceeded)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ChatTarget:
    label: str  # what the user picked: a run id or a model
    model: str  # the folder or Hub id to load
    tokenizer: str
    adapter: str | None = None  # a LoRA run's adapter folder, on `model`
    base: str | None = None  # a full run's base model, for side by side
    trust_remote_code: bool = False
    untrained: tuple[str, ...] = ()  # the sides ("tuned", "base") that are the random built-in model
    vision: bool = False  # a vision-language model: loaded with its processor, its messages may hold images
    image_size: int | None = None  # a run's studio.image_size: its images resized to it, as in training


def resolve(name: str, runs_dir: str | Path) -> ChatTarget:
    """A run id (its saved model or adapter) or a model (builtin, Hub id, local folder), which is
    checked as a run's model is before launch (sources.check_model); ChatError says what is wrong."""
    name = name.strip()
    if not name:
        raise ChatError("pick a finished run or name a model (a Hub id or a local folder)")
    run_dir = Path(runs_dir).expanduser() / name
    outside = next((p for p in (Path(name).expanduser(), run_dir) if not folder.is_run_id(name) and folder.is_run(p)),
                   None)
    if outside is not None:
        outside = outside.resolve()
        raise ChatError(f"{name} is a run folder, not a run id of {runs_dir}: give its id {outside.name} with its "
                        f"runs folder (--runs-dir {outside.parent}), or its model folder {outside / folder.OUTPUT}")
    if folder.is_run_id(name) and folder.is_run(run_dir):
        try:
            spec = folder.read_spec(run_dir)  # a damaged run folder is named the way every command names it
        except folder.DamagedRun as error:
            raise ChatError(str(error)) from None
        output = run_dir / folder.OUTPUT
        info = folder.output_info(run_dir)
        if info is None:
            raise ChatError(f"run {name} has no saved model yet (it saves when training finishes); pick a "
                            "finished run")
        if info.get("task", "text-generation") != "text-generation":
            raise ChatError(f"run {name} trained a reward model: it gives a text a score and does not write "
                            "answers, so there is nothing to chat with; export it to use it")
        vision = model_check.is_vision(model_check.read_config(output / "config.json")[0] or {}) or (
            info["kind"] == "adapter" and is_vision_model(info["base_model"]))
        image_size = (spec.get("studio") or {}).get("image_size") if vision else None
        base = _model_path(info["base_model"])
        untrained = ("base",) if info["base_model"] in BUILTIN_MODELS else ()
        problems = model_check.output_problems(output, adapter=info["kind"] == "adapter")
        if problems:
            raise ChatError(f"run {name}'s saved model in {output} cannot be loaded: {'; '.join(problems)}")
        if info["kind"] == "adapter":  # and its base, checked as a run's model is before launch
            problems = check_model(info["base_model"], bool(spec.get("trust_remote_code")))
            if problems:
                said = "; ".join(p.removeprefix("model_name_or_path: ") for p in problems)
                raise ChatError(f"run {name} is a LoRA adapter on {info['base_model']}, which cannot be loaded: "
                                f"{said}")
            return ChatTarget(name, model=base, tokenizer=str(output), adapter=str(output), base=base,
                              untrained=untrained, vision=vision, image_size=image_size)
        return ChatTarget(name, model=str(output), tokenizer=str(output), base=base, untrained=untrained,
                          vision=vision, image_size=image_size)
    if name not in BUILTIN_MODELS and "/" not in name and not Path(name).exists():
        raise ChatError(f"{name!r} is neither a run in {runs_dir} nor a model folder or Hub id (org/name)")
    problems = check_model(name)  # as a run's model is checked before launch: before a process loads it
    if problems:
        raise ChatError("\n".join(p.removeprefix("model_name_or_path: ") for p in problems))
    path = _model_path(name)
    return ChatTarget(name, model=path, tokenizer=path, untrained=("tuned",) if name in BUILTIN_MODELS else (),
                      vision=is_vision_model(name))


def adapters_of(first: ChatTarget, others: list[ChatTarget], max_batch: int) -> dict[str, str]:
    """{model name: adapter folder} of runs served together: LoRA runs on one base, batched;
    ChatError saying what to do otherwise (a full or merged run is served on its own)."""
    targets = [first, *others]
    names = [target.label for target in targets]
    if len(set(names)) < len(names):
        raise ChatError(f"{', '.join(names)}: a run is named twice; name each run once")
    whole = [target.label for target in targets if not target.adapter]
    if whole:
        raise ChatError(f"{', '.join(whole)}: several runs are served together only as LoRA adapters on one base; "
                        "a full run (or a model) is served by a `launch.py serve` of its own")
    bases = {target.model for target in targets}
    if len(bases) > 1:
        raise ChatError(f"{', '.join(names)}: these adapters were trained on different base models "
                        f"({', '.join(sorted(bases))}); serve the runs of each base together, each base by a "
                        "`launch.py serve` of its own")
    if max_batch == 1:
        raise ChatError("several runs are served with batching on: leave out --max-batch 1")
    return {target.label: target.adapter for target in targets}


def served(names: list[str], runs_dir: str | Path, max_batch: int) -> tuple[ChatTarget, dict[str, str]]:
    """The first of the runs (or models) a server answers for, and {model name: adapter folder} of
    its LoRA runs (adapters_of; {} for a full run or a model alone)."""
    first = resolve(names[0], runs_dir)
    others = [resolve(other, runs_dir) for other in names[1:]]
    adapters = adapters_of(first, others, max_batch) if others else (
        {first.label: first.adapter} if first.adapter else {})
    return first, adapters


def serve_plan(name: str, runs_dir: str | Path, backend: str, max_cache_len: int, max_batch: int,
               also: tuple[str, ...] = (), compiled: bool = False) -> EnginePlan:
    """How `launch.py serve` would answer for these runs (serve/batching.py's plan), read from their
    folders, nothing loaded; the loaded model's own check decides at start."""
    _, adapters = served([name, *also], runs_dir, max_batch)
    return engine_plan(backend, max_batch, max_cache_len, compiled, config_problem(list(adapters.values())))


def _model_path(name: str) -> str:
    """Where a model loads from: a built-in one's folder (sources.builtin_folder), else its name."""
    return str(builtin_folder(name) or name)


def template_kwargs(tokenizer) -> dict:
    """The chat template's arguments that make a prompt end where training put the answer.

    TRL's SFTTrainer renders a conversation with the tokenizer's own template and no
    arguments (only a row's `chat_template_kwargs`); Qwen3's then writes the last answer after
    an empty `<think>\n\n</think>\n\n`, and a generation prompt ends there only with
    enable_thinking=False. The first arguments whose prompt plus the answer begins the
    rendered conversation win."""
    if not tokenizer.chat_template:
        return {}
    turns = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    trained = tokenizer.apply_chat_template(turns, tokenize=False)
    for kwargs in ({}, {"enable_thinking": False}):
        prompt = tokenizer.apply_chat_template(turns[:1], add_generation_prompt=True, tokenize=False, **kwargs)
        if trained.startswith(prompt + "A"):
            return kwargs
    return {}


def opens_thinking(tokenizer, kwargs: dict) -> bool:
    """Whether the generation prompt leaves a <think> block open, so answers start inside it."""
    if not tokenizer.chat_template:
        return False
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True,
                                           tokenize=False, **kwargs)
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def split_reasoning(text: str, thinking: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of what a model wrote: text inside <think>...</think> is reasoning,
    the rest the answer, and no tag is kept. `thinking`: the text starts inside a block (the
    prompt opened it). A stray </think> just goes, so a streamed answer only ever grows."""
    parts = {True: [], False: []}
    for piece in re.split(f"({re.escape(THINK)}|{re.escape(END_THINK)})", text):
        if piece in (THINK, END_THINK):
            thinking = piece == THINK
        else:
            parts[thinking].append(piece)
    return "".join(parts[True]), "".join(parts[False])


def shown(text: str) -> str:
    """Text as shown: stripped, a run of blank lines kept as one."""
    return re.sub(r"\n[ \t]*(\n[ \t]*)+\n", "\n\n", text.strip())


class ChatProcess:
    """A running chat process and the pipe to it. One generation at a time, or with `max_batch`
    above 1 (a server's) several at once, answered together in batches (serve/batching.py)."""

    def __init__(self, proc: subprocess.Popen, target: ChatTarget, ready: dict, events: Events,
                 max_batch: int = 1):
        self.proc, self.target, self.info = proc, target, ready
        self.max_batch = max_batch
        self._lock = threading.Lock() if max_batch == 1 else contextlib.nullcontext()
        self._ids = itertools.count(1)
        self._answers: dict[int, queue.Queue] = {}  # each generation's events, by its id
        # the generations whose text goes to a function: [it, their halt, when they last had text]
        self._on_text: dict[int, list] = {}
        self._answers_lock = threading.Lock()
        self._ended = False  # the process's output has ended
        events.route_to(self._route)  # from here each event goes to its generation's queue as it is read

    @classmethod
    def start(cls, name: str, runs_dir: str | Path, hardware: Hardware, cores: str | None = None,
              max_cache_len: int = MAX_CACHE_LEN, max_batch: int = 1, also: tuple[str, ...] = (),
              compiled: bool = False, on_warmup: Callable[[dict], None] = lambda event: None) -> ChatProcess:
        """Resolve the target, take a free core (or the ones asked for), load the model. With
        `max_batch` above 1 the process answers up to that many requests together (the tuned
        model only: a server's; serve/batching.py), its graphs compiled first where the device
        compiles (`on_warmup` gets each {"done", "total"} as it comes; `compiled`: on the CPU too);
        `also`: more LoRA runs on the same base, each its own model name, their requests decoded
        in the same batches (each row its own adapter). `info["engine"]` says how it answers."""
        target, adapters = served([name, *also], runs_dir, max_batch)
        setup = {"target": asdict(target), "max_cache_len": max_cache_len, "kind": "chat", "max_batch": max_batch,
                 "compile": compiled}
        if also:
            setup["adapters"] = adapters
        proc, events, stderr_tail, _ = cls.spawn("studio_core.serve.chat_worker", setup, runs_dir, hardware, cores)
        try:
            first = events.get(timeout=LOAD_TIMEOUT_S)
            while first.get("type") == "warmup":  # each graph compiled: the wait starts again
                on_warmup(first)
                first = events.get(timeout=LOAD_TIMEOUT_S)
        except queue.Empty:
            kill(proc)
            raise ChatError(f"the chat process did not load {target.label} (or compile its next graph) within "
                            f"{LOAD_TIMEOUT_S} s") from None
        if first.get("type") != "ready":
            kill(proc)
            proc.wait()
            message = first.get("message") or "\n".join(stderr_tail[-8:]) or "it exited"
            raise ChatError(f"chat on {target.label}: {message}")
        return cls(proc, target, first, events, first.get("max_batch", max_batch))

    @staticmethod
    def spawn(module: str, setup: dict, runs_dir, hardware: Hardware, cores: str | None, without: tuple = ()):
        """Start a process that loads a model on a core of its own (the chat's, an evaluation's):
        the core is chosen and the process holds its lease before this returns. Its first stdin
        line is `setup` with the runs folder, backend and cores added; its stdout lines are JSON
        events; `without`: environment variables it must not get. Returns (process, event queue, its
        stderr's last lines, the cores)."""
        if flags_problem(hardware):  # the studio's NEURON_CC_FLAGS name another LNC than the runtime's
            raise ChatError(flags_problem(hardware))
        with leases.choosing(runs_dir):  # until the process holds the core chosen here
            chosen = choose_one_core(runs_dir, hardware, cores, "evaluation" if setup["kind"] == "eval" else "chat")
            env = device_env(hardware, compile_cache_root(), chosen)
            proc = children.start(module, env=env, without=without, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
            events = Events()
            stderr_tail: list[str] = []
            threading.Thread(target=_read_events, args=(proc.stdout, events), daemon=True).start()
            threading.Thread(target=_keep_tail, args=(proc.stderr, stderr_tail), daemon=True).start()
            setup = {**setup, "runs_dir": str(Path(runs_dir).expanduser()), "backend": hardware.backend,
                     "cores": chosen}
            proc.stdin.write(json.dumps(setup) + "\n")
            proc.stdin.flush()
            leases.wait_held(runs_dir, hardware.backend, chosen, proc)
        return proc, events, stderr_tail, chosen

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def cores(self) -> list[int]:
        return self.info["cores"]

    @property
    def thinking(self) -> bool:
        """Whether answers start inside a <think> block (for `split_reasoning`)."""
        return self.info["thinking"]

    def generate(self, messages: list[dict] | None, which: str = "tuned", temperature: float = 0.0,
                 top_p: float = 1.0, max_new_tokens: int = 128, halt: threading.Event | None = None,
                 on_text: Callable[[str], None] | None = None, **more):
        """Yield token events as the model writes, then the done event (raises ChatError on failure,
        with `code` "context_length_exceeded" for a prompt too long). `halt`, once set, ends this
        generation after its current token (or before it starts). `on_text`: the new text goes to
        it instead of token events, called in the thread that reads the chat process's output, in
        order, before the done event is yielded (no hop through the caller's thread per token).
        `more`: the chat process's other request fields (text, seed, whole: see chat_worker)."""
        with self._lock:
            if not self.alive:
                raise ChatError("the chat process has ended; load the model again")
            rid, answers = next(self._ids), queue.Queue()
            with self._answers_lock:
                self._answers[rid] = answers
                if on_text is not None:
                    self._on_text[rid] = [on_text, halt, time.monotonic()]
            try:
                self._send({"op": "generate", "id": rid, "which": which, "messages": messages,
                            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, **more})
                yield from self._answer(rid, answers, halt)
            finally:
                with self._answers_lock:
                    self._answers.pop(rid, None)
                    self._on_text.pop(rid, None)

    def _answer(self, rid: int, answers: queue.Queue, halt: threading.Event | None):
        heard, halted = time.monotonic(), False
        while True:
            if halt is not None and halt.is_set() and not halted:
                halted = True
                self._send({"op": "cancel", "id": rid} if self.max_batch > 1 else {"op": "stop"})
            try:
                event = answers.get(timeout=HALT_POLL_S)
            except queue.Empty:
                if self._ended:
                    raise ChatError("the chat process ended while answering (out of memory?)") from None
                taker = self._on_text.get(rid)  # its text, when it goes to on_text, counts as hearing from it
                if time.monotonic() - (max(heard, taker[2]) if taker else heard) >= REPLY_TIMEOUT_S:
                    raise ChatError(f"no answer within {REPLY_TIMEOUT_S} s") from None
                continue
            heard = time.monotonic()
            if event.get("type") == "halted":
                continue  # looked at above, on the next pass
            if event.get("type") == "eof":
                raise ChatError("the chat process ended while answering (out of memory?)")
            if event["type"] == "error":
                raise ChatError(event["message"], event.get("code"))
            yield event
            if event["type"] == "done":
                return

    def _route(self, event: dict) -> None:
        """In the thread that reads the process's output: the event to its generation's queue, or
        its text to the generation's on_text (an event of a generation no longer followed is
        dropped); the process's end to every one."""
        with self._answers_lock:
            if event.get("type") == "eof":
                for answers in self._answers.values():
                    answers.put(event)
                self._ended = True
                return
            if event.get("type") == "tokens":  # a batched step's new text, every request's at once
                pieces = [(int(rid), text) for rid, text in event["pieces"].items()]
            elif event.get("type") == "token":
                pieces = [(event.get("id"), event["text"])]
            else:
                pieces = []
            takers = [(self._on_text.get(rid), self._answers.get(rid), rid, text) for rid, text in pieces]
            answers = self._answers.get(event.get("id")) if not pieces else None
        for taker, queued, rid, text in takers:
            if taker is None:
                if queued is not None:
                    queued.put({"type": "token", "id": rid, "text": text})
                continue
            on_text, halt, _ = taker
            halted = halt is not None and halt.is_set()
            taker[2] = time.monotonic()
            try:
                on_text(text)
            except Exception as error:  # the reading goes on for the others; this generation fails
                if queued is not None:
                    queued.put({"type": "error", "message": f"{type(error).__name__}: {error}"})
                continue
            if queued is not None and halt is not None and halt.is_set() and not halted:
                queued.put({"type": "halted"})  # its generation ends now (a stop string), not at the next look
        if answers is not None:
            answers.put(event)

    def stop_generation(self) -> None:
        """End every running generation after its current token."""
        if self.alive:
            self._send({"op": "stop"})

    def unload(self, timeout: float = 30) -> None:
        """End the chat process: its memory and its cores are free again."""
        if self.alive:
            self._send({"op": "stop"})
            self._send({"op": "quit"})
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill(self.proc)
        self.proc.wait()

    def _send(self, request: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ChatError("the chat process has ended; load the model again") from None


def choose_one_core(runs_dir: str | Path, hardware: Hardware, cores: str | None, kind: str) -> list[int]:
    """A chat's or an evaluation's core (`kind`): the one asked for if free, else the first free one."""
    try:
        return leases.choose(runs_dir, hardware, 1, cores or None)
    except leases.NoFreeCores as none:
        raise ChatError(f"no free {hardware.backend} core for the {kind}: all {none.count} are held "
                        f"({none.holding}); stop one of them first") from none
    except ValueError as error:
        raise ChatError(f"cores: {error}") from error


class Events(queue.Queue):
    """A child process's events, as its output is read: queued, or once `route_to(handle)` is
    called, each handed to `handle` in the reading thread (no hop through another thread)."""

    def __init__(self):
        super().__init__()
        self._handle = None
        self._routing = threading.Lock()

    def put(self, event, block=True, timeout=None) -> None:
        with self._routing:
            if self._handle is None:
                super().put(event, block, timeout)
            else:
                self._handle(event)

    def route_to(self, handle) -> None:
        """Every event from now on (and any queued before) to `handle`, in the order read."""
        with self._routing:
            while not self.empty():
                handle(self.get_nowait())
            self._handle = handle


def _read_events(stream, events: queue.Queue) -> None:
    for line in stream:
        try:
            events.put(json.loads(line))
        except json.JSONDecodeError:
            continue  # a stray print from a library, not an event
    events.put({"type": "eof"})


def _keep_tail(stream, tail: list[str]) -> None:
    for line in stream:
        tail.append(line.rstrip())
        del tail[:-50]


def kill(proc: subprocess.Popen) -> None:
    """Kill the process's whole group (it started a session of its own) and wait a little for it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.time() + 10
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
