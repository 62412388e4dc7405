"""The run's TRL trainer, built from its resolved spec: what the training worker trains and the
precompile jobs compile (studio_core/training/precompile_worker.py), so both build the same model, the
same config and the same compiled graphs.

Imports TRL when called; only processes that train import it (the worker, the precompile jobs).

A run with a reward file of the user's hides the Hub token from that code, as the before-launch
check does: the dataset is loaded before, and a Hub model is resolved to its local folder (the
download, on every rank a cache hit after rank 0's), then the token leaves os.environ, before
the reward file is imported. Pushing to the Hub during such a run (push_to_hub) then has no
token from the environment.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from studio_core.data import sources
from studio_core.data.downloads import download_with_progress
from studio_core.machine.layout import mesh_sizes
from studio_core.recipe.rewards import HUB_TOKENS, reward_functions
from studio_core.rundir import events
from studio_core.rundir.folder import OUTPUT
from studio_core.recipe.spec import RunSpec

MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]  # what download_with_progress fetches
RECOMPILE_LIMIT = 1 << 14  # per frame (Dynamo's default: 8); see build_trainer
ACCUMULATED_RECOMPILE_LIMIT = 1 << 20  # in all (Dynamo's default: 256)


@dataclasses.dataclass
class Built:
    trainer: object
    config: object  # the trainer's TRL config
    model_args: object  # trl.ModelConfig
    model_path: str  # where the model loads from (the built-in model's folder for builtin:tiny-qwen3)


def build_trainer(spec: RunSpec, run_dir: Path, dataset, eval_dataset, callbacks: list, log: Path | None = None,
                  changes: dict | None = None) -> Built:
    """The run's trainer. `log`: the events file for a download's progress (rank 0 only);
    `changes`: config values that replace the spec's (the precompile jobs' one step, no saving)."""
    import torch
    import trl

    trainer_spec = spec.trainer_entry
    args = {**spec.args, **(changes or {})}
    if args.get("torch_compile"):
        torch._dynamo.config.automatic_dynamic_shapes = False  # see plan.DYNAMIC_SHAPES_OFF
        # With dynamic shapes off every batch shape is a recompile of every frame, and past Dynamo's
        # limits (8 per frame, 256 in all) a frame runs uncompiled from then on: on Trainium that
        # is training eager, unannounced. Each shape compiles instead, as the forecast said it would.
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        torch._dynamo.config.accumulated_recompile_limit = ACCUMULATED_RECOMPILE_LIMIT

    model_fields = {f.name for f in dataclasses.fields(trl.ModelConfig)}
    script_fields = {f.name for f in dataclasses.fields(trl.ScriptArguments)}
    model_path = spec.model_name_or_path
    if model_path in sources.BUILTIN_MODELS:
        model_path = str(sources.builtin_folder(model_path))
    elif log is not None and sources.HUB_ID.match(model_path) and not Path(model_path).exists():
        download_with_progress(model_path, log)
    user_code = trainer_spec.rewards and any(isinstance(e, dict) and "file" in e for e in spec.rewards or [])
    if user_code:
        model_path = _local_model(model_path, args.get("model_revision"))
        hidden = [name for name in HUB_TOKENS if os.environ.pop(name, None) is not None]
        if hidden and log is not None:
            events.append(log, events.log(f"{', '.join(hidden)} removed from the run's environment before your reward "
                                          "code is imported (the model and dataset are loaded)"
                                          + ("; push_to_hub has no token now" if args.get("push_to_hub") else "")))
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

    trainer_kwargs = {}
    if trainer_spec.rewards:
        trainer_kwargs["reward_funcs"], weights = reward_functions(spec.rewards)
        config_args.setdefault("reward_weights", weights)
    config_args.setdefault("output_dir", str(run_dir / OUTPUT))
    # the run id when the recipe names no run: trackers (Trackio) then go on with the same run after a resume
    config = getattr(trl, trainer_spec.config_class)(run_name=spec.run_name or run_dir.name, **config_args)
    trainer = getattr(trl, trainer_spec.trainer_class)(
        model=model_path, args=config, train_dataset=dataset, eval_dataset=eval_dataset,
        peft_config=trl.get_peft_config(model_args), callbacks=callbacks, **trainer_kwargs)
    return Built(trainer, config, model_args, model_path)


def _local_model(model_path: str, revision: str | None) -> str:
    """A Hub model's local folder (downloaded now if it is not in the cache), so that loading it
    needs no token; a local path as it is."""
    if not sources.HUB_ID.match(model_path) or Path(model_path).exists():
        return model_path
    from huggingface_hub import snapshot_download

    return snapshot_download(model_path, revision=revision, allow_patterns=MODEL_FILES)
