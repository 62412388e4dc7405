"""Inside a running training (issue 29): a run that diverges ends failed with its reason and saves
nothing; a full disk is named as such, its partial checkpoint never resumed from, and the run
still gets its final status; the user's reward code never sees the Hub token; a stop the user
asked for is no failure.

The disk tests put the runs folder on a small tmpfs made here (root and mount(8) needed; they
skip, saying so, where mounting is not permitted) and fill it with a file: a real full disk.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest

from studio_core.rundir.checkpoints import is_complete, is_disk_full, list_checkpoints, non_finite, remove_incomplete
from studio_core.machine.hardware import cpu_hardware
from studio_core.machine.procs import kill_run_processes
from studio_core.rundir import events
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec
from test_runs import LONG, tiny, wait_until_training

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DIVERGES = "learning_rate=1.0e+30"  # finite, so the spec takes it; the tiny model's weights overflow at once


def events_of(view) -> list[dict]:
    return events.read(view.dir / "events.jsonl")  # a line a full disk tore is left out


# --- fast: the rules, on real files and real errors ------------------------------------------
def checkpoint(run_dir, step: int, state: str | None) -> None:
    folder = run_dir / "output" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    if state is not None:
        (folder / "trainer_state.json").write_text(state)


@pytest.mark.fast
def test_only_complete_checkpoints_are_listed_and_the_partial_ones_are_removed(tmp_path):
    checkpoint(tmp_path, 5, json.dumps({"global_step": 5}))
    checkpoint(tmp_path, 10, None)  # the disk filled before Transformers wrote its state (written last)
    checkpoint(tmp_path, 15, '{"global_step": 15, "log_hi')  # filled while writing it: torn
    assert [c["step"] for c in list_checkpoints(tmp_path)] == [5]
    assert not is_complete(tmp_path / "output" / "checkpoint-15")
    assert remove_incomplete(tmp_path) == ["checkpoint-10", "checkpoint-15"]
    assert sorted(p.name for p in (tmp_path / "output").iterdir()) == ["checkpoint-5"]


@pytest.mark.fast
def test_a_full_disk_is_told_from_its_real_errors(tmp_path):
    import torch

    with pytest.raises(OSError) as plain:  # the kernel's own ENOSPC
        with open("/dev/full", "wb") as full:
            full.write(b"x")
    assert plain.value.errno == errno.ENOSPC and is_disk_full(plain.value)
    with pytest.raises(RuntimeError) as torch_save:  # what the tester saw: torch.save's writer, no errno
        torch.save({"w": torch.zeros(1000)}, "/dev/full")
    assert is_disk_full(torch_save.value), str(torch_save.value)
    try:
        raise ValueError("saving failed") from plain.value
    except ValueError as chained:
        assert is_disk_full(chained)
    assert not is_disk_full(FileNotFoundError(errno.ENOENT, "gone")) and not is_disk_full(ValueError("nan"))


@pytest.mark.fast
def test_what_diverged_is_named_for_every_trainers_metrics():
    assert non_finite({"loss": 0.0, "grad_norm": float("nan")}, False) == "the gradient norm became nan"
    assert non_finite({"loss": float("inf"), "grad_norm": 1.0}, False) == "the loss became inf"
    assert non_finite({"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3}, False) is None
    nan = float("nan")
    # GRPO/RLOO: TRL's nansum keeps `reward` finite; every function's own mean says none gave one
    rewards = {"loss": 0.0, "reward": 0.0, "rewards/mine/mean": nan, "rewards/length/mean": nan}
    assert "no reward function (mine, length)" in non_finite(rewards, True)
    assert non_finite({**rewards, "rewards/length/mean": -0.5}, True) is None  # one still rewards
    assert non_finite(rewards, False) is None  # a trainer without rewards logs no such keys of its own
    as_trl_logs_it = {"loss": 0.0, "reward": 0.0, "rewards/mine/mean": None}  # TRL's log: a mean of no value
    assert "no reward function (mine)" in non_finite(as_trl_logs_it, True)


# --- slow: real runs -----------------------------------------------------------------------
def test_a_diverging_sft_run_fails_with_its_reason_and_saves_nothing(manager):
    view = manager.wait(manager.start(tiny(DIVERGES, "max_steps=10", "logging_steps=2"), cpu_hardware()).id)
    assert view.live_state == "failed", view.error_text
    assert "became nan" in view.error_text and "at step 2" in view.error_text, view.error_text
    assert "lower the learning rate" in view.error_text
    assert view.exit_code == 1 and view.step == 2  # stopped there, not trained on
    output = view.dir / "output"
    assert not (output / "model.safetensors").exists() and not (output / "studio_output.json").exists()


def test_a_diverging_dpo_run_fails_too(manager):
    spec = RunSpec.load(RECIPES / "tiny-dpo.yaml").with_overrides(["max_steps=6", "logging_steps=2", DIVERGES])
    view = manager.wait(manager.start(spec, cpu_hardware()).id)
    assert view.live_state == "failed" and "became nan" in view.error_text, view.error_text
    assert not (view.dir / "output" / "model.safetensors").exists()


NAN_AT_RUN_TIME = """
    import json, math, os
    from pathlib import Path

    def sees_no_token(completions, **kwargs):
        from huggingface_hub import get_token
        seen = Path(__file__).with_name("seen.jsonl")
        with seen.open("a") as out:
            out.write(json.dumps({"env": os.environ.get("HF_TOKEN"), "hub": get_token()}) + "\\n")
        # the check's sample completion passes; the model's own completions get no reward at all
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [1.0 if text == "The answer is 42." else math.nan for text in texts]
"""


def test_a_reward_run_hides_the_hub_token_and_ends_when_no_reward_is_usable(manager, tmp_path, monkeypatch):
    fake = f"hf_fake{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", fake)  # what the app's own environment would hold
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token-file"))  # no token file to fall back to
    (tmp_path / "rewards.py").write_text(textwrap.dedent(NAN_AT_RUN_TIME))
    spec = RunSpec.load(RECIPES / "tiny-grpo-lora.yaml").with_overrides([
        "max_steps=4", "logging_steps=1",
        f"studio.rewards=[{{file: {tmp_path / 'rewards.py'}, function: sees_no_token}}]"])
    view = manager.wait(manager.start(spec, cpu_hardware()).id)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) >= 2  # the check before launch, then the run
    assert all(s == {"env": None, "hub": None} for s in seen), seen
    assert fake not in (view.dir / "train.log").read_text()
    assert view.live_state == "failed", view.error_text
    assert "no reward function (sees_no_token) returned a usable reward" in view.error_text, view.error_text
    assert "at step 1" in view.error_text and not (view.dir / "output" / "adapter_model.safetensors").exists()


def test_a_plain_stop_is_recorded_as_a_stop_not_a_failure(manager):
    run = manager.start(tiny(*LONG), cpu_hardware())
    wait_until_training(manager, run.id, steps=2)
    manager.stop(run.id)
    view = manager.wait(run.id)
    assert view.live_state == "stopped" and view.exit_code == 0 and view.error_text is None


# --- slow: a real full disk ------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs of its own, with a runs folder on it: (mount point, RunManager)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"a small filesystem cannot be mounted here (root and mount needed): {made.stderr.strip()}")
    runs = RunManager(mount / "runs")
    try:
        yield mount, runs
    finally:
        for run in runs.runs_dir.iterdir():
            kill_run_processes(run.name)
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(mount, leave: int) -> None:
    """Take the disk's free space down to `leave` bytes (0: until a write fails)."""
    with open(mount / "filler", "wb") as out:
        chunk = b"\0" * (1 << 20)
        while True:
            room = shutil.disk_usage(mount).free - leave
            if room <= 0:
                return
            try:
                out.write(chunk[:room])
                out.flush()
            except OSError as error:
                assert error.errno == errno.ENOSPC
                return


def test_a_save_the_disk_has_no_room_for_is_never_started(small_disk):
    mount, runs = small_disk
    # filled first, so the save at step 20 meets a full disk however fast the run gets there
    fill(mount, leave=2 << 20)  # room for the run's files and events, not for its ~2.6 MB checkpoint (estimated 3.7 MiB)
    run = runs.start(tiny(*LONG, "save_strategy=steps", "save_steps=20"), cpu_hardware())
    checkpoint(runs.runs_dir / run.id, 999, '{"global_step": 9')  # a save a full disk tore, earlier
    view = runs.wait(run.id)
    assert view.live_state == "failed" and "the disk is full" in view.error_text, view.error_text
    assert str(mount) in view.error_text and "checkpoint-20 needs about" in view.error_text
    assert view.step == 20 and view.checkpoints == [] and view.resume_point() is None
    assert not (view.dir / "output" / "checkpoint-20").exists()
    assert not (view.dir / "output" / "checkpoint-999").exists()  # the partial one is gone
    assert any("removed checkpoint-999" in e.get("message", "") for e in events_of(view))


def test_a_disk_with_no_room_at_all_still_gets_the_final_status(small_disk):
    mount, runs = small_disk
    run = runs.start(tiny(*LONG), cpu_hardware())
    wait_until_training(runs, run.id, steps=3)
    fill(mount, leave=0)  # every write of every process fails from here
    view = runs.wait(run.id)
    assert view.live_state == "failed", view.error_text
    assert "the disk is full" in (view.error_text or ""), events_of(view)[-5:]
    assert str(mount) in view.error_text
    assert "killed, or the machine restarted" not in view.error_text
    ended = json.loads((view.dir / "ended.json").read_text())
    assert ended["state"] == "failed" and ended["exit_code"] not in (0, None)
    assert not (view.dir / ".disk-reserve").exists()
