"""Run folders written before studio_core moved into folders (main at 6321bc9) read as they did:
their spec.yaml, with the Slurm block the spec then kept as a plain mapping, and their launch.json,
whose argv names the modules by their old paths (a resume plans again, so nothing runs those)."""

import json

import pytest

from studio_core.backends import owner
from studio_core.recipe.spec import RunSpec, load_spec
from studio_core.runs.manager import RunManager

pytestmark = pytest.mark.fast

# What RunSpec.to_yaml() wrote at 6321bc9 for a two-node Slurm run with every Slurm setting.
OLD_SPEC = """studio:
  trainer: sft
  nproc: 2
  cores: null
  tp_size: 1
  fsdp_size: 1
  run_on: slurm
  nodes: 2
  slurm:
    partition: trn
    time: '1:00:00'
    account: ml
    sbatch_args:
    - --exclusive
    - --qos=high
    auto_resume: true
model_name_or_path: builtin:tiny-qwen3
dataset_name: builtin:qa
dataset_train_split: train
max_steps: 20
"""
OLD_LAUNCH = {"created": 1764770000.0, "argv": ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2",
                                                 "--nproc-per-node=2", "-m", "studio_core.worker", "$RUN_DIR"],
              "env": {"STUDIO_RUN_ID": "20261201-120000-old-abc123"}, "backend": "slurm",
              "hardware": {"backend": "cpu", "name": "cpu", "cores": 2}, "applied": [], "warnings": [], "cores": None}


def test_an_old_slurm_run_folder_lists_and_its_spec_reads_typed_and_writes_back_the_same_text(tmp_path):
    run_dir = tmp_path / "runs" / OLD_LAUNCH["env"]["STUDIO_RUN_ID"]
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(OLD_SPEC)
    (run_dir / "launch.json").write_text(json.dumps(OLD_LAUNCH))
    spec = load_spec(run_dir)
    options = spec.layout.options
    assert owner(options).name == spec.layout.run_on == "slurm"
    assert (options.partition, options.time, options.account, options.sbatch_args, options.auto_resume) == (
        "trn", "1:00:00", "ml", ["--exclusive", "--qos=high"], True)
    assert spec.to_yaml() == OLD_SPEC
    assert RunSpec.from_dict(spec.to_dict()).to_yaml() == OLD_SPEC
    [view] = RunManager(tmp_path / "runs").list()
    assert view.id == run_dir.name and view.spec["studio"]["slurm"]["partition"] == "trn"
