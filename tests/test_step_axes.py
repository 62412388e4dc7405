"""Step plots label their ticks whole ("100" ... "800"), not "1e+2" ... "8.4e+2" (issue 47)."""

from __future__ import annotations

import pytest

from studio_core.runs.manager import RunManager

pytestmark = pytest.mark.fast


def test_every_step_axis_is_written_without_exponents(tmp_path):
    import gradio as gr
    from app import compare, run_panel

    with gr.Blocks() as demo:
        panel = run_panel.RunPanel()
        compare.build(RunManager(tmp_path / "runs"))
    plots = [block for block in demo.blocks.values() if isinstance(block, gr.LinePlot) and block.x == "step"]
    assert panel.loss in plots and panel.lr in plots and set(panel.trainer_plots) <= set(plots)
    assert any(plot.elem_id == "compare-plot" for plot in plots)
    assert {plot.x_axis_format for plot in plots} == {"~f"}
