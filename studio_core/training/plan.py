"""The planner: a run spec and a hardware description in, the exact launch out. Pure.

`plan()` decides the command that starts the run's processes (the run backend's), the
environment the studio adds, and the final TRL arguments: the recipe's own values plus the
backend's and the trainer's safe defaults (studio_core.recipe.trainers), each listed with its reason
so the user sees what was changed and why. The same plan is what "Preview command" shows,
what `launch.py plan` prints, and what the run backend runs.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from studio_core import backends
from studio_core.recipe import eval_data, trainers
from studio_core.training import memory, padding, precompile
from studio_core.data import image_size, model_check, sources
from studio_core.machine.children import REPO_ROOT
from studio_core.machine.cores import format_cores, parse_cores
from studio_core.machine.device_env import (RANK_CORES, REASONS, VISIBLE, describe_rank_cores, device_env, flags_problem,
                                    rank_cores)
from studio_core.machine.hardware import Hardware
from studio_core.machine.layout import check_layout
from studio_core.recipe.spec import RunSpec, SpecError, resolved, trackers
from studio_core.recipe.trainers import Default
from studio_core.recipe.trl_schema import config_problems, prepare_config_check, trainer_fields

WORKER_MODULE = "studio_core.training.worker"
# Where TensorBoard and Trackio (TRL's report_to) write: folders of the run folder, so the run's
# history, its delete and its size count them; the export builds a clean folder without them.
TENSORBOARD_DIR = "tensorboard"
TRACKIO_DIR = "trackio"
DYNAMIC_SHAPES_OFF = "torch._dynamo.config.automatic_dynamic_shapes"
RECOMPILE_LIMITS = "torch._dynamo.config.recompile_limit, accumulated_recompile_limit"  # trainer_setup sets them


# What each backend needs for training to work, or to work well. The Neuron figures come from
# TRL's Trainium guide and the TorchNeuron announcement (2026); docs/architecture.md lists them.
COMMON_DEFAULTS = (
    Default("disable_tqdm", True, "progress streams as events; tqdm's bar would flood train.log"),
    Default("logging_first_step", True, "the first loss shows at step 1, not after logging_steps"),
)
# A vision-language model's (model_check.is_vision), before the backend's: a default met first is the one kept.
VISION_DEFAULTS = (
    Default("ddp_find_unused_parameters", True, "a vision-language model has weights its forward does not use "
            "(LLaVA reads its vision tower's hidden states before the tower's last norm and pooling head): DDP "
            "must look for them, or it stops at the second step"),
    Default("lora_target_modules", "all-linear", "PEFT knows no default layers to adapt in a vision-language model "
            "(\"Please specify target_modules\"): every linear layer, the vision tower's too",
            when=lambda args: bool(args.get("use_peft"))),
)
BACKEND_DEFAULTS = {
    "cpu": (
        Default("use_cpu", True, "without it accelerate runs no DDP under torchrun on CPU: "
                "each rank would train alone", force=True),
        Default("bf16", False, "TRL's bf16 default fails on CPU (\"Your setup doesn't support "
                "bf16/gpu\")", force=True),
        Default("ddp_backend", "gloo", "the collective backend that runs on CPU"),
        Default("ddp_find_unused_parameters", False, "every parameter gets a gradient; skips DDP's "
                "extra search of the graph"),
        Default("dataloader_pin_memory", False, "pinned memory only speeds copies to an accelerator"),
    ),
    "cuda": (),
    "neuron": (
        Default("bf16", True, "every Trainium generation computes in bf16: half the memory, "
                "full matmul speed"),
        Default("dataloader_drop_last", True, "a smaller last batch is a new shape, and every new "
                "shape costs a compilation"),
        Default("pad_to_multiple_of", "auto", "TRL pads batches to a multiple of 128 on Neuron, so "
                "at most max_length/128 shapes compile (Qwen3-0.6B SFT: 130 s padded vs 260 s)"),
    ),
}

@dataclass
class Plan:
    argv: list[str]
    env: dict[str, str]  # only what the studio adds to the inherited environment (PYTHONPATH: prepended)
    spec: RunSpec  # the resolved spec: the recipe plus the applied defaults, and the cores chosen
    applied: list[tuple[str, object, str]] = field(default_factory=list)  # (key, value, reason)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    backend: str = backends.DEFAULT  # the run backend that starts it: where it executes
    cores: list[int] | None = None  # the cores chosen for the run; None: a plan for another machine
    padding: str = ""  # the resolved pad_to_multiple_of and the sequence lengths it allows (studio_core.training.padding)
    hardware: Hardware | None = None  # what it was planned for: launch.json and the batch script record it
    memory: memory.Estimate | None = None  # device memory per core, estimated from the model's config

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} \\\n  {shlex.join(self.argv)}" if env else shlex.join(self.argv)

    def describe(self) -> str:
        where = backends.get(self.backend).description
        lines = [f"Command (runs on {where}):", self.command_line(), "", "Settings the studio applied:"]
        lines += [f"  {key} = {value!r}: {reason}" for key, value, reason in self.applied] or ["  none"]
        lines += ["", "Padding (on Neuron each new batch shape is a compilation):",
                  f"  {self.padding}"] if self.padding else []
        lines += ["", "Device memory per core (estimated from the model's config):",
                  *self.memory.describe()] if self.memory else []
        lines += ["", "Warnings:", *[f"  {w}" for w in self.warnings]] if self.warnings else []
        lines += ["", "Cannot launch:", *[f"  {e}" for e in self.errors]] if self.errors else []
        return "\n".join(lines + backends.get(self.backend).describe_launch(self))


def plan(spec: RunSpec, hardware: Hardware, cores: list[int] | None = None, run_dir: str | Path = "<run folder>",
         run_id: str = "<run id>", compile_cache: str | Path = "<compile cache>",
         model_config: dict | None = None) -> Plan:
    """`cores`: the cores chosen for the run on this machine (None, for another machine: the
    spec's own `studio.cores`, else the first ones). `compile_cache` is the compile cache root
    (compile_cache.compile_cache_root(), passed in so the plan stays pure); `model_config` (the
    model's config.json, when at hand) lets the layout check heads vs TP."""
    trainer = spec.trainer_entry
    args = dict(spec.args)
    applied: list[tuple[str, object, str]] = []
    warnings: list[str] = list(hardware.problems)  # found by detection on this machine
    known = trainer_fields(spec.trainer)
    vision = model_check.is_vision(model_config or {})
    defaults = (*(VISION_DEFAULTS if vision else ()), *COMMON_DEFAULTS, *BACKEND_DEFAULTS[hardware.backend],
                *trainer.defaults, *(trainer.neuron_defaults if hardware.backend == "neuron" else ()))
    for default in (d for d in defaults if d.key in known and (d.when is None or d.when(args))):
        if default.key not in args:
            args[default.key] = default.value
            applied.append((default.key, default.value, default.reason))
        elif args[default.key] != default.value and default.force:
            warnings.append(f"{default.key}: the recipe's {args[default.key]!r} cannot run on "
                            f"{hardware.backend}; using {default.value!r} ({default.reason})")
            args[default.key] = default.value
            applied.append((default.key, default.value, default.reason))
    _eval_defaults(spec, args, hardware.backend, known, applied)
    _tracker_defaults(args, known, run_id, applied)
    errors = (_vision_padding(trainer, args, hardware.backend, known, applied)
              + _image_room(args, known, model_config)) if vision else []
    if hardware.backend == "neuron":
        _neuron_model_init(args, trainer, applied)
        warnings += _neuron_warnings(args, trainer, vision)
        warnings += _image_size_warnings(spec, model_config)
    if spec.layout.tp_size > 1 or spec.layout.fsdp_size > 1:
        applied.append(("model_init_kwargs.distributed_config",
                        f"DistributedConfig(tp_size={spec.layout.tp_size}, fsdp_size={spec.layout.fsdp_size})",
                        "the worker passes it to from_pretrained, which shards the model as it loads; the "
                        "Trainer then uses it as is (no --fsdp flag)"))
    if args.get("torch_compile"):
        applied.append((DYNAMIC_SHAPES_OFF, False, "automatic dynamic shapes make graphs Neuron cannot "
                        "compile (TRL issue 7660); each shape compiles once instead"))
        applied.append((RECOMPILE_LIMITS, "16384 per frame, 1048576 in all", "past Dynamo's own limits (8 "
                        "recompiles of a frame, 256 in all) a frame would run uncompiled from then on, on Trainium "
                        "eager and unannounced; each shape compiles instead, as the forecast counts them"))
    errors += check_layout(spec.layout.nproc, spec.layout.tp_size, spec.layout.fsdp_size,
                           cores if cores is not None else spec.layout.cores, hardware, model_config)
    errors += precompile.problems(spec, trainer, args)
    estimate = memory.estimate(spec.trainer, spec.layout, args, hardware, model_config)
    too_big, tight = memory.problems(estimate, spec.trainer, spec.layout, args, hardware, model_config)
    errors += too_big
    warnings += tight
    flags = flags_problem(hardware)  # the studio's NEURON_CC_FLAGS name another LNC than the runtime's
    errors += [flags] if flags else []
    backend = backends.get(spec.layout.run_on)
    env = _environment(spec, hardware, run_id, compile_cache, cores, applied, backend.local_cores, run_dir,
                       backend.cluster)
    more_applied, more_warnings = backend.planned(spec, hardware, env, run_dir, compile_cache)
    applied += more_applied
    warnings += more_warnings
    argv = backend.launch_argv(spec.layout, WORKER_MODULE, str(run_dir))
    final = resolved(spec, args)
    if spec.precompile and spec.precompile_jobs is None:
        final.precompile_jobs, why = precompile.default_jobs(hardware)
        applied.append(("studio.precompile_jobs", final.precompile_jobs, why))
    elif spec.precompile and isinstance(spec.precompile_jobs, int):
        too_many = precompile.jobs_warning(hardware, spec.precompile_jobs)
        warnings += [too_many] if too_many else []
    if cores is not None:
        final.layout.cores = format_cores(cores)
    return Plan(argv, env, final, applied, warnings, errors, backend.name, cores,
                padding.describe(args, known, hardware.backend, trainer.generates), hardware=hardware,
                memory=estimate)


def trl_problems(spec: RunSpec, hardware: Hardware) -> list[str]:
    """What TRL, Transformers and PEFT refuse in the run's config, built from the TRL arguments
    the planner hands the worker on this hardware (its defaults applied): report_to names, step
    counts, strategies, TRL's own rules. Not pure: it asks a child process (trl_schema), so the
    manager calls it with the spec's other checks, before any lock."""
    return configs_problems([(spec, hardware)])[0]


def configs_problems(pairs: list[tuple[RunSpec, Hardware]]) -> list[list[str]]:
    """trl_problems of several specs, in one question to the child."""
    return config_problems([_config_request(spec, hardware) for spec, hardware in pairs])


def prepare_trl_check(spec: RunSpec, hardware: Hardware) -> None:
    """Start the config check's child now when the spec's verdict is not kept (it imports TRL:
    seconds), so that it loads while the model and data are checked; trl_problems then asks it."""
    try:
        request = _config_request(spec, hardware)
    except (SpecError, ValueError, TypeError, KeyError, OSError):
        return  # a spec the plan cannot take yet: its checks say why, and the child starts when asked
    prepare_config_check([request])


def _config_request(spec: RunSpec, hardware: Hardware) -> dict:
    final = plan(spec, hardware).spec
    return {"trainer": spec.trainer, "args": final.args, "given": sorted(spec.args),
            "run_name": spec.run_name or "run", "world_size": spec.layout.nproc * spec.layout.nodes}


def _spec_cores(spec: RunSpec) -> list[int] | None:
    """The cores the spec names, if it names a valid set (check_layout says what is wrong else)."""
    try:
        return parse_cores(spec.layout.cores) if spec.layout.cores else None
    except ValueError:
        return None


def _eval_defaults(spec: RunSpec, args: dict, backend: str, known, applied: list) -> None:
    """With an evaluation set, evaluate it during training; on Neuron, in the training's shapes.
    Evaluation batches go through the training's collator (padding, pad_to_multiple_of) and,
    in Transformers' Trainer, the same dataloader_drop_last; what is left to keep them from adding
    shapes or host transfers is set here."""
    source = eval_data.eval_source(spec)
    if source is None:
        return
    wanted = [("eval_strategy", "steps", f"the run has an evaluation set ({source.describe()}): its loss is "
               "computed and plotted beside the training loss"),
              ("eval_steps", 0.1, "ten evaluations over the run (a fraction of its steps); each one walks "
               "the whole evaluation set")]
    if backend == "neuron":
        batch = args.get("per_device_train_batch_size", 8)
        wanted += [("per_device_eval_batch_size", batch, "evaluation batches of the training's size, so they "
                    "pad to the training's lengths; each new batch shape is a compilation (a forward-only "
                    "graph for evaluation)"),
                   ("prediction_loss_only", True, "only the loss comes back from the device: gathering every "
                    "batch's logits (batch x length x vocabulary) to the host would stall each evaluation "
                    "step, and eval_accumulation_steps then has nothing to accumulate")]
    for key, value, reason in wanted:
        if key in known and key not in args and (key != "eval_steps" or args.get("eval_strategy") == "steps"):
            args[key] = value
            applied.append((key, value, reason))


def _neuron_model_init(args: dict, trainer: trainers.Trainer, applied: list) -> None:
    init_kwargs = dict(args.get("model_init_kwargs") or {})
    wanted = [("device_map", None, "the Trainer places the model; \"auto\" would load it on CPU "
               "(Accelerate lists no Neuron devices)")]
    if trainer.generates and args.get("cache_implementation") == "static":
        wanted.append(("dtype", "bfloat16", "the static cache needs a bf16 model: in fp32 the keys and "
                       "values end up in different dtypes (TRL issue 7664)"))
    for key, value, reason in wanted:
        if key not in init_kwargs:
            init_kwargs[key] = value
            applied.append((f"model_init_kwargs.{key}", value, reason))
    args["model_init_kwargs"] = init_kwargs


def _vision_padding(trainer: trainers.Trainer, args: dict, backend: str, known, applied: list) -> list[str]:
    """A vision-language run of a trainer whose vision collator cannot pad to a multiple (not
    `vision_pads`: TRL 1.16's DPO and KTO collators raise NotImplementedError("Padding to a multiple
    of a value is not yet implemented for vision-language modeling ...") at the first batch when
    pad_to_multiple_of is set, as "auto" sets it on Neuron; SFT's does too, for prompt-completion
    rows only, which the plan cannot see): "auto" that would pad becomes null, said; a number is
    refused, saying what to write. A trainer that pads (SFT) has the processor truncate and pad in
    one call, which raises ValueError ("Truncation and padding are both activated but truncation
    length ... is not a multiple of pad_to_multiple_of") at the first batch unless max_length is
    a multiple: refused, with the multiples on either side. The problems found."""
    if "pad_to_multiple_of" not in known:
        return []
    value = args.get("pad_to_multiple_of", known["pad_to_multiple_of"].get("default"))
    try:
        multiple = padding.resolve(value, backend)
    except ValueError:
        return []  # not a number: padding.describe says so
    if not multiple:
        return []
    if trainer.vision_pads:
        return _vision_max_length(args, known, multiple, value)
    why = (f"TRL's {trainer.name} collator for vision-language data cannot pad to a multiple (it raises "
           "NotImplementedError at the first batch)")
    if value != padding.AUTO:
        return [f"pad_to_multiple_of: {value}: {why}; set it to null (on Neuron each batch length then compiles "
                "once; max_length bounds them)"]
    args["pad_to_multiple_of"] = None
    applied[:] = [entry for entry in applied if entry[0] != "pad_to_multiple_of"]  # a default of "auto": replaced
    applied.append(("pad_to_multiple_of", None, f"{why}: each batch is as long as its longest sample, so on Neuron "
                    "each new length compiles once; max_length bounds them"))
    return []


def _max_length(args: dict, known) -> int | None:
    """The run's max_length in tokens (the recipe's, else the trainer's default); None when it is not
    a whole number above 0 (null: no truncation; validate says what else is wrong)."""
    limit = args.get("max_length", known.get("max_length", {}).get("default"))
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else None


def _vision_max_length(args: dict, known, multiple: int, value) -> list[str]:
    """max_length against the padding multiple of a vision-language run that pads (_vision_padding)."""
    limit = _max_length(args, known)
    if limit is None or limit % multiple == 0:
        return []
    below, above = limit // multiple * multiple, (limit // multiple + 1) * multiple
    padded = f"pad_to_multiple_of {multiple}" + (" (\"auto\" on this backend)" if value == padding.AUTO else "")
    return [f"max_length: {limit} is not a multiple of {padded}: a vision-language model's processor truncates "
            "and pads in one call and refuses that at the first batch; set max_length to "
            + (f"{below} or {above}" if below else str(above))]


def _image_room(args: dict, known, config: dict) -> list[str]:
    """max_length against one image's tokens, where the config fixes their count (LLaVA's
    image_seq_length, Gemma 3's mm_tokens_per_image): a sample cut inside its image's tokens stops
    the run at the first batch (the processor: "Mismatch in `image` token count between text and
    `input_ids`"). A length above the count still cuts an image that comes after text; TRL's own
    error names max_length then."""
    per_image = next((config.get(key) for key in ("image_seq_length", "mm_tokens_per_image")
                      if isinstance(config.get(key), int)), None)
    limit = _max_length(args, known) if "max_length" in known else None
    if per_image is None or limit is None or limit > per_image:
        return []
    return [f"max_length: {limit} tokens cannot hold an image, which this model reads as {per_image} tokens, with "
            "the text around it: the first batch would stop; set max_length above "
            f"{per_image} plus the prompt's and answer's tokens (the shape forecast shows the samples' lengths), or null"]


def _neuron_warnings(args: dict, trainer: trainers.Trainer, vision: bool = False) -> list[str]:
    """Recipe values that run on Neuron but are known to cost a lot there (`vision`: a
    vision-language model, which some trainers cannot pad: _vision_padding says so instead)."""
    warnings = []
    if "pad_to_multiple_of" in args and args["pad_to_multiple_of"] is None and not (vision and not trainer.vision_pads):
        warnings.append("pad_to_multiple_of: null compiles a graph for every batch length (TRL measured "
                        "260 s instead of 130 s for 20 Qwen3-0.6B steps); \"auto\" pads to 128")
    if args.get("dataloader_drop_last") is False:
        warnings.append("dataloader_drop_last: false makes the last, smaller batch one more compilation")
    if trainer.generates and args.get("cache_implementation") != "static":
        warnings.append(f"cache_implementation: {args.get('cache_implementation')!r} makes every generated "
                        f"token a new shape: each {trainer.name} step compiles for minutes; use \"static\"")
    if args.get("torch_compile") and not any(d.key == "torch_compile" for d in trainer.neuron_defaults):
        warnings.append(f"torch_compile: true is untested with {trainer.name} on Neuron: AWS and TRL show compiled "
                        "training for SFT only; if a step fails to compile, set torch_compile: false")
    dtype = (args.get("model_init_kwargs") or {}).get("dtype")
    if trainer.generates and args.get("cache_implementation") == "static" and dtype not in ("bfloat16", "bf16"):
        warnings.append(f"model_init_kwargs.dtype: {dtype!r} with the static cache fails: the keys and values "
                        "end up in different dtypes (TRL issue 7664); use bfloat16")
    return warnings


def _image_size_warnings(spec: RunSpec, model_config: dict | None) -> list[str]:
    """A vision-language model whose processor gives each image a token count of its own size
    (data/image_size.py), trained with no studio.image_size: a compile for each image size."""
    family = image_size.follows_image(model_config or {})
    if family is None or spec.image_size is not None:
        return []
    return [f"studio.image_size: {family}'s processor gives each image as many tokens as its size makes, so images "
            "of many sizes make many shapes, each a compilation; set studio.image_size (e.g. 448) to resize "
            "every image to one square"]


def _tracker_defaults(args: dict, known, run_id: str, applied: list) -> None:
    if "trackio" not in trackers(args.get("report_to")):
        return
    wanted = [("project", run_id, "Trackio's project is the run: its dashboard names the run as the Runs tab "
               "does (TRL's default is \"huggingface\" for every run)"),
              ("trackio_static_space_id", False, "Trackio stays local: with push_to_hub, transformers would "
               "otherwise copy the logs to a new Space on the Hub (public unless hub_private_repo)")]
    for key, value, reason in wanted:
        if key in known and key not in args:
            args[key] = value
            applied.append((key, value, reason))


def _tracker_environment(report_to, run_dir: str | Path, applied: list) -> dict[str, str]:
    """The trackers' folders inside the run folder (transformers 5 has no logging_dir argument;
    Trackio reads TRACKIO_DIR when it is imported, in the run's ranks)."""
    env = {}
    names = trackers(report_to)
    if "tensorboard" in names:
        env["TENSORBOARD_LOGGING_DIR"] = str(Path(run_dir) / TENSORBOARD_DIR)
        applied.append(("TENSORBOARD_LOGGING_DIR", env["TENSORBOARD_LOGGING_DIR"], "TensorBoard's event files "
                        "go in the run folder (not output/, the saved model's folder), the same folder for "
                        "every attempt: a resumed run goes on in the same curves"))
    if "trackio" in names:
        env["TRACKIO_DIR"] = str(Path(run_dir) / TRACKIO_DIR)
        applied.append(("TRACKIO_DIR", env["TRACKIO_DIR"], "Trackio logs locally into the run folder (not "
                        "~/.cache/huggingface/trackio), so deleting the run deletes its tracking too"))
    return env


def _environment(spec: RunSpec, hardware: Hardware, run_id: str, compile_cache, chosen: list[int] | None,
                 applied, local_cores: bool = True, run_dir: str | Path = "<run folder>",
                 cluster: bool = False) -> dict[str, str]:
    """`chosen`: the run's cores; None for a plan that picks none (the spec's own are shown, else
    the first ones). Without `local_cores` (a cluster's run: each node is the job's alone) no core
    is named: every process sees its node's devices. `cluster`: the nodes talk over the network."""
    layout = spec.layout
    named = _spec_cores(spec)
    cores = chosen if chosen is not None else named or list(range(layout.nproc))
    env = {
        "PYTHONPATH": str(REPO_ROOT),  # put in front of the user's own when the run starts
        "PYTHONUNBUFFERED": "1",
        "STUDIO_RUN_ID": run_id,  # marks every process of the run, so stop can find them all
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    local_model = (spec.model_name_or_path in sources.BUILTIN_MODELS
                   or Path(spec.model_name_or_path).expanduser().exists())
    local_data = sources.dataset_file(spec.dataset_name) is not None or Path(spec.dataset_name).expanduser().exists()
    if local_model and local_data:
        env["HF_HUB_OFFLINE"] = "1"
        applied.append(("HF_HUB_OFFLINE", "1", "model and dataset are local: the run makes no network call"))
    env.update(_tracker_environment(spec.args.get("report_to"), run_dir, applied))
    # CPU threads follow the run's cores when it has some; else the machine's share
    placed = cores if local_cores and (hardware.backend != "cpu" or chosen is not None or named) else None
    device = device_env(hardware, compile_cache, placed, layout.nproc, written=layout.cores if named else None,
                        environ={} if flags_problem(hardware) else None,  # refused in plan(); the rest still shows
                        between_nodes=cluster)
    env.update(device)
    for key in (k for k in device if k in REASONS):
        applied.append((key, device[key], REASONS[key]))
    if RANK_CORES in device:
        applied.append((VISIBLE, describe_rank_cores(rank_cores(device)), "each rank's own NeuronCore"))
    if "OMP_NUM_THREADS" in device:
        applied.append(("OMP_NUM_THREADS", device["OMP_NUM_THREADS"], "the run's CPU cores shared out between "
                        "its processes"))
    if layout.tp_size > 1 or layout.fsdp_size > 1:
        env["TP_SIZE"], env["FSDP_SIZE"] = str(layout.tp_size), str(layout.fsdp_size)
    return env
