"""A plain TRL SFT script: the baseline that bench/studio_vs_plain.py compares the studio to.

    torchrun --standalone --nproc-per-node=1 bench/plain_sft.py \
        --model MODEL_DIR --dataset FILE.jsonl --config SFT_KWARGS.json --output-dir OUT

It builds `trl.SFTConfig(output_dir=OUT, **json.load(SFT_KWARGS.json))`, loads the dataset
file with `datasets`, trains with `trl.SFTTrainer` and saves the model: what a user would
write by hand. It does not import the studio. Its only extra is timing, kept in memory:
at step 1 it prints one line `PLAIN_SFT_FIRST_STEP {"time": ...}`, and at the end rank 0
prints one line `PLAIN_SFT_RESULT {...}` (JSON: first/last step times, the trainer's
train_steps_per_second, every step's end time, ...), both with Unix times (time.time()), as the studio's events.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SCRIPT_START = time.time()  # after the interpreter started, before torch/TRL are imported
RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder or Hub id")
    parser.add_argument("--dataset", required=True, help="a JSONL file in TRL's conversational format")
    parser.add_argument("--config", required=True, help="JSON file: the SFTConfig keyword arguments")
    parser.add_argument("--output-dir", required=True)
    options = parser.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    with open(options.config) as handle:
        kwargs = json.load(handle)
    config = SFTConfig(output_dir=options.output_dir, **kwargs)
    dataset = load_dataset("json", data_files=options.dataset, split="train")
    timing: dict = {"script_start_time": SCRIPT_START, "train_begin_time": None, "first_step": None, "first_step_time": None, "last_step": None, "last_step_time": None,
                    "train_steps_per_second": None, "train_runtime": None, "step_times": []}

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            timing["train_begin_time"] = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            now, cpu = time.time(), time.thread_time()
            if timing["first_step"] is None:
                timing["first_step_cpu"] = cpu
                timing["first_step"], timing["first_step_time"] = state.global_step, now
                if RANK == 0:
                    print("PLAIN_SFT_FIRST_STEP " + json.dumps({"time": now, "step": state.global_step}),
                          flush=True)
            timing["last_step"], timing["last_step_time"] = state.global_step, now
            timing["last_step_cpu"] = cpu  # this thread's CPU time: what a busy machine does not inflate
            timing["step_times"].append(now)  # a list append: ~0.1 us, nothing next to a step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "train_steps_per_second" in logs:
                timing["train_steps_per_second"] = logs["train_steps_per_second"]
                timing["train_runtime"] = logs.get("train_runtime")

    trainer = SFTTrainer(model=options.model, args=config, train_dataset=dataset, callbacks=[Timing()])
    trainer.train()
    trainer.save_model(config.output_dir)
    if RANK == 0:
        timing["torch_threads"] = torch.get_num_threads()
        timing["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
        timing["end_time"] = time.time()
        print("PLAIN_SFT_RESULT " + json.dumps(timing), flush=True)


if __name__ == "__main__":
    main()
