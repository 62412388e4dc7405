"""The picture of a machine's cores: which ones this run would take, its TP groups, and
which ones other runs or a chat process hold. Plain HTML from plain data."""

from __future__ import annotations

import html

from studio_core.machine.hardware import Hardware
from studio_core.machine.layout import tp_groups
from studio_core.training.memory import WARN_FRACTION, gib

GROUP_COLOURS = ("#268bd2", "#2aa198", "#6c71c4", "#b58900", "#cb4b16", "#859900", "#d33682", "#073642")


def core_map_html(hardware: Hardware, cores: list[int], tp_size: int, held: dict[int, str], nodes: int = 0,
                  place: str = "") -> str:
    """`cores`: the run's cores in rank order; `held`: core -> who holds it (RunManager.core_holders).
    `nodes`: a cluster run's node count (then the map is one node's, and no core here is held), on
    `place` (the cluster's run backend's label: Slurm, Ray), which picks the nodes."""
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
    where = f" of each node, x {nodes} node{'s' if nodes > 1 else ''} ({place or 'the cluster'} picks them)" \
        if nodes else ""
    legend = (f"<div style='font-size:0.8em;margin-top:4px'>{len(cores)} of {count} {unit}s{where} for this run"
              + (f", TP groups of {tp_size} (one colour each)" if tp_size > 1 else "")
              + ("" if nodes else f"; {len(held)} held by others") + "</div>")
    return f"<div class='core-map'>{''.join(rows)}{legend}</div>"


PART_COLOURS = {"weights": "#268bd2", "a layer gathered by FSDP": "#2aa198", "LoRA adapters": "#6c71c4",
                "gradients": "#b58900", "optimizer state": "#cb4b16", "reference model": "#859900",
                "generation cache": "#d33682"}  # activations and the LM head: the two greys below


def memory_html(estimate, cores: int) -> str:
    """The estimated device memory of each of the run's cores (the busiest's: they are alike), as a
    bar of its parts against what a core has (training/memory.py's Estimate)."""
    if estimate is None:
        return ""
    if not estimate.parts:
        return (f"<div class='memory-bar' data-fraction='' style='font-size:0.85em;margin-top:6px'>Memory per core "
                f"not estimated: {html.escape('; '.join(estimate.not_counted))}</div>")
    whole = max(estimate.available or 0, estimate.total)
    segments = []
    for name, size in estimate.parts.items():
        colour = PART_COLOURS.get(name, "#586e75" if name.startswith("LM head") else "#93a1a1")
        if size:
            segments.append(f"<div class='memory-part' data-part='{html.escape(name)}' title='{html.escape(name)}: "
                            f"{gib(size)}' style='background:{colour};width:{size / whole * 100:.2f}%;height:16px'>"
                            "</div>")
    fraction = estimate.fraction
    # at LNC=1 a core's share is half a bank it may use whole (estimate.limit): past the share, a warning
    over = fraction is not None and estimate.total > (estimate.limit or estimate.available)
    tight = fraction is not None and fraction > WARN_FRACTION
    colour = "#dc322f" if over else "#cb4b16" if tight else "#586e75"
    of = f" of {gib(estimate.available)} ({fraction:.0%})" if fraction is not None else \
        " (what a core has is not known)"
    if not over and estimate.limit and fraction is not None and fraction > 1:
        of += f"; fits only while the core sharing its memory bank uses less (up to {gib(estimate.limit)})"
    limit = (f"<div style='position:absolute;left:{estimate.available / whole * 100:.2f}%;top:-2px;bottom:-2px;"
             "border-left:2px solid #dc322f' title='what a core has'></div>" if estimate.available else "")
    legend = ", ".join(f"{name} {gib(size)}" for name, size in estimate.parts.items() if size)
    return (f"<div class='memory-bar' data-fraction='{'' if fraction is None else f'{fraction:.3f}'}' "
            f"style='margin-top:8px;font-size:0.85em'>"
            f"<div style='color:{colour}'>Device memory, each of the run's {cores} core(s): about "
            f"{gib(estimate.total)}{of}, estimated from the model's config</div>"
            f"<div style='position:relative;display:flex;background:#eee8d5;border-radius:3px;margin:3px 0'>"
            f"{''.join(segments)}{limit}</div><div style='color:#657b83'>{html.escape(legend)}</div></div>")
