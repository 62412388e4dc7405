"""A precompile job: compiles its share of the run's batch shapes, then exits. An entry point,
never imported (studio_core/training/precompile.py says what precompile is).

    python -m studio_core.training.precompile_worker RUN_DIR JOB JOBS

Started by the run's supervisor before torchrun, on a core of its own, with the kernel's
parent-death signal set (it never outlives the supervisor). It builds the run's
own trainer (studio_core/training/trainer_setup.py), walks the run's data loader for the first batch of
every distinct shape, in the order the run meets them, takes shapes JOB, JOB+JOBS, ..., and
trains one step on each: a forward and a backward, which compile them into the run's compile
cache. It writes `precompile_start` (job 0: the shapes of all jobs) and one `precompiled` per
shape, with whether the cache already had it (compile_watch.StepCache: Inductor's counters on
CPU and CUDA; on Neuron TorchNeuron's records and NEFF cache, read in its source, not run on a
device here), never the compile events of the run itself. Nothing else of it is kept: the steps train
a throwaway copy of the model in a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from studio_core.machine.children import collection_off, set_up, skip_final_collection
from studio_core.training.compile_watch import StepCache
from studio_core.training.precompile import first_batch_of_each_shape, shape_of
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS, SPEC
from studio_core.recipe.spec import RunSpec
from studio_core.training.train_data import load_checked_datasets
from studio_core.training.trainer_setup import build_trainer

# One step per shape, nothing saved, logged, evaluated or reported.
ONE_STEP_EACH = {"save_strategy": "no", "eval_strategy": "no", "logging_strategy": "no", "report_to": "none",
                 "load_best_model_at_end": False, "push_to_hub": False, "gradient_accumulation_steps": 1}


def main(run_dir: Path, job: int, jobs: int) -> None:
    spec = RunSpec.load(run_dir / SPEC)
    log = run_dir / EVENTS
    dataset, _ = load_checked_datasets(spec, None)
    from transformers import TrainerCallback

    set_up()  # the collector on again (children.py), before the model loads and compiles

    mine: list[dict] = []

    class Timer(TrainerCallback):
        """Each step trains one batch of a new shape: its time is that shape's compile and step."""

        def __init__(self):
            self.cache = StepCache.here()  # Neuron: TorchNeuron's records and NEFF cache; else Inductor's

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()
            self.cache.begin()

        def on_step_end(self, args, state, control, **kwargs):
            batch = mine[state.global_step - 1]
            cache = self.cache.end()  # on Neuron this syncs the device: the step's graphs have compiled
            events.append(log, events.precompiled(shape_of(batch), job, round(time.perf_counter() - self.began, 3),
                                                  cache=cache))

    with tempfile.TemporaryDirectory(prefix="precompile-") as scratch:
        walked = build_trainer(spec, run_dir, dataset, None, callbacks=[], changes={"output_dir": scratch})
        batches = first_batch_of_each_shape(walked.trainer)
        if job == 0:
            events.append(log, events.precompile_start([shape_of(b) for b in batches], jobs))
        mine[:] = batches[job::jobs]
        if not mine:
            return
        # The steps: the same trainer settings, one step per batch of this job's shapes.
        built = build_trainer(spec, run_dir, dataset, None, callbacks=[Timer()],
                              changes={**ONE_STEP_EACH, "output_dir": scratch, "max_steps": len(mine)})
        built.trainer.get_train_dataloader = lambda: list(mine)  # these batches, in this order
        built.trainer.train()


if __name__ == "__main__":
    skip_final_collection()
    collection_off()
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
