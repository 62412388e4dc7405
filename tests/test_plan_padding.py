"""The plan shows the padding a run's batches get, as TRL resolves pad_to_multiple_of on the run's
device, and the number of sequence lengths it allows: in `launch.py plan`, in the planner's own
Plan and in the Train tab's forecast panel, also when the forecast cannot run (issue 30, item 6).
"""

import os
import subprocess
import sys

import pytest

from cli.main import main
from conftest import RECIPES
from hub_standin import use_hub_cache
from studio_core.machine.hardware import Hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.recipe.spec import RunSpec

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

ROOT = RECIPES.parent
QWEN = RECIPES / "qwen3-0.6b-sft.yaml"
TRN2_3XL = instance_hardware("trn2.3xlarge")
CPU = Hardware("cpu", 8, cpu_count=8)
NEURON_AUTO = "pad to a multiple of 128 on Neuron (auto)"


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """No Hub model or dataset on this machine, whatever the user's cache holds: the forecast
    cannot walk Qwen3's data here, so what the plan shows must not depend on it."""
    use_hub_cache(tmp_path / "hub-cache", monkeypatch)


def test_launch_plan_for_a_trn2_prints_the_padding_and_its_shapes_without_the_forecast(tmp_path, empty_hub_cache):
    # the issue's own command line, as a user types it
    done = subprocess.run([sys.executable, "launch.py", "plan", str(QWEN), "--instance", "trn2.3xlarge",
                           "--nproc", "4", "--runs-dir", str(tmp_path / "runs")],
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "No shape forecast" in done.stdout, done.stdout  # the data is not here ...
    padding = done.stdout.partition("Padding")[2]  # ... and the padding is shown all the same
    assert f"{NEURON_AUTO}; at most 1024/128 = 8 sequence lengths (max_length 1024)" in padding, done.stdout


def test_launch_plan_on_the_cpu_says_there_is_no_padding(tmp_path, capsys):
    code = main(["plan", str(RECIPES / "tiny-sft.yaml"), "--backend", "cpu", "--no-forecast",
                 "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert code == 0
    assert ("no padding on cpu (auto pads only on Neuron): each batch is as long as its longest sample; every "
            "sequence length is a shape of its own: up to 128 of them (max_length 128)") in out, out


@pytest.mark.parametrize("recipe, overrides, hardware, says", [
    ("tiny-sft.yaml", ["max_length=1024"], TRN2_3XL, f"{NEURON_AUTO}; at most 1024/128 = 8 sequence lengths"),
    ("tiny-sft.yaml", ["max_length=1000"], TRN2_3XL, f"{NEURON_AUTO}; at most 8 (1000/128, rounded up) sequence "
                                                     "lengths (max_length 1000)"),
    ("tiny-sft.yaml", ["max_length=1024", "pad_to_multiple_of=64"], CPU,
     "pad to a multiple of 64 (pad_to_multiple_of: 64); at most 1024/64 = 16 sequence lengths"),
    ("tiny-sft.yaml", ["pad_to_multiple_of=null"], TRN2_3XL,
     "no padding (pad_to_multiple_of: null): each batch is as long as its longest sample; every sequence length "
     "is a shape of its own: up to 128 of them"),
    ("tiny-sft.yaml", ["max_length=1024", "packing=true", "packing_strategy=wrapped"], TRN2_3XL,
     f"{NEURON_AUTO}; 1 sequence length: wrapped packing cuts every row at max_length 1024"),
    ("tiny-sft.yaml", ["max_length=1024", "packing=true", "per_device_train_batch_size=4"], TRN2_3XL,
     f"{NEURON_AUTO}; padding-free batches are one row of up to 4 x 1024 tokens: at most 4096/128 = 32 row lengths"),
    ("tiny-sft.yaml", ["max_length=null"], TRN2_3XL, "sequence lengths are not bounded (max_length: null)"),
    ("tiny-dpo.yaml", ["max_length=512"], TRN2_3XL, f"{NEURON_AUTO}; at most 512/128 = 4 sequence lengths"),
    ("tiny-grpo.yaml", ["max_completion_length=256"], TRN2_3XL,
     f"{NEURON_AUTO}; at most 256/128 = 2 completion lengths (max_completion_length 256); prompts: as many"),
], ids=["auto", "rounded-up", "a-number", "null", "wrapped-packing", "padding-free", "no-max-length", "preference",
        "generating"])
def test_the_plan_shows_the_resolved_padding_and_its_sequence_lengths(recipe, overrides, hardware, says):
    launch = plan(RunSpec.load(RECIPES / recipe).with_overrides(overrides), hardware)
    assert says in launch.padding, launch.padding
    assert f"  {launch.padding}" in launch.describe().splitlines()  # what Preview and `launch.py plan` show


@pytest.mark.parametrize("value", ["auto", "64", "none", "null", 32, None])
def test_the_rule_is_trls_own_on_this_cpu(value, tmp_path):
    # TRL resolves the value in the config's __post_init__; off Neuron "auto" pads nothing
    import trl

    from studio_core.training.padding import resolve

    config = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", pad_to_multiple_of=value)
    assert resolve(value, "cpu") == config.pad_to_multiple_of
    assert resolve(value, "neuron") == (128 if value == "auto" else config.pad_to_multiple_of)


def test_the_train_tabs_forecast_panel_shows_the_padding_when_the_forecast_cannot_run(manager, empty_hub_cache):
    from app.forecast_panel import plan_and_forecast
    from app.train_form import form_values

    values = form_values(RunSpec.load(QWEN).with_overrides(["studio.nproc=4"]), trackers=["none"])
    text, result = plan_and_forecast(values | {"target": "trn2.3xlarge", "lnc": 2}, manager, CPU)
    assert result is None
    assert text.startswith(f"**Padding:** {NEURON_AUTO}; at most 1024/128 = 8 sequence lengths"), text
    assert "**No forecast:**" in text and "model Qwen/Qwen3-0.6B and dataset trl-lib/Capybara not on this " \
                                          "machine" in text, text
