"""README.md's commands, run as written: every command line of its fenced shell blocks
(```bash, ```sh, ```shell, ```console) either runs here, in README order, as a real process
from the repository root, or is in NOT_RUN with the reason.

A command must start with `.venv/bin/python`, `bash` or `python3 -m venv` (the set-up makes
.venv and never activates it). The ones run are `.venv/bin/python launch.py COMMAND ...`, each
checked by AFTER[COMMAND]: exit 0, the line that says it worked, and what it made. Before a
command runs, its words are filled in:

- `[--option ...]`, an optional part, is kept (exercised), unless DROPPED lists it with the reason;
- `a|b|c`, a choice, becomes its first word `a`;
- RUN_ID becomes the id the latest `train` command printed (`Run ID started`): the block starts a
  run with --detach, stops it with --save, resumes it, and chats with and exports that run;
- STEP becomes the step the latest `stop --save` said to resume from;
- DIR becomes a new folder in the test's temporary folder.

Isolation is by environment, so the commands need no option the README does not show: the runs
folder is STUDIO_RUNS_DIR and the compile cache STUDIO_COMPILE_CACHE, both in the test's
temporary folder. HF_TOKEN is set for every command, and no output or file of theirs may hold it;
a command with `--push` talks to HubStandIn (tests/hub_standin.py) on 127.0.0.1, whose user owns
the namespace of the README's repo id; every other one runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


from conftest import run_folders
from hub_standin import HubStandIn
from studio_core.data.builtin import BUILTIN_DATASETS
from studio_core.machine.procs import kill_run_processes
from studio_core.runs.manager import RunManager
from studio_core.runs import queue
from studio_core.recipe.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
COMMAND_TIMEOUT_S = 300  # a hang guard: the slowest command here takes about 15 s on 2 cores
STARTS = ([".venv/bin/python"], ["bash"], ["python3", "-m", "venv"])
TOKEN = "hf_readme_0123456789abcdef"

# README command (as as_line writes its words) -> why this test does not run it
NOT_RUN = {
    ".venv/bin/python launch.py train recipes/tiny-vlm-sft.yaml --set max_steps=60":
        "tests/test_vlm_train.py trains this recipe (120 steps) and loads its saved model with plain Transformers",
    "python3 -m venv .venv && .venv/bin/pip install -r requirements-cpu.txt && .venv/bin/python launch.py":
        "the set-up itself: it made the .venv this test runs in, then serves the web app until it is stopped "
        "(tests/test_serve.py and the browser tests start the app)",
    "bash .ci/run": "CI itself: it installs Debian packages as root, then runs the whole test suite, this test "
                    "included",
    ".venv/bin/python launch.py serve RUN_ID --port 8000":
        "serves until it is stopped: tests/test_openai_api.py (the studio's engine) and tests/test_vllm.py (vLLM) "
        "start it on runs with a key and ask it through the openai client",
    ".venv/bin/python launch.py serve --setup-vllm":
        ".ci/run runs it before the tests, and tests/test_vllm.py serves with the .venv-vllm it made; here it "
        "would reinstall vLLM",
    ".venv/bin/python launch.py doctor": "tests/test_doctor.py runs it (and checks its lines); its 2-process "
                                         "all-reduce and compiled steps would add a minute here",
}
# (launch.py command, optional part's option) -> why it is left out when the command runs
DROPPED = {
    ("export", "--merge"): "RUN_ID trained the full model, which has no adapter to merge (export refuses "
                           "--merge then); tests/test_export.py runs `launch.py export --merge --push` on a LoRA run",
}
QA = {json.loads(line)["messages"][0]["content"]: json.loads(line)["messages"][1]["content"]
      for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()}
CHAT_INPUT = "What is the name of the studio cat?"  # what an interactive chat is told, before its end of input
assert CHAT_INPUT in QA


def readme_commands(text: str) -> list[list[str]]:
    """The words of each command line of the fenced shell blocks, comments left out, in order."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def as_line(words: list[str]) -> str:
    """A command's words as one line, quoted as the shell reads them (its operators left bare)."""
    return " ".join(word if word in ("&&", "||", ";", "|") else shlex.quote(word) for word in words)


def launch_command(words: list[str]) -> str | None:
    """The launch.py command of `.venv/bin/python launch.py COMMAND ...` (serve when none); else None."""
    if words[:2] != [".venv/bin/python", "launch.py"] or "&&" in words or ";" in words:
        return None
    return words[2] if len(words) > 2 and not words[2].startswith("-") else "serve"


def filled_in(words: list[str], command: str) -> list[str]:
    """The words with their optional parts kept (or DROPPED) and each choice its first word."""
    out, group = [], None
    for word in words:
        if group is None and word.startswith("[-"):
            group, word = [], word[1:]
        if group is None:
            out.append(word)
            continue
        closed = word.endswith("]")
        group.append(word[:-1] if closed else word)
        if closed:
            out += [] if (command, group[0]) in DROPPED else group
            group = None
    assert group is None, f"an optional part is not closed in: {as_line(words)}"
    return [word.split("|")[0] if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", word) else word for word in out]


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# --- what each command must have done ----------------------------------------------------------
@dataclass
class Session:
    tmp: Path
    runs_dir: Path
    compile_cache: Path
    hub: HubStandIn
    run_id: str | None = None  # RUN_ID: the latest run `train` started
    step: str | None = None  # STEP: the latest `stop --save`'s checkpoint
    folders: list[Path] = field(default_factory=list)  # DIR: each a new folder
    outputs: list[str] = field(default_factory=list)
    evaluated: dict | None = None  # the latest `eval --json` results

    @property
    def manager(self) -> RunManager:
        return RunManager(self.runs_dir)

    def substitute(self, word: str) -> str:
        if word == "RUN_ID":
            assert self.run_id, "RUN_ID before any `train` command started a run"
            return self.run_id
        if word == "STEP":
            assert self.step, "STEP before any `stop --save` made a checkpoint"
            return self.step
        if word == "DIR":
            self.folders.append(self.tmp / f"dir-{len(self.folders) + 1}")
            return str(self.folders[-1])
        return word

    def env(self, args: list[str]) -> dict[str, str]:
        env = {**os.environ, "STUDIO_RUNS_DIR": str(self.runs_dir), "STUDIO_COMPILE_CACHE": str(self.compile_cache),
               "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
        if "--push" in args:
            env |= {"HF_ENDPOINT": self.hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
        return env


def after_train(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    if "--resume" in args:
        run_id = option(args, "--resume")
        since = option(args, "--from-checkpoint") or s.manager.view(run_id).resume_point()["step"]
        assert f"Run {run_id} resumed from step {since}; its folder: {s.runs_dir / run_id}" in done.stdout
        printed = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("step ")]
        assert printed and all(step > int(since) for step in printed), done.stdout  # no replay of the steps before
        finished_run(s, run_id, done, RunSpec.load(s.runs_dir / run_id / "spec.yaml"))
        return
    started = re.search(r"^Run (\S+) started; its folder: (.+)$", done.stdout, re.M)
    assert started, done.stdout
    s.run_id = started[1]
    assert Path(started[2]) == s.runs_dir / s.run_id
    if "--detach" in args:
        assert s.manager.view(s.run_id).live_state in ("starting", "running")  # it goes on after the command
        return
    sets = [value for key, value in zip(args, args[1:]) if key == "--set"]
    finished_run(s, s.run_id, done, RunSpec.load(REPO / args[1]).with_overrides(sets))


def finished_run(s: Session, run_id: str, done: subprocess.CompletedProcess, expected: RunSpec) -> None:
    """A followed run that finished: what `train` printed, and what its folder holds."""
    import torch
    from transformers import AutoModelForCausalLM

    view = s.manager.view(run_id)
    assert f"Run {run_id}: finished (exit code 0)" in done.stdout
    assert f"Model saved in {view.dir / 'output'}" in done.stdout
    assert "loss" in done.stdout  # the metrics are shown as they come
    assert view.state == "finished" and view.exit_code == 0 and view.error_text is None
    nproc, max_steps, every = expected.layout.nproc, expected.args["max_steps"], expected.args["logging_steps"]
    assert view.world_size == nproc
    assert view.step == view.max_steps == max_steps
    losses = [m for m in view.metrics if "loss" in m]
    assert sorted({m["step"] for m in losses}) == sorted({1, *range(every, max_steps + 1, every)})
    assert all(m["loss"] > 0 and m["learning_rate"] > 0 for m in losses)
    assert view.duration() > 0 and view.started is not None and view.ended >= view.started

    model = AutoModelForCausalLM.from_pretrained(view.dir / "output")
    assert model.config.model_type == "qwen3"
    trained_with = torch.load(view.dir / "output" / "training_args.bin", weights_only=False)
    assert type(trained_with).__name__ == "SFTConfig"  # what the trainer really ran with
    assert (trained_with.max_steps, trained_with.run_name) == (max_steps, expected.run_name)
    assert trained_with.output_dir == str(view.dir / "output")
    launch = json.loads((view.dir / "launch.json").read_text())
    assert f"--nproc-per-node={nproc}" in launch["argv"] and "studio_core.training.worker" in launch["argv"]
    assert launch["env"]["STUDIO_RUN_ID"] == run_id
    saved = RunSpec.load(view.dir / "spec.yaml")  # the resolved spec
    assert saved.args["max_steps"] == max_steps and saved.run_name == expected.run_name
    assert view.spec == saved.to_dict()  # a plain yaml.safe_load of spec.yaml reads the same
    if launch["hardware"]["backend"] == "cpu":
        assert (trained_with.use_cpu, trained_with.bf16, trained_with.ddp_backend) == (True, False, "gloo")
        assert saved.args["use_cpu"] is True and saved.args["bf16"] is False
    assert (view.dir / "train.log").stat().st_size > 0


def after_stop(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    view = s.manager.view(args[1])
    assert view.live_state == "stopped" and view.error_text is None
    if "--save" not in args:
        assert f"Run {view.id}: stopped" in done.stdout
        return
    said = re.search(rf"^Run {view.id}: stopped; resume it from step (\d+) with "
                     rf"`launch.py train --resume {view.id}`$", done.stdout, re.M)
    assert said, done.stdout
    s.step = said[1]
    assert view.resume_point()["step"] == int(s.step) < view.max_steps


def after_runs(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    views = s.manager.list()
    assert views and done.stdout.startswith("run ")
    for view in views:
        (line,) = [line for line in done.stdout.splitlines() if line.startswith(view.id)]
        assert line.split()[1:3] == [view.live_state, f"{view.step}/{view.max_steps}"], line


def after_queue(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    queued = [path.name for path in queue.queued(s.manager.runs_dir)]
    listed = [line.split()[0] for line in done.stdout.splitlines()] if queued else done.stdout.splitlines()
    assert listed == (queued or ["No run is queued."]), done.stdout


def after_plan(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    expected = RunSpec.load(REPO / args[1])
    instance = option(args, "--instance")
    assert done.stdout.startswith(f"Hardware: {instance}:" if instance else "Hardware: ")
    assert f"--nproc-per-node={option(args, '--nproc') or expected.layout.nproc}" in done.stdout
    if "--tp" in args:
        assert f"DistributedConfig(tp_size={option(args, '--tp')}, fsdp_size={option(args, '--fsdp')})" in done.stdout
    if "--cores" in args and (instance or "").startswith("trn"):
        assert f"STUDIO_NEURON_CORES={option(args, '--cores')}" in done.stdout
    if "--no-forecast" not in args and expected.model_name_or_path.startswith("builtin:"):
        # the built-in model is here: the forecast for the instance, Neuron's padding to max_length
        assert "Shape forecast (SFT" in done.stdout and f"x {expected.args['max_length']}" in done.stdout
    elif "--no-forecast" not in args:  # a Hub model not in this machine's cache: said, not fetched
        assert "No shape forecast: " in done.stdout


def before_cache(s: Session, args: list[str]) -> None:
    if "--clear" in args:  # something for it to clear
        folder = s.compile_cache / (option(args, "--backend") or "cpu") / "inductor" / "fxgraph"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "entry").write_bytes(b"x" * 1000)


def after_cache(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    backend = option(args, "--backend") or "cpu"
    folder = s.compile_cache / backend
    if "--clear" in args:
        assert f"Cleared {folder}" in done.stdout
        assert not folder.exists() or not any(folder.rglob("*"))
    assert f"{folder}: " in done.stdout


def after_chat(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    prompt = option(args, "--prompt") or CHAT_INPUT
    answer = QA.get(prompt)
    if "--base" in args:  # the built-in base is random: its answer (or the empty-answer line) in a line of its own
        said = [line.removeprefix("you> ") for line in done.stdout.splitlines() if line.strip() != "you>"]
        assert said[0] == f"[tuned] {answer}" and said[1].startswith("[base] "), done.stdout
        assert said[1].removeprefix("[base] ").strip() and "\n\n" not in "\n".join(said[1:]), done.stdout
        assert "The base model is untrained" in done.stderr and "randomly initialised" in done.stderr
    elif answer:
        assert done.stdout.strip() == answer  # the run learned the built-in Q&A set
    else:
        assert done.stdout.strip()
    assert "distinct input shapes so far" in done.stderr


def after_eval(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    """The run learned the built-in Q&A set, its random base did not: on the Q&A questions (its own
    data, said), the tuned model's exact match is at least 0.75 and the base's at most 0.25."""
    if "--json" in args:
        [line] = done.stdout.strip().splitlines()  # one JSON object on stdout, for scripts
        results = json.loads(line)
    else:
        assert "the run's training data" in done.stdout and "exact_match" in done.stdout
        return
    assert results["tuned"]["exact_match"] >= 0.75 and results["base"]["exact_match"] <= 0.25, results
    assert results["tuned"]["eval_loss"] < results["base"]["eval_loss"]
    s.evaluated = results
    assert "rows.jsonl" in done.stderr


def after_export(s: Session, args: list[str], done: subprocess.CompletedProcess) -> None:
    from huggingface_hub import ModelCard

    out = Path(option(args, "--out"))
    kind = "merged" if "--merge" in args else "full"
    assert done.stdout.startswith(f"Exported {kind} model to {out}: "), done.stdout
    assert json.loads((out / "studio_output.json").read_text())["kind"] == kind
    assert (out / "README.md").is_file() and (out / "config.json").is_file()
    if s.evaluated:  # the card carries the evaluation (the only one) as the Hub's model-index results
        card = ModelCard.load(out / "README.md")
        assert {r.metric_type: r.metric_value for r in card.data.eval_results} == s.evaluated["tuned"]
        assert "| exact_match |" in card.text
    repo = option(args, "--push")
    if repo:
        private = "--public" not in args
        assert f"Pushed ({'private' if private else 'public'}): {s.hub.url}/{repo}" in done.stdout
        pushed = s.hub.repos[repo]
        assert pushed["private"] is private
        assert f'repo_id = "{repo}"' in pushed["files"]["README.md"].decode()
        assert pushed["files"]["config.json"] == (out / "config.json").read_bytes()


BEFORE = {"cache": before_cache}
AFTER = {"train": after_train, "stop": after_stop, "runs": after_runs, "queue": after_queue, "plan": after_plan,
         "cache": after_cache,
         "chat": after_chat, "eval": after_eval, "export": after_export}


# --- the tests ------------------------------------------------------------------------------------
def test_every_readme_command_is_run_or_listed_with_a_reason():
    commands = readme_commands(README.read_text())
    lines = [as_line(words) for words in commands]
    assert len(commands) >= 10, lines  # the blocks were found
    for words, line in zip(commands, lines):
        assert any(words[:len(start)] == start for start in STARTS), (
            f"README command does not start with .venv/bin/python, bash or python3 -m venv: {line}")
        assert line in NOT_RUN or launch_command(words) in AFTER, (
            f"README command that tests/test_readme.py neither runs nor lists in NOT_RUN: {line}")
    assert set(NOT_RUN) <= set(lines), f"NOT_RUN names commands README no longer has: {set(NOT_RUN) - set(lines)}"
    for command, dropped in DROPPED:
        assert any(launch_command(words) == command and f"[{dropped}]" in words for words in commands), (
            f"DROPPED names {command} [{dropped}], which README no longer has")


def test_readme_commands_run_as_written(tmp_path):
    s = Session(tmp_path, tmp_path / "runs", tmp_path / "compile-cache",
                HubStandIn(tokens={TOKEN: {"user": "you", "orgs": []}}))
    commands = [words for words in readme_commands(README.read_text()) if as_line(words) not in NOT_RUN]
    assert any(launch_command(words) == "train" for words in commands)
    try:
        with s.hub:
            for words in commands:
                command = launch_command(words)
                assert command in AFTER, f"no rule to run this README command (nor a NOT_RUN reason): {as_line(words)}"
                args = [s.substitute(word) for word in filled_in(words, command)][2:]
                BEFORE.get(command, lambda *_: None)(s, args)
                before = sorted(p.name for p in run_folders(s.runs_dir)) if s.runs_dir.exists() else []
                interactive = command == "chat" and "--prompt" not in args
                done = subprocess.run([".venv/bin/python", "launch.py", *args], cwd=REPO, env=s.env(args),
                                      input=f"{CHAT_INPUT}\n" if interactive else "", capture_output=True,
                                      text=True, timeout=COMMAND_TIMEOUT_S)
                shown = f"{as_line(words)}\nran as: launch.py {shlex.join(args)}\n{done.stdout}\n{done.stderr}"
                assert done.returncode == 0, shown
                assert "Traceback" not in done.stdout + done.stderr, shown
                if command != "train":  # only train makes a run folder
                    assert sorted(p.name for p in run_folders(s.runs_dir)) == before, shown
                AFTER[command](s, args, done)
                s.outputs.append(done.stdout + done.stderr)
            assert s.hub.errors == []
    finally:
        for path in run_folders(s.runs_dir) if s.runs_dir.exists() else []:
            kill_run_processes(path.name)
    assert s.run_id and s.step and s.folders, "the block no longer starts, stops or exports a run"
    assert all(TOKEN not in output for output in s.outputs)
    for path in [*s.runs_dir.rglob("*"), *(p for folder in s.folders for p in folder.rglob("*"))]:
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), f"the token was written to {path}"
