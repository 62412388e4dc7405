"""The picture of a machine's cores: which ones this run would take, its TP groups, and
which ones other runs or a chat process hold. Plain HTML from plain data."""

from __future__ import annotations

import html

from studio_core.machine.hardware import Hardware
from studio_core.machine.layout import tp_groups

GROUP_COLOURS = ("#268bd2", "#2aa198", "#6c71c4", "#b58900", "#cb4b16", "#859900", "#d33682", "#073642")


def core_map_html(hardware: Hardware, cores: list[int], tp_size: int, held: dict[int, str], nodes: int = 0) -> str:
    """`cores`: the run's cores in rank order; `held`: core -> who holds it (RunManager.core_holders).
    `nodes`: a Slurm run's node count (then the map is one node's, and no core here is held)."""
    count = hardware.cores
    per_chip = count // hardware.chips if hardware.backend == "neuron" and hardware.chips else count
    group_of = {}
    if cores and tp_size >= 1 and len(cores) % tp_size == 0:
        for index, group in enumerate(tp_groups(len(cores), tp_size)):
            for rank in group:
                group_of[cores[rank]] = index
    unit = {"neuron": "NeuronCore", "cuda": "GPU", "cpu": "CPU core"}[hardware.backend]
    rows = []
    for first in range(0, count, per_chip):
        cells = []
        for core in range(first, min(first + per_chip, count)):
            if core in held:
                style, label, title = "background:#93a1a1;color:#fff", "busy", f"held by {held[core]}"
            elif core in group_of:
                colour = GROUP_COLOURS[group_of[core] % len(GROUP_COLOURS)]
                style, label = f"background:{colour};color:#fff", f"r{cores.index(core)}"
                title = f"this run: rank {cores.index(core)}" + (f", TP group {group_of[core]}" if tp_size > 1 else "")
            else:
                style, label, title = "background:#eee8d5;color:#586e75", "free", "free"
            cells.append(f"<div class='core' data-core='{core}' data-state='{html.escape(label)}' "
                         f"title='{unit} {core}: {html.escape(title)}' style='{style};display:inline-block;"
                         f"width:44px;margin:2px;padding:4px 0;text-align:center;border-radius:4px;"
                         f"font-size:0.8em'>{core}<br>{html.escape(label)}</div>")
        name = f"chip {first // per_chip}" if hardware.backend == "neuron" else hardware.backend.upper()
        rows.append(f"<div style='margin:2px 0'><span style='display:inline-block;width:56px;"
                    f"font-size:0.8em'>{name}</span>{''.join(cells)}</div>")
    where = (f" of each node, x {nodes} node{'s' if nodes > 1 else ''} (Slurm picks them; each node is the "
             "job's alone)") if nodes else ""
    legend = (f"<div style='font-size:0.8em;margin-top:4px'>{len(cores)} of {count} {unit}s{where} for this run"
              + (f", TP groups of {tp_size} (one colour each)" if tp_size > 1 else "")
              + ("" if nodes else f"; {len(held)} held by others") + "</div>")
    return f"<div class='core-map'>{''.join(rows)}{legend}</div>"
