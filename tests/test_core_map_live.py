"""The Train tab's core map follows the leases while the form stays as it is (issue 47: "0 held by
others" while another run held both cores; later both busy while one was free)."""

from __future__ import annotations

import pytest

from studio_core.machine.hardware import cpu_hardware
from studio_core.machine.leases import acquire
from studio_core.runs.manager import RunManager

pytestmark = pytest.mark.fast  # no run, torchrun, browser or app: a lease taken in this process
HOLDER = "20261129-120000-sft-aaaaaa"


@pytest.fixture
def tab(tmp_path):
    import gradio as gr
    from app import train_tab

    manager = RunManager(tmp_path / "runs")
    hardware = cpu_hardware()
    with gr.Blocks() as demo:
        form, _ = train_tab.build(manager, hardware, gr.State(None))
    return demo, form, manager, hardware


def handler(demo, name: str):
    import gradio as gr

    found = [f for f in demo.fns.values() if f.name == name]
    assert found, f"the tab has no {name}"
    return found[0]


def tick(demo, form, drawn: str):
    """One tick of the core map's timer on the page's starting values, the map shown being `drawn`."""
    fn = handler(demo, "on_core_tick")
    values = {component: component.value for component in fn.inputs} | {form.core_map: drawn}
    return fn.fn(values)


def states(core_map: str) -> list[str]:
    return [cell.split("'")[0] for cell in core_map.split("data-state='")[1:]]


def test_the_core_map_is_drawn_again_from_the_leases_taken_and_given_back_meanwhile(tab):
    import gradio as gr

    demo, form, manager, hardware = tab
    free_map, _ = tick(demo, form, "")
    assert "0 held by others" in free_map and "busy" not in states(free_map)
    assert tick(demo, form, free_map) == (gr.update(), gr.update())  # nothing changed: nothing sent
    lease = acquire(manager.runs_dir, hardware.backend, list(range(hardware.cores)), HOLDER, "run")
    try:
        held_map, _ = tick(demo, form, free_map)
        assert states(held_map) == ["busy"] * hardware.cores
        assert f"{hardware.cores} held by others" in held_map and HOLDER in held_map
    finally:
        lease.release()
    again, _ = tick(demo, form, held_map)
    assert again == free_map and "busy" not in states(again)


def test_the_map_is_drawn_again_on_a_timer_that_runs_while_the_layout_box_is_open(tab):
    import gradio as gr

    demo, form, _, _ = tab
    timer_id = handler(demo, "on_core_tick").targets[0][0]
    timer = demo.blocks[timer_id]
    assert isinstance(timer, gr.Timer) and not timer.active  # the box starts closed
    for event, active in (("expand", True), ("collapse", False)):
        [switch] = [f for f in demo.fns.values() if (form.layout_box._id, event) in f.targets and timer in f.outputs]
        assert switch.fn().active is active
