"""Export says at once that it exports, before the seconds the export takes (issue 47)."""

from __future__ import annotations

import pytest

from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager

pytestmark = pytest.mark.fast


def test_export_says_exporting_before_it_is_done(tmp_path):
    import gradio as gr
    from app import export_tab

    manager = RunManager(tmp_path / "runs")
    with gr.Blocks() as demo:
        export_tab.build(manager, cpu_hardware(), demo)
    [on_export] = [f.fn for f in demo.fns.values() if f.name == "on_export"]
    said = on_export("20250101-000000-gone-abc123", str(tmp_path / "out"), False, progress=lambda *a, **k: None)
    first = next(said)[0]
    assert first.startswith("Exporting run `20250101-000000-gone-abc123`") and str(tmp_path / "out") in first
    assert next(said)[0].startswith("**Cannot export:**")  # then what became of it
