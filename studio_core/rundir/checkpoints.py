"""Checkpoints: listing them, "stop and save", and the guard that keeps a run from saving
what it should not (weights gone NaN, a checkpoint the disk has no room for).

TRL's trainers save checkpoints to RUN_DIR/output/checkpoint-<step> (TRL's save
settings: save_strategy, save_steps, save_total_limit). Resuming from one restores the
model, optimizer, scheduler and RNG states, and the step count goes on (studio_core.runs.manager
RunManager.resume).

"Stop and save" is a request file, RUN_DIR/control.json, that every rank reads at each
step end. Rank 0 answers it with the step at which all ranks stop: the next one with a
single process, two steps on with several, so that every rank (they are at most a step
apart, held together by the gradient all-reduce) reads the answer before that step ends.
There they all save a checkpoint and stop.

A checkpoint is complete when its `trainer_state.json` reads as a JSON object: Transformers'
`Trainer._save_checkpoint` writes it last, after the model, optimizer, scheduler and RNG
states, so a save that failed half-way (a full disk) has none, or a torn one. Only complete
checkpoints are listed, so resume never picks a partial one; `remove_incomplete` deletes
partial ones once nothing writes them any more.

The guard (`guard_callback`, on every rank) ends the run, with a reason and without saving:
when the loss or the gradient norm is NaN or infinite in what the trainer logs (every rank
logs the same values: the loss is gathered, the gradients all-reduced), when no reward
function gave a usable reward (trainers with rewards), and before a save whose estimated size
(save_bytes: the model's or adapter's parameters, the optimizer's state, the tokenizer, and a
margin of 2% with a 1 MiB floor) the disk has no room for: the ranks agree on that one through
a reduction, so they all stop together.

No torch or transformers import at module level: the web app lists checkpoints too.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import time
from pathlib import Path


CONTROL = "control.json"
RESUME_ENV = "STUDIO_RESUME_FROM"  # set by RunManager.resume: the checkpoint folder the worker goes on from
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"  # written last by Transformers' _save_checkpoint
# What a checkpoint writes besides the tensors' bytes, measured on the built-in model's checkpoint:
# config, generation config, chat template, tokenizer config, trainer state (its log history
# grows with the run), training args, scheduler and RNG states, together under 100 KiB, so a
# floor of 1 MiB; the files' own framing (safetensors' header, torch.save's zip records), about
# 1% of the tensors, so 2% of them. The tokenizer's files, which the checkpoint holds too, are
# the tokenizer's own size (tokenizer_bytes): 54 KiB for the built-in model, megabytes for a
# Hub model's large vocabulary.
SAVE_MARGIN_FLOOR = 1 << 20
SAVE_MARGIN_SHARE = 0.02
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How a full disk reads when no errno comes with it: torch.save's writer ("PytorchStreamWriter
# failed writing file ...: file write failed", "enforce fail at inline_container.cc"), safetensors
DISK_FULL_WORDS = ("no space left on device", "file write failed", "inline_container.cc", "disk quota exceeded")


def list_checkpoints(run_dir: Path) -> list[dict]:
    """The run's complete checkpoints, oldest first: {step, path, size_bytes}."""
    found = []
    for path in (Path(run_dir) / "output").glob("checkpoint-*"):
        match = CHECKPOINT.match(path.name)
        if match and is_complete(path):
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            found.append({"step": int(match.group(1)), "path": str(path), "size_bytes": size})
    return sorted(found, key=lambda c: c["step"])


def is_complete(path: Path) -> bool:
    """The checkpoint folder holds a trainer state that reads whole (Transformers writes it last)."""
    try:
        return isinstance(json.loads((Path(path) / TRAINER_STATE).read_text()), dict)
    except (OSError, ValueError):  # missing, unreadable, torn (JSONDecodeError and UnicodeDecodeError)
        return False


def remove_incomplete(run_dir: Path) -> list[str]:
    """Delete the run's checkpoint folders a failed save left partial (call it when no process
    of the run is writing); their names."""
    removed = []
    for path in sorted((Path(run_dir) / "output").glob("checkpoint-*")):
        if CHECKPOINT.match(path.name) and path.is_dir() and not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def is_disk_full(error: BaseException) -> bool:
    """The error, or one it came from, says the disk (or the user's quota) is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        if any(word in str(error).lower() for word in DISK_FULL_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_space(path: Path) -> tuple[str, int, int]:
    """(the mount point holding `path`, free bytes, total bytes)."""
    path = Path(path).resolve()
    usage = shutil.disk_usage(path)
    mount = path
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return str(mount), usage.free, usage.total


def disk_full_text(path: Path, need: int | None = None, what: str = "") -> str:
    """The disk is full, in a sentence saying where and what to do."""
    mount, free, total = disk_space(path)
    needs = f"; {what} needs about {_size(need)}" if need else ""
    return (f"the disk is full: {mount} (holding {path}) has {_size(free)} free of {_size(total)}{needs}. Free "
            "space there (delete old runs, exports or checkpoints; a smaller save_total_limit keeps fewer "
            "checkpoints), or put the runs folder on a larger disk, then resume from the last complete checkpoint")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def save_bytes(model, optimizer, adapter_only: bool, tokenizer=None) -> int:
    """What a checkpoint of this model and optimizer takes, about: its saved parameters (an
    adapter's trainable ones only), the optimizer's state tensors, the tokenizer's files, and
    the margin (SAVE_MARGIN_FLOOR + SAVE_MARGIN_SHARE of the tensors). Read from tensor
    metadata only: nothing leaves the device."""
    params = [p for p in model.parameters() if p.requires_grad or not adapter_only]
    total = sum(p.numel() * p.element_size() for p in params)
    if optimizer is not None:
        for state in getattr(optimizer, "state", {}).values():
            total += sum(v.numel() * v.element_size() for v in state.values() if hasattr(v, "element_size"))
    return total + math.ceil(total * SAVE_MARGIN_SHARE) + SAVE_MARGIN_FLOOR + tokenizer_bytes(tokenizer)


def tokenizer_bytes(tokenizer) -> int:
    """About what saving the tokenizer writes: a fast tokenizer's tokenizer.json, serialized
    (its vocabulary and merges); 0 for none, or one that cannot say (the floor covers small ones)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(getattr(tokenizer, "tokenizer", None),
                                                                        "backend_tokenizer", None)  # a processor's
    if backend is None or not hasattr(backend, "to_str"):
        return 0
    return len(backend.to_str(pretty=True).encode())  # as save_pretrained writes it


def non_finite(logs: dict, reward_keys: bool) -> str | None:
    """Why these logged metrics mean the run has diverged, or None: the loss or the gradient norm
    is NaN or infinite; with `reward_keys`, every reward function's mean is NaN (none gave a usable
    reward: TRL sums the others' NaN away, so the total `reward` stays finite and says nothing)."""
    for key, name in (("loss", "the loss"), ("grad_norm", "the gradient norm"), ("eval_loss", "the evaluation loss")):
        value = logs.get(key)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return f"{name} became {value}"
    if reward_keys:
        means = {k: v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")}
        # TRL 1.16 logs a mean over only-NaN values as None, older versions as NaN
        if means and all(v is None or (isinstance(v, float) and math.isnan(v)) for v in means.values()):
            names = ", ".join(k[len("rewards/"):-len("/mean")] for k in means)
            return f"no reward function ({names}) returned a usable reward (all None or NaN)"
    return None


UNUSABLE_REWARDS_HINT = ("make the reward functions return a finite float for each completion (None only where "
                         "one does not apply), and check them with \"Check reward functions\"")
DIVERGED_HINT = ("lower the learning rate (learning_rate), or keep max_grad_norm at a value such as 1.0 to clip the "
                 "gradients, then start again")


def guard_callback(run_dir: Path, rewards: bool):
    """A TrainerCallback, on every rank, that ends the run with a reason (`reason`, None while
    all is well) instead of training on NaN weights or starting a save the disk has no room for.
    `rewards`: the trainer takes reward functions. Set `any_rank(bool) -> bool` (true on any rank)
    once the trainer exists, so every rank takes the same decision on free space."""
    from transformers import TrainerCallback

    output = Path(run_dir) / "output"

    class Guard(TrainerCallback):
        reason: str | None = None
        disk_full = False
        tokenizer_size: int | None = None
        any_rank = staticmethod(bool)  # one process; the worker sets a reduction over the ranks

        def on_log(self, args, state, control, logs=None, **kwargs):
            problem = non_finite(logs or {}, rewards)
            if problem and self.reason is None:
                hint = UNUSABLE_REWARDS_HINT if problem.startswith("no reward") else DIVERGED_HINT
                self.reason = (f"{problem} at step {state.global_step}: {hint}. The run stopped there and saved "
                               "nothing (the weights would be NaN)")
                control.should_training_stop = True
                control.should_save = False

        def on_step_end(self, args, state, control, model=None, optimizer=None, processing_class=None, **kwargs):
            # after the flow callback and stop-and-save: should_save says a save comes now
            if not control.should_save or model is None:
                return
            if self.tokenizer_size is None:  # serialized once: the tokenizer does not change
                self.tokenizer_size = tokenizer_bytes(processing_class)
            need = save_bytes(model, optimizer, adapter_only=getattr(model, "peft_config", None) is not None)
            need += self.tokenizer_size
            if self.any_rank(disk_space(output if output.exists() else run_dir)[1] < need):
                self.disk_full = True
                self.reason = disk_full_text(output if output.exists() else run_dir, need,
                                             f"checkpoint-{state.global_step}")
                control.should_save = False
                control.should_training_stop = True

    return Guard()


def request_save_and_stop(run_dir: Path) -> None:
    _write_control(Path(run_dir), {"save_and_stop": True, "asked": time.time()})


def clear_control(run_dir: Path) -> None:
    (Path(run_dir) / CONTROL).unlink(missing_ok=True)


def _write_control(run_dir: Path, data: dict) -> None:
    tmp = run_dir / f".{CONTROL}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(run_dir / CONTROL)


def stop_and_save_callback(run_dir: Path, rank: int, world_size: int, cost=None):
    """A TrainerCallback, on every rank, that carries out a save-and-stop request. `cost`: a
    compile_watch.StepCost that its step-end checks add their time to (part `stop_check`)."""
    from transformers import TrainerCallback

    control_file = run_dir / CONTROL
    control_path = str(control_file)

    class StopAndSave(TrainerCallback):
        stopped_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            start, cpu_start = time.perf_counter(), time.thread_time()
            self._check(state, control)
            if cost is not None:
                cost.add("stop_check", start, cpu_start)

        def _check(self, state, control) -> None:
            # Without a request (nearly always) a single stat() per step: a failed Path.read_text
            # costs five times as much (measured at a step end: ~3 us against ~15 us).
            try:
                os.stat(control_path)
                request = json.loads(control_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return  # no request (or one being written: read again at the next step)
            if not request.get("save_and_stop"):
                return
            if "stop_at" not in request:
                if rank != 0:
                    return
                request["stop_at"] = state.global_step + (0 if world_size == 1 else 2)
                _write_control(run_dir, request)
            if state.global_step >= request["stop_at"]:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step

    return StopAndSave()
