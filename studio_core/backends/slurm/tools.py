"""Talking to Slurm: its commands (sinfo, sbatch, squeue, scontrol, scancel), what they print,
and the checks of what a user types for it (partition and account names, time limits, extra
sbatch options): one rule, which the recipe's check, the command line, the form and the
Slurm backend all apply, so that no value can add a line to a batch script or a word to sbatch's.

Only Slurm's own command-line tools are used, found on PATH; they find the cluster the
usual way (slurm.conf, or $SLURM_CONF). The parsing functions are pure.

A job id is a plain job's number (123) or a task of a job array (123_4, a sweep's run), which
every command here takes as it is. How Slurm 22.05 (Debian 12) shows an array's tasks, read on a
real cluster: squeue lists the tasks still waiting as one line (123_[4-7%2]) unless asked for
one line each (-r); `squeue -j 123_4` lists a waiting task as 123_4; `scancel 123_4` cancels that
task alone, waiting or running; a task that ran is in `scontrol show job 123_4` as any job is (its
own JobId, ArrayJobId=123 ArrayTaskId=4) for MinJobAge, but a waiting task cancelled alone is
dropped at once ("Job 123_4 not found"), so only accounting (sacct), where there is any, still
knows it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
import unicodedata
from dataclasses import dataclass

COMMAND_TIMEOUT_S = 20
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
# Options of sbatch the studio sets itself, or that would break the run it submits; the
# studio's own setting for each, which the user changes instead.
OWNED = {
    "--output": "the studio writes every node's output to the run's train.log",
    "--error": "the studio writes every node's output to the run's train.log",
    "--input": "the run reads no standard input",
    "--open-mode": "train.log is appended to, so a resumed run keeps its earlier log",
    "--chdir": "the job starts in the run folder",
    "--nodes": "set Nodes (--nodes of `launch.py train --slurm`) instead",
    "--ntasks": "the studio starts one task per node, the node's supervisor",
    "--ntasks-per-node": "the studio starts one task per node, the node's supervisor",
    "--job-name": "the job is named after the run",
    "--partition": "set Partition (--partition) instead",
    "--time": "set Time limit (--time) instead",
    "--account": "set Account (--account) instead",
    "--parsable": "the studio reads the job id itself",
    "--wrap": "the studio submits its own batch script",
    "--array": "a run is one job; a sweep submits its Slurm runs as one job array (launch.py sweep)",
    "--export": "every node's supervisor needs the environment the job was submitted with",
    "--requeue": "a requeued job starts over from step 0 in the same run folder; Resume goes on from a checkpoint",
    "--ntasks-per-core": "the studio starts one task per node, the node's supervisor",
    "--ntasks-per-socket": "the studio starts one task per node, the node's supervisor",
    "--ntasks-per-gpu": "the studio starts one task per node, the node's supervisor",
    "--ntasks-per-tres": "the studio starts one task per node, the node's supervisor",
}
SHORT = {"-o": "--output", "-e": "--error", "-i": "--input", "-D": "--chdir", "-N": "--nodes", "-n": "--ntasks",
         "-J": "--job-name", "-p": "--partition", "-t": "--time", "-A": "--account", "-a": "--array"}
TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}", re.ASCII)


class SlurmError(RuntimeError):
    """A Slurm command is missing or failed; the message says which and what it printed."""


def _run(*argv: str, timeout: float = COMMAND_TIMEOUT_S, cwd: str | None = None) -> str:
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` is not on PATH: run the studio on a Slurm login node (or install "
                         "Slurm's client commands and point them at the cluster with SLURM_CONF)")
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` got no answer in {timeout:g} s: is Slurm's controller "
                         "(slurmctld) up?") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"`{' '.join(argv)}` failed: {said[-1] if said else f'exit code {done.returncode}'}")
    return done.stdout


# --- checks of what the user types (pure) ------------------------------------------------
# One rule for every Slurm value, used by the recipe's check (spec.validate), the command line,
# the form and the backend itself: a value that passes cannot change the batch script's lines
# or sbatch's arguments beyond the one setting it is for.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")  # partition, account: as Slurm lists them
OPTION = re.compile(r"(--[a-z][a-z0-9-]*)(?:(?:=| +)(\S(?:.*\S)?))?")  # --name, --name=value, --name value
VALUE = re.compile(r"[A-Za-z0-9_.,:/@%+=~^*&|!\[\]() -]+")  # nodes n[1-4], features a&b|c, mail a@b, ...
VALUE_CHARS = "letters, digits, spaces and _ . , : / @ % + = ~ ^ * & | ! [ ] ( ) -"
# Options that make sbatch submit nothing, or not return until the job ends.
REFUSED = {
    "--wait": "sbatch would not return until the job ends; the studio follows the job itself",
    "--test-only": "sbatch would submit nothing; Preview shows the batch script without submitting",
    "--help": "sbatch would print its help and submit nothing",
    "--usage": "sbatch would print its usage and submit nothing",
    "--version": "sbatch would print its version and submit nothing",
    "--export-file": "every node's supervisor needs the environment the job was submitted with",
}
EXAMPLES = "e.g. --exclusive, --gres=neuron:16 or --qos=high"


def _odd_character(text: str) -> str | None:
    """The first character of `text` that is a control or format character (a line break, a
    tab, an escape...), named, or None."""
    for char in text:
        if unicodedata.category(char).startswith("C"):
            return {"\n": "a line break", "\r": "a carriage return", "\t": "a tab"}.get(
                char, f"the control character {char!r}")
    return None


def _named(chars: set[str]) -> str:
    """Characters as a message names them: ' ' and ';'."""
    listed = [repr(c) for c in sorted(chars)]
    return " and ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 1 else listed)


def check_name(label: str, value, what: str, example: str) -> str | None:
    """A problem with a partition's or an account's name, or None."""
    if not isinstance(value, str):
        return f"{label}: {value!r} is not text; write it in quotes"
    if NAME.fullmatch(value):
        return None
    odd = _odd_character(value)
    bad = {c for c in value if not re.fullmatch(r"[A-Za-z0-9_.-]", c)}
    why = (f"it holds {odd}" if odd else "it is empty" if not value else "it is longer than 64 characters"
           if len(value) > 64 else f"it holds {_named(bad)}" if bad else "it starts with . or -")
    return (f"{label}: {value!r} is not a Slurm {what} name ({why}): write the name as Slurm lists it, "
            f"letters, digits, '_', '.' and '-' (e.g. {example})")


def check_time(text) -> str | None:
    """A problem with a Slurm time limit, or None. Slurm's forms: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds, UNLIMITED."""
    if isinstance(text, str) and (TIME.fullmatch(text) or text.upper() in ("UNLIMITED", "INFINITE")):
        return None
    odd = _odd_character(text) if isinstance(text, str) else None
    return (f"Slurm time limit {text!r}{f' holds {odd} and' if odd else ''} is not one Slurm reads: write minutes "
            "(90), hours:minutes:seconds (1:30:00) or days-hours:minutes:seconds (2-00:00:00)")


def check_nodes(nodes, label: str = "studio.nodes") -> str | None:
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1:
        return None
    return f"{label}: {nodes!r} must be a whole number of nodes, 1 or more"


def _owner(name: str) -> str | None:
    """Why the studio refuses this option name (one it owns, or one that submits nothing), or
    None. sbatch reads a shortened long name (--out) as the option it begins, so a beginning of
    one of them is refused as that one."""
    if name in OWNED:
        return f"the studio owns {name} ({OWNED[name]})"
    if name in REFUSED:
        return f"{name} is refused: {REFUSED[name]}"
    begun = next((full for full in (*OWNED, *REFUSED) if full.startswith(name)), None)
    if begun:
        return f"sbatch reads {name} as {begun}, the option it begins: {_owner(begun)}"
    return None


def sbatch_words(args: list) -> tuple[list[str], list[str]]:
    """The extra sbatch options as sbatch gets them (each one word: --name or --name=value) and
    the problems with them. A word that is no option, after an option without a value, is that
    option's value (["--qos", "high"]: the form's line split, or a recipe's list)."""
    items: list[str] = []
    for arg in args:
        if (isinstance(arg, str) and items and not arg.startswith("-") and items[-1].startswith("-")
                and not re.search(r"[= ]", items[-1])):
            items[-1] = f"{items[-1]} {arg}"
        else:
            items.append(arg)
    words, problems = [], []
    for item in items:
        if not isinstance(item, str):
            problems.append(f"extra sbatch option {item!r} is not text; write it in quotes")
            continue
        odd = _odd_character(item)
        if odd:
            problems.append(f"extra sbatch option {item!r} holds {odd}: write each option on one line as "
                            f"--name=value ({EXAMPLES})")
            continue
        if item.startswith("-") and not item.startswith("--"):
            short = SHORT.get(item[:2])
            problems.append(f"extra sbatch option {item!r}: " + (
                f"the studio owns {short} ({OWNED[short]})" if short in OWNED else
                "write the option's long name (sbatch --help lists them), e.g. --qos=high for -q high"))
            continue
        match = OPTION.fullmatch(item)
        if not match:
            problems.append(f"extra sbatch option {item!r} is not an option: write each as --name or --name=value, "
                            f"{EXAMPLES}")
            continue
        name, value = match.groups()
        owner = _owner(name)
        if owner:
            problems.append(f"extra sbatch option {item!r}: {owner}")
        elif value is not None and not VALUE.fullmatch(value):
            bad = _named({c for c in value if not VALUE.fullmatch(c)})
            problems.append(f"extra sbatch option {item!r}: its value holds {bad}, which no sbatch option needs; "
                            f"write the value with {VALUE_CHARS}")
        else:
            words.append(name if value is None else f"{name}={value}")
    return words, problems


def check_sbatch_args(args: list) -> list[str]:
    """Problems with extra sbatch options: ones the studio owns, and words that are no option."""
    return sbatch_words(args)[1]


def check_options(options: dict, labels: dict | None = None) -> list[str]:
    """Every problem with a studio.slurm block's values (partition, time, account, sbatch_args),
    each under its label: `labels` maps a key to what the user typed it in (--account, Account);
    the recipe's key by default."""
    def label(key: str) -> str:
        return (labels or {}).get(key, f"studio.slurm.{key}")

    problems = []
    for key, what, example in (("partition", "partition", "trn"), ("account", "account", "ml-team")):
        if key in options:
            problems += [p for p in [check_name(label(key), options[key], what, example)] if p]
    if "time" in options:
        value = options["time"]
        problem = check_time(value) if isinstance(value, str) else f"{value!r} is not text; write it in quotes"
        problems += [f"{label('time')}: {problem}"] if problem else []
    extra = options.get("sbatch_args", [])
    if not isinstance(extra, list):
        problems.append(f"{label('sbatch_args')}: write a list of options, e.g. [--qos=high, --exclusive]")
    else:
        problems += [f"{label('sbatch_args')}: {problem}" for problem in check_sbatch_args(extra)]
    return problems


def split_args(text: str) -> list[str]:
    """The extra sbatch options typed on one line, split as a shell would (ValueError on bad quoting)."""
    return shlex.split(text or "")


# --- what the commands print (pure) ------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    default: bool
    max_time: str
    up: bool


def parse_sinfo(text: str) -> dict[str, Partition]:
    """`sinfo -h -o %P|%D|%l|%a` -> {name: Partition}. A partition over several lines (nodes in
    several states) adds its node counts up."""
    found: dict[str, Partition] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[1].isdigit():
            continue
        name, nodes, max_time, avail = parts
        default = name.endswith("*")
        name = name.rstrip("*")
        before = found.get(name)
        found[name] = Partition(name, int(nodes) + (before.nodes if before else 0),
                                default or bool(before and before.default), max_time, avail == "up")
    return found


def parse_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` (KEY=VALUE words) -> {KEY: VALUE}."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


@dataclass(frozen=True)
class Job:
    id: str
    state: str  # Slurm's: PENDING, RUNNING, COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL, FAILED, ...
    reason: str  # why it waits or ended ("Resources", "Priority", "None")
    nodes: str  # e.g. n[1-2]; empty while pending

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def describe(self) -> str:
        text = f"Slurm job {self.id}: {self.state}"
        if self.state == "PENDING":
            return f"{text} ({self.reason})" if self.reason and self.reason != "None" else text
        if self.nodes:
            text += f" on {self.nodes}"
        return text + (f" ({self.reason})" if self.reason not in ("", "None") else "")


def array_task(job_id: str) -> tuple[str, int] | None:
    """A job array's task id (123_4) as (array id, task index); None for a plain job's id."""
    match = re.fullmatch(r"(\d+)_(\d+)", str(job_id))
    return (match.group(1), int(match.group(2))) if match else None


def lists(listed: str, job_id: str) -> bool:
    """Does squeue's job id `listed` stand for `job_id`: the same id, or, for a task of a job array,
    the array's line of tasks that holds it (123_[4-7%2], 123_[1,3-5:2]: ranges, steps, a throttle)?"""
    if listed == job_id:
        return True
    task, match = array_task(job_id), re.fullmatch(r"(\d+)_\[([0-9,:%-]+)\]", listed)
    if task is None or match is None or match.group(1) != task[0]:
        return False
    for part in match.group(2).split("%")[0].split(","):
        bounds, _, step = part.partition(":")
        first, _, last = bounds.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or not (step or "1").isdigit():
            continue
        first_i, last_i, step_i = int(first), int(last or first), max(int(step or 1), 1)
        if first_i <= task[1] <= last_i and (task[1] - first_i) % step_i == 0:
            return True
    return False


def parse_squeue(job_id: str, text: str) -> Job | None:
    """`squeue -h -r -j ID -o %i|%T|%r|%N` -> the job, or None when Slurm no longer lists it.
    The line whose id stands for ID is read (`lists`: a task of a job array may be listed on its
    array's line of waiting tasks); a line without an id (`-o %T|%r|%N`) is the job's."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            return Job(job_id, *parts)
        if len(parts) == 4 and lists(parts[0], job_id):
            return Job(job_id, *parts[1:])
    return None


def parse_sacct(text: str) -> dict[str, str] | None:
    """`sacct -n -P -X -j ID -o State,ExitCode,NodeList,Timelimit` -> the fields as scontrol names
    them (JobState, ExitCode, NodeList, TimeLimit), from the last line (a requeued job's latest
    start); None when it lists nothing. Its State may say who cancelled ("CANCELLED by 0"): the
    first word is the state."""
    lines = [line.strip().split("|") for line in text.splitlines() if line.strip()]
    if not lines or len(lines[-1]) != 4:
        return None
    state, exit_code, nodes, limit = lines[-1]
    return {"JobState": (state.split() or [""])[0], "ExitCode": exit_code,
            "NodeList": "" if nodes.startswith("None") else nodes, "TimeLimit": limit}


# --- the commands ------------------------------------------------------------------------
def partitions() -> dict[str, Partition]:
    return parse_sinfo(_run("sinfo", "-h", "-o", "%P|%D|%l|%a"))


def submit(script: str, cwd: str, extra: list[str] = ()) -> str:
    """sbatch the script file (with the user's `extra` options), in `cwd`; the job id."""
    try:
        out = _run("sbatch", "--parsable", *extra, script, cwd=cwd, timeout=60)
    except SlurmError as error:
        raise SlurmError(f"sbatch refused the job: {error}") from None
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {out.strip()!r}")
    return job_id


_QUEUE: dict[str, tuple[float, Job | None]] = {}
QUEUE_TTL_S = 1.0  # a page redraws every second: one squeue per job per second at most


def queued(job_id: str) -> Job | None:
    """The job as squeue lists it (None when it is no longer listed). SlurmError when the
    controller does not answer."""
    known = _QUEUE.get(job_id)
    if known and time.monotonic() - known[0] < QUEUE_TTL_S:
        return known[1]
    try:
        job = parse_squeue(job_id, _run("squeue", "-h", "-r", "-j", job_id, "-o", "%i|%T|%r|%N"))
    except SlurmError as error:
        if "Invalid job id" not in str(error):
            raise
        job = None  # ended long enough ago that Slurm has forgotten it
    _QUEUE[job_id] = (time.monotonic(), job)
    return job


def record(job_id: str) -> dict[str, str] | None:
    """`scontrol show job`'s fields (JobState, Reason, ExitCode, NodeList, TimeLimit, ...); once the
    controller has forgotten the job (MinJobAge after it ended, 300 s by default; at once for a
    waiting array task cancelled alone), accounting's (`accounted`), else None."""
    try:
        return parse_fields(_run("scontrol", "show", "job", "-o", job_id)) or None
    except SlurmError as error:
        if "Invalid job id" not in str(error) and f"Job {job_id} not found" not in str(error):
            raise
    return accounted(job_id)


def accounted(job_id: str) -> dict[str, str] | None:
    """How the job ended as Slurm's accounting (sacct) keeps it, or None where there is none (no
    sacct, accounting off: "Slurm accounting storage is disabled") or it does not know the job."""
    try:
        return parse_sacct(_run("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,NodeList,Timelimit"))
    except SlurmError:
        return None


def parse_node_states(text: str) -> dict[str, tuple[str, str]]:
    """`sinfo -h -N -n NODES -o %N|%T|%E` -> {node: (state, reason)} of the nodes that are down or
    failing (a state ending in * is a node that does not respond)."""
    found = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and (parts[1].startswith(("down", "fail")) or parts[1].endswith("*")):
            found[parts[0]] = (parts[1], parts[2] if parts[2] not in ("", "none") else "no reason given")
    return found


def failed_nodes(nodes: str) -> dict[str, tuple[str, str]]:
    """Of these nodes (n[1-2]), the ones Slurm has down or failing, with its reason."""
    if not nodes or nodes in ("?", "(null)"):
        return {}
    return parse_node_states(_run("sinfo", "-h", "-N", "-n", nodes, "-o", "%N|%T|%E"))


def first_node_address(nodes: str) -> str:
    """The address (NodeAddr) of the first of these nodes (n[1-2]), where a job's rendezvous is."""
    first = _run("scontrol", "show", "hostnames", nodes).split()[0]
    return parse_fields(_run("scontrol", "show", "node", "-o", first)).get("NodeAddr") or first


def cancel(job_id: str) -> None:
    _QUEUE.pop(job_id, None)
    _run("scancel", job_id)


def auto_resume_supported() -> bool:
    """Does this cluster's srun take HyperPod's --auto-resume (the SageMaker HyperPod Slurm
    plugin adds it to srun's options)?"""
    try:
        return "--auto-resume" in _run("srun", "--help")
    except SlurmError:
        return False
