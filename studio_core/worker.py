"""The training worker: what torchrun starts on every rank. An entry point, never imported.

    torchrun --standalone --nproc-per-node=N -m studio_core.worker RUN_DIR

It reads the resolved spec from RUN_DIR/spec.yaml (the planner has already applied every
default, so nothing is decided here), builds the trainer's TRL config and trainer
(studio_core.trainer_setup, which the precompile jobs share), full or LoRA, streams events
from rank 0 through a TrainerCallback, and saves the final model or adapter to
RUN_DIR/output, with OUTPUT_INFO saying which. An exception becomes an `error` event
before the process exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from studio_core.device_env import use_rank_core
from studio_core.procs import die_with_parent

use_rank_core()  # first, before anything imports torch: one NeuronCore per rank (device_env says why)
if "LOCAL_RANK" in os.environ:
    die_with_parent()  # a rank never outlives its torchrun, however torchrun ends (supervisor.py says why)

from studio_core import trainers  # noqa: E402
from studio_core.checkpoints import RESUME_ENV, stop_and_save_callback
from studio_core.compile_watch import CompileWatch, ShapeWatch
from studio_core.runs import events
from studio_core.runs.folder import EVENTS, OUTPUT_INFO, SPEC
from studio_core.spec import RunSpec, SpecError
from studio_core.train_data import load_checked_datasets
from studio_core.trainer_setup import build_trainer

RANK = int(os.environ.get("RANK", "0"))


def main(run_dir: Path) -> None:
    spec = RunSpec.load(run_dir / SPEC)
    log = run_dir / EVENTS
    try:
        train(spec, run_dir, log)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Left to interpreter exit, gloo's threads can abort a rank after a finished run
            # ("terminate called without an active exception"); so can a rank that tears the
            # group down while rank 0 still writes the model: all wait for all, then tear down.
            dist.barrier()
            dist.destroy_process_group()
    except SpecError as error:  # the dataset's checks: the same what-to-change lines as before launch
        events.append(log, events.error(f"checked on the dataset's first rows, before loading the model:\n{error}",
                                        rank=RANK, problems=error.problems))
        raise
    except BaseException as error:
        if not isinstance(error, KeyboardInterrupt):
            events.append(log, events.error(f"{type(error).__name__}: {error}", rank=RANK,
                                            traceback=traceback.format_exc()[-4000:]))
        raise


def train(spec: RunSpec, run_dir: Path, log: Path) -> None:
    trainer_spec = trainers.get(spec.trainer)
    # first: data that does not fit fails before the model loads
    dataset, eval_dataset = load_checked_datasets(spec, log if RANK == 0 else None)
    from transformers import TrainerCallback

    class EventCallback(TrainerCallback):
        """Rank 0 reports progress, metrics, compilations and new batch shapes as events.
        A step's time is the wall time since the previous step ended, less the compile time
        in it, so step times, tokens/s and the ETA are not skewed by compilation."""

        def __init__(self):
            self.state = None
            self.compiles = CompileWatch(log, self.current_step)
            self.shapes = ShapeWatch(log, self.current_step)
            self.compiles.install()

        def current_step(self) -> int:
            return self.state.global_step + 1 if self.state else 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.state = state
            self.shapes.install(trainer.model_wrapped)  # outermost wrapper: outside the compiled graph
            if trainer.model is not trainer.model_wrapped and not args.torch_compile:  # evaluation: unwrapped
                self.shapes.install(trainer.model, count_tokens=False)
            self.mark = (time.time(), self.compiles.compile_seconds(), self.shapes.tokens)
            events.append(log, events.status("running", world_size=args.world_size, max_steps=state.max_steps,
                                             num_train_epochs=state.num_train_epochs))

        def on_step_end(self, args, state, control, **kwargs):
            self.compiles.step_ended()  # Neuron: neuronx-cc's time for graphs of this step
            now, compiled, tokens = time.time(), self.compiles.compile_seconds(), self.shapes.tokens
            step_s = max(0.0, now - self.mark[0] - (compiled - self.mark[1]))
            events.append(log, events.progress(state.global_step, state.max_steps, state.epoch, round(step_s, 4),
                                               round(compiled, 3), tokens - self.mark[2],
                                               compiled=compiled > self.mark[1]))
            self.mark = (now, compiled, tokens)

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(log, events.metrics(state.global_step, state.epoch, logs or {}))

        def on_save(self, args, state, control, **kwargs):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            events.append(log, events.checkpoint(state.global_step, str(path), size))

        def on_train_end(self, args, state, control, **kwargs):
            self.compiles.report_backend_metrics()

    stop_and_save = stop_and_save_callback(run_dir, RANK, int(os.environ.get("WORLD_SIZE", "1")))
    built = build_trainer(spec, run_dir, dataset, eval_dataset,
                          callbacks=[*([EventCallback()] if RANK == 0 else []), stop_and_save],
                          log=log if RANK == 0 else None)
    trainer, config, model_args, model_path = built.trainer, built.config, built.model_args, built.model_path
    resume_from = os.environ.get(RESUME_ENV) or None  # set by RunManager.resume
    trainer.train(resume_from_checkpoint=resume_from)
    if stop_and_save.stopped_at is not None:  # stopped as asked, with a checkpoint: resumable
        if RANK == 0:
            events.append(log, events.saved_stop(stop_and_save.stopped_at))
        return
    trainer.save_model(config.output_dir)
    if RANK == 0:
        kind = "adapter" if model_args.use_peft else "full"
        (Path(config.output_dir) / OUTPUT_INFO).write_text(json.dumps({
            "kind": kind, "trainer": spec.trainer, "task": trainer_spec.task,
            "base_model": spec.model_name_or_path, "base_model_path": model_path}, indent=2))
        what = "LoRA adapter" if kind == "adapter" else "model"
        events.append(log, events.log(f"{what} saved to {config.output_dir}"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Everything is written (the model, the events: each one a direct write). Interpreter
    # teardown can still abort a rank of a finished multi-process run in C++ destructors of
    # gloo's threads ("terminate called without an active exception", seen about once in a
    # few dozen 2-process runs even after destroy_process_group): skip it, exit 0.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
