"""What the scripts of every backend write alike: the plan's environment as the shell exports it,
a run's name as one safe word, and a line on how a mesh spans machines."""

from __future__ import annotations

import re
import shlex


def export_lines(env: dict) -> list[str]:
    """The plan's environment as the shell exports it, every value quoted; PYTHONPATH prepended to
    the one the script finds (Plan.env's rule). ValueError on a name the shell cannot export."""
    env = dict(env)
    python_path = env.pop("PYTHONPATH", None)
    bad_keys = [key for key in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)]
    if bad_keys:
        raise ValueError(f"environment variable names the shell cannot export: {bad_keys}")
    return ([f"export PYTHONPATH={shlex.quote(python_path)}${{PYTHONPATH:+:$PYTHONPATH}}"] if python_path else []) + [
        f"export {key}={shlex.quote(str(value))}" for key, value in env.items()]


def job_name(display_name: str) -> str:
    """A run's name as a job's label (a Slurm job name, a script's comment): a label, nothing more,
    so anything but letters, digits and `_ . -` becomes `_` (a line break would end the line)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", display_name)[:64]


def mesh_note(layout) -> list[str]:
    """A comment on how a TP/FSDP layout spans several machines, for the scripts' headers."""
    if layout.tp_size == 1 and layout.fsdp_size == 1:
        return []
    return [f"# Each node runs one TP {layout.tp_size} x FSDP {layout.fsdp_size} mesh; the worker replicates it "
            "across nodes (DistributedConfig dp_replicate_size = the number of nodes: HSDP)."]
