"""Runs served by vLLM, started and watched by the studio: `launch.py serve RUN --engine vllm`.

What it serves (`plan`): a full run's saved model folder, as it is (a Transformers folder vLLM
loads directly); LoRA runs of one base as the base once plus each run an adapter
(`--enable-lora --lora-modules RUN=FOLDER`, `--max-loras`, `--max-lora-rank` rounded up to a
rank vLLM accepts). Every run keeps the model name the studio's engine gives it (its run id).
Runs of different bases, or a full run beside LoRA runs, are refused as the studio's engine
refuses them (chat.adapters_of).

How it runs (`VllmServer`): vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`)
from vLLM's own environment (serve/vllm_env.py), in a process group of its own that dies with the
studio's process; its cores leased like a run's (kind "serve", so the core map shows them), the
lease's lock files inherited by the server so the cores stay held while any of it lives; its
output in a log file under `<runs dir>/serve-logs/`; the studio's API key passed in the
environment (VLLM_API_KEY: never on a command line, which other users can read), the host as
given (127.0.0.1 by default). Start waits for /health within a limit; when vLLM ends or does
not answer in time, the message gives its log's last lines. Stop sends SIGTERM to the group and
SIGKILL after a grace, then looks for any process left with the server's marker.

Per device (from vLLM's documentation; only the CPU is exercised here):
  cpu     VLLM_CPU_OMP_THREADS_BIND = the leased CPU, the KV cache sized for max_batch x
          max_model_len (--kv-cache-memory-bytes: vLLM's CPU default reserves 92% of the memory);
          --enforce-eager unless compiled (as the studio's engine is eager on the CPU)
  cuda    CUDA_VISIBLE_DEVICES = the leased GPUs, --tensor-parallel-size their count
  neuron  NEURON_RT_VISIBLE_CORES = the leased cores, --tensor-parallel-size their count, the
          compile buckets in --additional-config's neuron_config (vLLM Neuron's configuration
          reference: num_seqs_buckets, the decode batches, power-of-2 up to --max-num-seqs;
          num_batched_tokens_buckets, the prefill lengths, power-of-2 from 128 up to
          max_num_batched_tokens), its compiled graphs cached under the studio's compile cache
          (VLLM_CACHE_ROOT). Not run on a trn machine here: docs/trainium-first-run.md says what a
          first run must confirm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from studio_core.machine import leases
from studio_core.machine.cache import cache_dir
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.machine.cores import parse_cores
from studio_core.machine.device_env import device_env
from studio_core.machine.procs import die_with_parent, kill_run_processes
from studio_core.rundir.folder import OUTPUT_INFO, file_safe, read_json
from studio_core.serve.chat import ChatError, ChatTarget, served, template_kwargs
from studio_core.serve.vllm_env import SETUP_HINT, VllmEnv, configured_python, find

START_TIMEOUT_S = 900  # a first start on Neuron compiles every bucket
STOP_GRACE_S = 15
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention (cpu_attn.py)
ERROR_LINE = re.compile(r"^(\S+ )?\w*(Error|Exception)\b(: |$)")  # "ValueError: ...", "(Worker) RuntimeError: ..."


@dataclass(frozen=True)
class VllmPlan:
    """What vLLM loads and under which names."""
    model: str  # the folder or Hub id vLLM loads
    name: str  # its model name at /v1
    adapters: dict[str, str] = field(default_factory=dict)  # run id -> adapter folder (LoRA runs)
    max_lora_rank: int | None = None
    config: dict = field(default_factory=dict, repr=False)  # the model's config.json, where readable
    template_kwargs: dict = field(default_factory=dict)  # the chat template's arguments (chat.template_kwargs)

    @property
    def names(self) -> list[str]:
        return [*self.adapters] or [self.name]


def plan(names: list[str], runs_dir: str | Path, max_batch: int) -> VllmPlan:
    """The plan for serving `names` (runs or a model) with vLLM; ChatError saying what to change."""
    first, adapters = served(names, runs_dir, max_batch)
    if first.vision:
        # vLLM's vision models import torchvision, and the package index here has only CUDA builds of it,
        # which fail to load beside vllm-cpu's torch: serving images through vLLM is untried, so not offered
        raise ChatError(f"{first.label} is a vision-language model, which the studio does not hand to vLLM yet "
                        "(vLLM's vision models need a torchvision built for its torch, untried here): serve it "
                        "with --engine studio, which takes its images")
    config = read_json(Path(first.model) / "config.json")
    kwargs = _template_kwargs(first.tokenizer)
    if not adapters:
        return VllmPlan(first.model, first.label, config=config, template_kwargs=kwargs)
    rank = max(_adapter_rank(folder) for folder in adapters.values())
    allowed = next((r for r in LORA_RANKS if r >= rank), None)
    if allowed is None:
        raise ChatError(f"LoRA rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]}): serve these runs "
                        "with --engine studio")
    return VllmPlan(first.model, _base_name(first), adapters, allowed, config, kwargs)


def problem(serving: VllmPlan, env: VllmEnv, backend: str, max_cache_len: int | None = None) -> str | None:
    """Why this vLLM cannot serve the plan (None when it can), read from the configs: nothing loaded."""
    if not env.usable:
        return env.describe()
    if env.device != backend:
        return (f"the vLLM environment is for {env.device}, this machine serves on {backend}: run "
                "`launch.py serve --setup-vllm` on this machine")
    architectures = serving.config.get("architectures") or []
    if architectures and not set(architectures) & set(env.architectures):
        return f"vLLM {env.version} does not serve the {', '.join(map(str, architectures))} architecture"
    text = serving.config.get("text_config") or serving.config
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head_size = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                         and heads > 0 else None)
    if backend == "cpu" and isinstance(head_size, int) and head_size not in CPU_HEAD_SIZES:
        return f"vLLM's CPU attention does not take the model's head size ({head_size})"
    longest = text.get("max_position_embeddings")
    if max_cache_len and isinstance(longest, int) and max_cache_len > longest:
        return (f"the model takes at most {longest} tokens (max_position_embeddings); give --max-cache-len {longest} "
                "or less")
    for run, folder in serving.adapters.items():
        config = read_json(Path(folder) / "adapter_config.json")
        if config.get("use_dora"):
            return f"run {run} is a DoRA adapter, which vLLM does not serve"
        if config.get("modules_to_save"):
            return f"run {run} trains modules whole (modules_to_save), which vLLM's LoRA does not take"
        if config.get("lora_bias") or config.get("bias", "none") != "none":
            return f"run {run} trains LoRA biases, which vLLM's LoRA does not take"
    return None


def decide(requested: str | None, names: list[str], runs_dir: str | Path, backend: str,
           max_batch: int) -> tuple[str, str, VllmEnv | None]:
    """(engine, why, the vLLM environment if one was looked at) for serving `names`: the engine
    asked for, else vLLM when its environment is set up and can serve the runs, else the
    studio's. ChatError when vLLM is asked for and cannot serve them."""
    if requested == "studio":
        return "studio", "asked for", None
    if requested != "vllm" and configured_python()[0] is None:  # nothing to ask vLLM, nor a reason to read the runs
        return "studio", f"vLLM is not set up: {SETUP_HINT}", None
    try:
        serving, why_not = plan(names, runs_dir, max_batch), None
    except ChatError as error:  # a run that cannot be read, or that vLLM cannot take: said without importing vLLM
        serving, why_not = None, str(error)
    env = None
    if why_not is None:  # only now its environment is looked at (its first inspection imports vLLM: seconds)
        env = find()
        why_not = problem(serving, env, backend)
    if requested == "vllm":
        if why_not:
            raise ChatError(f"vLLM cannot serve this: {why_not}. Serve it with --engine studio")
        return "vllm", "asked for", env
    if why_not is None:
        return "vllm", f"{env.describe()} can serve it; --engine studio for the studio's own", env
    return "studio", f"not vLLM: {why_not}", env


class VllmServer:
    """A vLLM OpenAI server the studio started; `stop()` ends every process of it."""

    def __init__(self, proc: subprocess.Popen, lease: leases.CoreLease, url: str, log: Path, serving: VllmPlan,
                 marker: str):
        self.proc, self.lease, self.url, self.log, self.plan, self.marker = proc, lease, url, log, serving, marker

    @classmethod
    def start(cls, names: list[str], runs_dir: str | Path, hardware, env: VllmEnv, host: str, port: int,
              api_key: str | None, max_cache_len: int, max_batch: int, cores: str | None = None,
              compiled: bool = False, timeout: float = START_TIMEOUT_S, on_wait=lambda waited: None) -> VllmServer:
        serving = plan(names, runs_dir, max_batch)
        why_not = problem(serving, env, hardware.backend, max_cache_len)
        if why_not:
            raise ChatError(f"vLLM cannot serve this: {why_not}")
        runs_dir = Path(runs_dir).expanduser()
        wanted = len(parse_cores(cores)) if cores else 1
        try:
            with leases.choosing(runs_dir):
                chosen = leases.choose(runs_dir, hardware, wanted, cores)
                lease = leases.acquire(runs_dir, hardware.backend, chosen, holder=names[0], kind="serve")
        except ValueError as busy:  # no free core, a named one held, no such core, the lease folder unusable
            raise ChatError(f"no {hardware.backend} core for vLLM: {busy}") from None
        marker = f"vllm-serve-{os.getpid()}-{time.time_ns()}"  # its processes' STUDIO_RUN_ID (machine/procs.py)
        log = runs_dir / "serve-logs" / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{file_safe(names[0])}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [env.python, "-m", "vllm.entrypoints.openai.api_server",
                *arguments(serving, hardware.backend, host, port, max_cache_len, max_batch, len(chosen), compiled)]
        environ = {**os.environ, **environment(serving, hardware, chosen, max_cache_len, max_batch, api_key),
                   "STUDIO_RUN_ID": marker}
        try:
            with open(log, "wb") as out:
                proc = _start_watched(argv, env=environ, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, pass_fds=lease.descriptors())
        except OSError as error:
            lease.release()
            raise ChatError(f"cannot start vLLM ({env.python}): {error.strerror}") from None
        server = cls(proc, lease, f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1", log,
                     serving, marker)
        server._wait_ready(timeout, on_wait)
        return server

    def _wait_ready(self, timeout: float, on_wait) -> None:
        began = time.monotonic()
        while True:
            waited = time.monotonic() - began
            if self.proc.poll() is not None:
                self.stop()
                raise ChatError(f"vLLM ended with exit code {self.proc.returncode} before it served: "
                                f"{self.failure()} (its whole log: {self.log})")
            if self.healthy():
                return
            if waited > timeout:
                self.stop()
                raise ChatError(f"vLLM did not answer within {timeout:.0f} s, so it was stopped; its log ({self.log}) "
                                f"ends: {self.failure()}")
            on_wait(waited)
            time.sleep(1)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=5) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def failure(self) -> str:
        """What went wrong, from the log: its last error line (vLLM's own message, not its traceback),
        else its last line."""
        try:
            lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        errors = [line for line in lines if ERROR_LINE.search(line)]
        return ((errors or lines or ["(an empty log)"])[-1])[:600]

    def stop(self) -> list[int]:
        """End the server and every process it started; free its cores. Returns the pids of any
        process of it that outlived SIGKILL (none expected)."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # workers of a group whose leader ended first
        left = [p.pid for p in kill_run_processes(self.marker)]
        self.lease.release()
        return left


def arguments(serving: VllmPlan, backend: str, host: str, port: int, max_cache_len: int, max_batch: int,
              cores: int, compiled: bool) -> list[str]:
    """vLLM's command-line options for the plan (no key: that goes in the environment)."""
    args = ["--model", serving.model, "--served-model-name", serving.name, "--host", host, "--port", str(port),
            "--max-model-len", str(max_cache_len), "--max-num-seqs", str(max_batch)]
    if serving.template_kwargs:  # prompts end where training put the answer, as in the studio's chat
        args += ["--default-chat-template-kwargs", json.dumps(serving.template_kwargs)]
    if serving.adapters:
        args += ["--enable-lora", "--max-loras", str(len(serving.adapters)), "--max-lora-rank",
                 str(serving.max_lora_rank), "--lora-modules", *[f"{n}={f}" for n, f in serving.adapters.items()]]
    if backend == "cpu":
        per_token = kv_bytes_per_token(serving.config)
        args += ["--kv-cache-memory-bytes", str(max(64 << 20, 2 * per_token * max_batch * max_cache_len))]
        if not compiled:
            args.append("--enforce-eager")
    else:
        args += ["--tensor-parallel-size", str(cores)]
    if backend == "neuron":
        batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch] + [max_batch]
        lengths = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) if n < max_cache_len] + [max_cache_len]
        args += ["--max-num-batched-tokens", str(max_cache_len), "--additional-config",
                 json.dumps({"neuron_config": {"num_seqs_buckets": batches, "num_batched_tokens_buckets": lengths}})]
    return args


def environment(serving: VllmPlan, hardware, cores: list[int], max_cache_len: int, max_batch: int,
                api_key: str | None) -> dict[str, str]:
    """The server's environment beside this process's: its cores, its cache, the key."""
    env = {k: v for k, v in device_env(hardware, compile_cache_root(), cores).items() if k != "OMP_NUM_THREADS"}
    env["VLLM_CACHE_ROOT"] = str(cache_dir() / "vllm")
    env["VLLM_NO_USAGE_STATS"] = "1"  # no report to vLLM's usage server
    if hardware.backend == "cpu":
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(cpus[core % len(cpus)]) for core in cores)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def kv_bytes_per_token(config: dict) -> int:
    """Keys and values of one token over every layer, in the model's dtype (4 bytes if unknown)."""
    text = config.get("text_config") or config

    def number(key: str, default: int) -> int:  # a size the config gives as a positive whole number, else `default`
        value = text.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

    heads = number("num_attention_heads", 1)
    head_size = number("head_dim", number("hidden_size", 64) // heads or 1)
    size = 2 if str(text.get("dtype") or text.get("torch_dtype")) in ("bfloat16", "float16") else 4
    return 2 * number("num_hidden_layers", 1) * number("num_key_value_heads", heads) * head_size * size


def _start_watched(argv: list[str], **popen) -> subprocess.Popen:
    """Popen from a thread that then waits for the process: the kernel's parent-death signal
    (SIGTERM) comes when the thread that started a child ends, so this thread lives exactly as long
    as the server, and the server gets it only if the studio's process dies first (a page's request
    thread, which may end at any time, never starts it)."""
    started: dict = {}
    ready = threading.Event()

    def run() -> None:
        try:
            started["proc"] = subprocess.Popen(argv, preexec_fn=lambda: die_with_parent(signal.SIGTERM), **popen)
        except OSError as error:
            started["error"] = error
        ready.set()
        if "proc" in started:
            started["proc"].wait()

    threading.Thread(target=run, daemon=True, name="vllm-server").start()
    ready.wait()
    if "error" in started:
        raise started["error"]
    return started["proc"]


def _base_name(target: ChatTarget) -> str:
    """The base model's name at /v1 beside the adapters: as the run names it (a Hub id, the built-in)."""
    info = read_json(Path(target.adapter) / OUTPUT_INFO)
    return str(info.get("base_model") or target.model)


def _template_kwargs(tokenizer_folder: str) -> dict:
    """chat.template_kwargs of the run's tokenizer (Transformers imported here, only to serve with vLLM)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    except (OSError, ValueError) as error:
        raise ChatError(f"cannot read the tokenizer of {tokenizer_folder}: {error}") from None
    return template_kwargs(tokenizer)


def _adapter_rank(folder: str) -> int:
    config = read_json(Path(folder) / "adapter_config.json")
    ranks = [config.get("r") or 8, *(config.get("rank_pattern") or {}).values()]
    return max(int(r) for r in ranks)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return  # the group has no process left
