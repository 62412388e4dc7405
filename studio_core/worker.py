"""The training worker: what torchrun starts on every rank.

    torchrun --standalone --nproc-per-node=N -m studio_core.worker RUN_DIR

It reads the resolved spec from RUN_DIR/spec.yaml (the planner has already applied
every default, so nothing is decided here), builds the TRL trainer (SFT, DPO or GRPO,
full or LoRA), streams events from rank 0 through a TrainerCallback, and saves the
final model or adapter to RUN_DIR/output, with OUTPUT_INFO saying which.
An exception becomes an `error` event before the process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from studio_core import sources
from studio_core.builtin import BUILTIN_MODEL, ensure_tiny_model
from studio_core.checkpoints import RESUME_ENV, stop_and_save_callback
from studio_core.compile_watch import CompileWatch, ShapeWatch
from studio_core.data_check import prepare_dataset
from studio_core.downloads import download_dataset_split, download_with_progress
from studio_core.events import append_event
from studio_core.layout import mesh_sizes
from studio_core.rewards import reward_functions
from studio_core.spec import RunSpec, SpecError, check_rows

RANK = int(os.environ.get("RANK", "0"))
TRAINERS = {"sft": ("SFTConfig", "SFTTrainer"), "dpo": ("DPOConfig", "DPOTrainer"),
            "grpo": ("GRPOConfig", "GRPOTrainer")}
# Written next to the saved model: whether output/ is a LoRA adapter or a full model, and
# its base, so chat and export load it the right way.
OUTPUT_INFO = "studio_output.json"


def main(run_dir: Path) -> None:
    spec = RunSpec.load(run_dir / "spec.yaml")
    events = run_dir / "events.jsonl"
    try:
        train(spec, run_dir, events)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Left to interpreter exit, gloo's threads can abort a rank after a finished run
            # ("terminate called without an active exception", seen once with 2 processes)
            dist.destroy_process_group()
    except SpecError as error:  # the dataset's checks: the same what-to-change lines as before launch
        append_event(events, "error", rank=RANK, problems=error.problems,
                     message=f"checked on the dataset's first rows, before loading the model:\n{error}")
        raise
    except BaseException as error:
        if not isinstance(error, KeyboardInterrupt):
            append_event(events, "error", rank=RANK, message=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc()[-4000:])
        raise


def train(spec: RunSpec, run_dir: Path, events: Path) -> None:
    dataset = load_checked_dataset(spec, events)  # first: data that does not fit fails before the model loads
    import torch
    import trl
    from transformers import TrainerCallback

    args = dict(spec.args)
    if args.get("torch_compile"):
        torch._dynamo.config.automatic_dynamic_shapes = False  # see plan.DYNAMIC_SHAPES_OFF

    model_fields = {f.name for f in dataclasses.fields(trl.ModelConfig)}
    script_fields = {f.name for f in dataclasses.fields(trl.ScriptArguments)}
    model_path = spec.model_name_or_path
    if model_path == BUILTIN_MODEL:
        model_path = str(ensure_tiny_model())
    elif RANK == 0 and sources.HUB_ID.match(model_path) and not Path(model_path).exists():
        download_with_progress(model_path, events)
    model_args = trl.ModelConfig(model_name_or_path=model_path,
                                 **{k: v for k, v in args.items() if k in model_fields})
    config_args = {k: v for k, v in args.items() if k not in model_fields | script_fields}
    init_kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation,
                   "dtype": model_args.dtype, **(config_args.get("model_init_kwargs") or {})}
    if spec.layout.tp_size > 1 or spec.layout.fsdp_size > 1:
        from transformers.distributed import DistributedConfig

        init_kwargs["distributed_config"] = DistributedConfig(**mesh_sizes(
            spec.layout.tp_size, spec.layout.fsdp_size, int(os.environ.get("WORLD_SIZE", "1"))))
    config_args["model_init_kwargs"] = init_kwargs

    config_name, trainer_name = TRAINERS[spec.trainer]
    trainer_kwargs = {}
    if spec.trainer == "grpo":
        trainer_kwargs["reward_funcs"], weights = reward_functions(spec.rewards)
        config_args.setdefault("reward_weights", weights)
    config = getattr(trl, config_name)(output_dir=str(run_dir / "output"), run_name=spec.run_name, **config_args)

    class EventCallback(TrainerCallback):
        """Rank 0 reports progress, metrics, compilations and new batch shapes as events.
        A step's time is the wall time since the previous step ended, less the compile time
        in it, so step times, tokens/s and the ETA are not skewed by compilation."""

        def __init__(self):
            self.state = None
            self.compiles = CompileWatch(events, self.current_step)
            self.shapes = ShapeWatch(events, self.current_step)
            self.compiles.install()

        def current_step(self) -> int:
            return self.state.global_step + 1 if self.state else 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.state = state
            self.shapes.install(trainer.model_wrapped)  # outermost wrapper: outside the compiled graph
            self.mark = (time.time(), self.compiles.compile_seconds(), self.shapes.tokens)
            append_event(events, "status", state="running", world_size=args.world_size,
                         max_steps=state.max_steps, num_train_epochs=state.num_train_epochs)

        def on_step_end(self, args, state, control, **kwargs):
            now, compiled, tokens = time.time(), self.compiles.compile_seconds(), self.shapes.tokens
            step_s = max(0.0, now - self.mark[0] - (compiled - self.mark[1]))
            append_event(events, "progress", step=state.global_step, max_steps=state.max_steps,
                         epoch=state.epoch, step_s=round(step_s, 4), compile_s=round(compiled, 3),
                         tokens=tokens - self.mark[2])
            self.mark = (now, compiled, tokens)

        def on_log(self, args, state, control, logs=None, **kwargs):
            append_event(events, "metrics", **{"step": state.global_step, "epoch": state.epoch, **(logs or {})})

        def on_save(self, args, state, control, **kwargs):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            append_event(events, "checkpoint", step=state.global_step, folder=str(path), size_bytes=size)

        def on_train_end(self, args, state, control, **kwargs):
            self.compiles.report_backend_metrics()

    stop_and_save = stop_and_save_callback(run_dir, RANK, int(os.environ.get("WORLD_SIZE", "1")))
    trainer = getattr(trl, trainer_name)(
        model=model_path, args=config, train_dataset=dataset,
        peft_config=trl.get_peft_config(model_args),
        callbacks=[*([EventCallback()] if RANK == 0 else []), stop_and_save], **trainer_kwargs,
    )
    resume_from = os.environ.get(RESUME_ENV) or None  # set by RunManager.resume
    trainer.train(resume_from_checkpoint=resume_from)
    if stop_and_save.stopped_at is not None:  # stopped as asked, with a checkpoint: resumable
        if RANK == 0:
            append_event(events, "saved_stop", step=stop_and_save.stopped_at)
        return
    trainer.save_model(config.output_dir)
    if RANK == 0:
        kind = "adapter" if model_args.use_peft else "full"
        (Path(config.output_dir) / OUTPUT_INFO).write_text(json.dumps({
            "kind": kind, "trainer": spec.trainer, "base_model": spec.model_name_or_path,
            "base_model_path": model_path}, indent=2))
        append_event(events, "log", message=f"{'LoRA adapter' if kind == 'adapter' else 'model'} saved to "
                     f"{config.output_dir}")


def load_checked_dataset(spec: RunSpec, events: Path):
    """The training split, renamed and trimmed as the spec says, after the checks a local file gets
    before launch (spec.check_rows: column map, TRL type against the trainer, GRPO rewards called on
    the first rows). A Hub dataset or a folder is read only here, so this is where it is refused."""
    dataset = load_train_dataset(spec, events)
    problems = check_rows(spec, dataset.select(range(min(5, len(dataset)))).to_list())
    if problems:
        raise SpecError(problems)
    return prepare_dataset(dataset, spec.column_map, spec.keep_columns)


def load_train_dataset(spec: RunSpec, events: Path | None = None):
    """A file or folder as it is; a Hub dataset's split downloaded first (progress as `download`
    events from rank 0), then read from the local files. Offline, `datasets` reads its own cache."""
    from datasets import load_dataset
    from huggingface_hub import constants

    path = sources.dataset_file(spec.dataset_name)
    if path is not None:
        return load_dataset(sources.FILE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
    name, split = spec.dataset_name, spec.dataset_train_split
    if sources.HUB_ID.match(name) and not Path(name).expanduser().exists() and not constants.HF_HUB_OFFLINE:
        found = download_dataset_split(name, spec.dataset_config, split, events if RANK == 0 else None)
        if found is not None:
            builder, files = found
            return load_dataset(builder, data_files={split.split("[")[0]: files}, split=split)
    return load_dataset(name, name=spec.dataset_config, split=split)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
