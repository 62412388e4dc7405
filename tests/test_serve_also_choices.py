"""The Chat tab's Serve box offers, beside the loaded run, only LoRA runs of its base, never the
loaded run itself nor a full run (issue 47). Run folders with a saved model's record, no model."""

from __future__ import annotations

import pytest

from studio_core.export.export import OUTPUT_INFO
from studio_core.rundir import folder
from studio_core.runs.manager import RunManager
from test_hardening_runs import make_run

pytestmark = pytest.mark.fast


def saved(runs, run_id: str, kind: str, base: str = "builtin:tiny-qwen3") -> str:
    run_dir = make_run(runs, run_id)
    folder.write_json(run_dir / folder.OUTPUT / OUTPUT_INFO, {"kind": kind, "trainer": "sft", "base_model": base,
                                                              "task": "text-generation"})
    return run_id


def test_the_other_runs_are_the_lora_runs_of_the_loaded_runs_base(tmp_path):
    from app.chat_tab import lora_runs_beside

    runs = tmp_path / "runs"
    loaded = saved(runs, "20250101-000000-lora-a-000001", "adapter")
    sibling = saved(runs, "20250101-000001-lora-b-000002", "adapter")
    saved(runs, "20250101-000002-full-000003", "full")
    saved(runs, "20250101-000003-lora-other-000004", "adapter", base="Qwen/Qwen3-0.6B")
    manager = RunManager(runs)
    assert lora_runs_beside(manager, loaded) == [sibling]
    assert lora_runs_beside(manager, "20250101-000002-full-000003") == []  # a full run is served alone
    assert lora_runs_beside(manager, "builtin:tiny-qwen3") == [] and lora_runs_beside(manager, None) == []
