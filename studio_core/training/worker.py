"""The training worker: what torchrun starts on every rank. An entry point, never imported.

    torchrun --standalone --nproc-per-node=N -m studio_core.training.worker RUN_DIR

It reads the resolved spec from RUN_DIR/spec.yaml (the planner has already applied every
default, so nothing is decided here), builds the trainer's TRL config and trainer
(studio_core.training.trainer_setup, which the precompile jobs share), full or LoRA, streams events
from rank 0 through a TrainerCallback, and saves the final model or adapter to
RUN_DIR/output, with OUTPUT_INFO saying which. An exception becomes an `error` event
before the process exits non-zero. Every rank also runs the guard (checkpoints.guard_callback):
a loss or gradient norm gone NaN or infinite, rewards that are all NaN, or a save the disk has
no room for end the run with an `error` event saying why and what to change, exit code 1,
and nothing saved; the final model is saved only if its trained weights are all finite and
the disk has room for it. A disk that fills during a save: the partial checkpoint is removed
(resume only ever picks complete ones) and the error says which disk is full.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from studio_core.machine.device_env import use_rank_core
from studio_core.machine.children import collection_off, set_up
from studio_core.machine.procs import die_with_parent

use_rank_core()  # first, before anything imports torch: one NeuronCore per rank (device_env says why)
if "LOCAL_RANK" in os.environ:
    die_with_parent()  # a rank never outlives its torchrun, however torchrun ends (supervisor.py says why)

from studio_core.rundir.checkpoints import (  # noqa: E402
    RESUME_ENV,
    disk_full_text,
    disk_space,
    guard_callback,
    is_disk_full,
    remove_incomplete,
    save_bytes,
    stop_and_save_callback,
)
from studio_core.training.compile_watch import CompileWatch, EventBuffer, ShapeWatch, StepCost, TrainerTokens
from studio_core.training.peak_memory import PeakMemory
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS, OUTPUT_INFO, SPEC
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.training.train_data import load_checked_datasets
from studio_core.training.trainer_setup import build_trainer

RANK = int(os.environ.get("RANK", "0"))


def main(run_dir: Path) -> int:
    spec = RunSpec.load(run_dir / SPEC)
    log = run_dir / EVENTS
    try:
        stopped_because = train(spec, run_dir, log)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Left to interpreter exit, gloo's threads can abort a rank after a finished run
            # ("terminate called without an active exception"); so can a rank that tears the
            # group down while rank 0 still writes the model: all wait for all, then tear down.
            dist.barrier()
            dist.destroy_process_group()
        if stopped_because is not None:  # the guard ended it: a failure with its reason, nothing saved
            if RANK == 0:
                events.append(log, events.error(stopped_because, rank=RANK))
            return 1
        return 0
    except SpecError as error:  # the dataset's checks: the same what-to-change lines as before launch
        events.append(log, events.error(f"checked on the dataset's first rows, before loading the model:\n{error}",
                                        rank=RANK, problems=error.problems))
        raise
    except BaseException as error:
        if not isinstance(error, KeyboardInterrupt):
            message = f"{type(error).__name__}: {error}"
            if is_disk_full(error):  # the partial checkpoint goes first: it frees room for the event too
                removed = remove_incomplete(run_dir)
                message = disk_full_text(run_dir) + (f" (the partial {', '.join(removed)} was removed)"
                                                     if removed else "") + f"\n{message}"
            events.append(log, events.error(message, rank=RANK, traceback=traceback.format_exc()[-4000:]))
        raise


def train(spec: RunSpec, run_dir: Path, log: Path) -> str | None:
    """Train and save; why the guard ended the run instead (nothing saved then), or None."""
    trainer_spec = spec.trainer_entry
    # first: data that does not fit fails before the model loads
    dataset, eval_dataset = load_checked_datasets(spec, log if RANK == 0 else None)
    from transformers import TrainerCallback

    class EventCallback(TrainerCallback):
        """Rank 0 reports progress, metrics, compilations and new batch shapes as events.
        A step's time is the wall time since the previous step ended, less the compile time
        in it (on Neuron also a step that compiled eager ops: compile_watch says how it is
        found), so step times, tokens/s and the ETA are not skewed by compilation. The tokens
        are TRL's own count (TrainerTokens: a host int, no device sync). What the studio
        itself runs per step is timed (StepCost) and reported at the end as `studio_cost`."""

        def __init__(self, cost: StepCost):
            self.state = None
            self.cost = cost  # the stop-and-save callback adds its checks' time to it too
            self.out = EventBuffer(log)  # the per-step events, written a few at a time
            self.compiles = CompileWatch(log, self.current_step)
            self.shapes = ShapeWatch(log, self.current_step, self.cost)
            self.compiles.install()

        def current_step(self) -> int:
            return self.state.global_step + 1 if self.state else 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.state = state
            self.tokens = TrainerTokens(trainer)
            self.first_step = state.global_step  # a resumed attempt begins at its checkpoint's step
            peak.training_begins(trainer.model, getattr(trainer, "ref_model", None))
            self.shapes.install(trainer.model_wrapped)  # outermost wrapper: outside the compiled graph
            if trainer.model is not trainer.model_wrapped and not args.torch_compile:  # evaluation: unwrapped
                self.shapes.install(trainer.model)
            self.mark = (time.time(), self.compiles.compile_seconds(), 0)
            self.shapes_seen = 0  # batch shapes seen by the end of the previous step
            self.step_cpu = [None, None]  # this thread's CPU time at the first and the latest step end
            events.append(log, events.status("running", world_size=args.world_size, max_steps=state.max_steps,
                                             num_train_epochs=state.num_train_epochs))

        def on_step_end(self, args, state, control, **kwargs):
            start, cpu_start = time.perf_counter(), time.thread_time()
            self.step_cpu = [self.step_cpu[0] or cpu_start, cpu_start]  # no extra clock read
            shapes = len(self.shapes.seen)
            # Neuron: neuronx-cc's time for graphs of this step, and a step that compiled eager ops
            self.compiles.step_ended(self.mark[:2], new_shape=shapes > self.shapes_seen)
            self.shapes_seen = shapes
            now, compiled, tokens = time.time(), self.compiles.compile_seconds(), self.tokens.counted()
            step_s = max(0.0, now - self.mark[0] - (compiled - self.mark[1]))
            self.out.add(events.progress(state.global_step, state.max_steps, state.epoch, round(step_s, 4),
                                         round(compiled, 3), tokens - self.mark[2], compiled=compiled > self.mark[1]))
            self.mark = (now, compiled, tokens)
            self.cost.add("step_end", start, cpu_start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            start, cpu_start = time.perf_counter(), time.thread_time()
            self.out.add(events.metrics(state.global_step, state.epoch, logs or {}))
            self.cost.add("log", start, cpu_start)

        def on_save(self, args, state, control, **kwargs):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            self.out.flush()  # the steps before it come first
            events.append(log, events.checkpoint(state.global_step, str(path), size))

        def on_train_end(self, args, state, control, **kwargs):
            self.out.flush()
            self.compiles.report_backend_metrics()
            steps = state.global_step - self.first_step
            first, last = self.step_cpu
            step_cpu_ms = (last - first) / (steps - 1) * 1000 if steps > 1 and first is not None else None
            events.append(log, events.studio_cost(steps, self.cost.parts(), step_cpu_ms=step_cpu_ms))
            device = trainer.accelerator.device.type
            events.append(log, events.peak_memory(*peak.measured(device), device=device,
                                                  allocator=peak.allocator(device)))

    set_up()  # the collector on again (children.py), before the model loads
    peak = PeakMemory()  # before the model loads
    cost = StepCost()  # rank 0 reports it; every other rank makes the same stop check
    stop_and_save = stop_and_save_callback(run_dir, RANK, int(os.environ.get("WORLD_SIZE", "1")), cost)
    guard = guard_callback(run_dir, trainer_spec.rewards)  # last: it sees the save the others asked for
    built = build_trainer(spec, run_dir, dataset, eval_dataset,
                          callbacks=[*([EventCallback(cost)] if RANK == 0 else []), stop_and_save, guard],
                          log=log if RANK == 0 else None)
    trainer, config, model_args, model_path = built.trainer, built.config, built.model_args, built.model_path
    guard.any_rank = lambda flag: any_rank(trainer, flag)
    resume_from = os.environ.get(RESUME_ENV) or None  # set by RunManager.resume
    trainer.train(resume_from_checkpoint=resume_from)
    if guard.reason is not None:
        return guard.reason
    if stop_and_save.stopped_at is not None:  # stopped as asked, with a checkpoint: resumable
        if RANK == 0:
            events.append(log, events.saved_stop(stop_and_save.stopped_at))
        return None
    problem = final_save_problem(trainer, config.output_dir, model_args.use_peft)  # finite weights, room for them
    if problem is not None:
        return problem
    trainer.save_model(config.output_dir)
    if RANK == 0:
        kind = "adapter" if model_args.use_peft else "full"
        (Path(config.output_dir) / OUTPUT_INFO).write_text(json.dumps({
            "kind": kind, "trainer": spec.trainer, "task": trainer_spec.task,
            "base_model": spec.model_name_or_path, "base_model_path": model_path}, indent=2))
        what = "LoRA adapter" if kind == "adapter" else "model"
        events.append(log, events.log(f"{what} saved to {config.output_dir}"))
    return None


def any_rank(trainer, flag: bool) -> bool:
    """True when `flag` is true on any rank (a reduction: every rank must call it at the same point)."""
    import torch

    if trainer.accelerator.num_processes == 1:
        return bool(flag)
    total = trainer.accelerator.reduce(torch.tensor([float(flag)], device=trainer.accelerator.device), "sum")
    return bool(total.item() > 0)


def final_save_problem(trainer, output_dir: str, adapter_only: bool) -> str | None:
    """Why the final model must not be saved: a trained weight is NaN or infinite (what the guard
    could not see: a loss logged as 0, Transformers' logging_nan_inf_filter, or a divergence after
    the last log), or the disk has no room for it. One device sync: a flag per weight, stacked."""
    import torch

    params = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.model.parameters() if p.requires_grad]
    bad = bool(params) and bool(torch.stack([(~torch.isfinite(p.detach())).any() for p in params]).any().item())
    if any_rank(trainer, bad):
        return (f"the trained weights became NaN or infinite by step {trainer.state.global_step}: lower the learning "
                "rate (learning_rate), or keep max_grad_norm at a value such as 1.0 to clip the gradients, then "
                "start again. Nothing was saved")
    need = save_bytes(trainer.model, None, adapter_only, getattr(trainer, "processing_class", None))
    if any_rank(trainer, disk_space(Path(output_dir).parent)[1] < need):
        return disk_full_text(Path(output_dir).parent, need, "the final model") + ". Nothing was saved"
    return None


if __name__ == "__main__":
    collection_off()  # until the data is loaded and torch, Transformers and TRL imported (children.py)
    code = main(Path(sys.argv[1]))
    # Everything is written (the model, the events: each one a direct write). Interpreter
    # teardown can still abort a rank of a finished multi-process run in C++ destructors of
    # gloo's threads ("terminate called without an active exception", seen about once in a
    # few dozen 2-process runs even after destroy_process_group): skip it, exit with main's code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
