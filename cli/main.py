"""The command line's parser and main(argv): each command's options, and the exit code of a refused spec."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from cli.cache import cmd_cache
from cli.chat import cmd_chat
from cli.doctor import cmd_doctor
from cli.eval import add_parser as add_eval_parser
from cli.export import cmd_export
from cli.fields import add_flags, add_layout_flags, flags, values_joined
from cli.options import CommandLineError, picked_by_option, repeated_flags, whole_number
from cli.serve import cmd_serve
from cli.sweep import cmd_sweep
from cli.train import cmd_plan, cmd_queue, cmd_runs, cmd_stop, cmd_train
from studio_core.backends import BACKENDS, EXPORT, StopError, with_options
from studio_core.machine import compile_cache
from studio_core.serve.chat import BATCH_BUCKETS, MAX_CACHE_LEN, SMALLEST_LENGTH
from studio_core.machine.hardware import INSTANCES, LNC_VALUES, CpuCoresError, Target
from studio_core.runs.manager import DamagedRun, LeaseFolderError, RunNotFound, default_runs_dir, run_id_given
from studio_core.runs.queue import QueueError
from studio_core.runs.sweep import EVAL_LIMIT as DEFAULT_EVAL_LIMIT, MAX_RUNS
from studio_core.recipe.spec import Layout, SpecError

USAGE = """Trainium fine-tuning studio: the web app, and the same jobs headless.

    python launch.py                          start the web app on http://127.0.0.1:7860
    python launch.py train RECIPE.yaml        train, with a progress bar; Ctrl-C stops the run
    python launch.py plan RECIPE.yaml         print the exact command, environment and shape forecast; runs nothing
    python launch.py runs                     list the runs in the runs folder
    python launch.py queue [RUN_ID --to N]    the queued runs (a run whose cores are busy waits); move one
    python launch.py sweep RECIPE --grid K=A,B   a run per combination of values, through the queue [--wait --eval]
    python launch.py stop RUN_ID [--save]     stop a run (--save: a checkpoint first, to resume from)
    python launch.py train --resume RUN_ID    go on from the run's last checkpoint [--from-checkpoint STEP]
    python launch.py train RECIPE --slurm     submit to a Slurm cluster [--nodes N --partition P --time T]
    python launch.py chat RUN_OR_MODEL        chat with a run's model (--prompt TEXT: ask once)
    python launch.py eval RUN_ID              the tuned model against its base [--data FILE|HUB_ID] [--json]
    python launch.py export RUN_ID --out DIR  a model folder with a card [--merge] [--push REPO_ID]
    python launch.py cache [--clear]          show the compile cache (folder, size, entries); clear it
    python launch.py doctor                   check this machine for the studio: run it first on a new machine
    python launch.py doctor --smoke           then the first-run kit: the studio's jobs end to end, one report file

Every command takes --runs-dir (default $STUDIO_RUNS_DIR, else ~/trn-studio/runs).
"""

COMMANDS = ("serve", "train", "plan", "sweep", "runs", "queue", "stop", "cache", "chat", "eval", "export", "doctor")


def main(argv: list[str]) -> int:
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):  # serve takes no word of its own
        parser().error(f"unknown command {argv[0]!r}{did_you_mean(argv[0])}: the commands are "
                       f"{', '.join(COMMANDS)} (none: serve, the web app)")
    # serve is the default command: `launch.py --port 8000` is `launch.py serve --port 8000`
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["serve", *argv]
    args = parser().parse_args(values_joined(argv, repeated_flags()))  # --sbatch-arg --qos=high
    try:
        run_ids(args)
        return args.func(args)
    except SpecError as error:
        print(f"Cannot launch: fix these and try again:\n{error}", file=sys.stderr)
        return 2
    except RunNotFound as error:
        print(f"{error.args[0]}: `launch.py runs` lists the runs (add --runs-dir for another runs folder)",
              file=sys.stderr)
        return 2
    except DamagedRun as error:
        print(error, file=sys.stderr)
        return 2
    except StopError as error:
        print(f"Not stopped: {error}", file=sys.stderr)
        return 1
    except (CommandLineError, CpuCoresError, QueueError, LeaseFolderError) as error:
        print(error, file=sys.stderr)
        return 2


def run_ids(args) -> None:
    """A run given as the path of its folder, when that folder is (symlinks resolved) in the runs
    folder, becomes its run id, for every command that takes one; any other path is left as
    given, for the command to refuse (or, for chat, eval and serve, to take as a model folder).

    Then the run's spec.yaml is read by the one rule (folder.read_spec): a damaged one is refused
    (DamagedRun, naming the file, the run and what is wrong) by every command that uses the run;
    stop only ends processes, so it still stops a run whose spec.yaml is damaged."""
    runs_dir = Path(args.runs_dir).expanduser() if getattr(args, "runs_dir", None) else default_runs_dir()
    for name in ("run_id", "resume", "target"):
        given = getattr(args, name, None)
        if not isinstance(given, str):
            continue
        setattr(args, name, run_id_given(runs_dir, given, read=args.command != "stop"))


def did_you_mean(word: str) -> str:
    if word.endswith((".yaml", ".yml")):
        return f" (to train this recipe: launch.py train {word})"
    close = difflib.get_close_matches(word, COMMANDS, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="launch.py", description=USAGE,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        sub.add_argument("--runs-dir", help="where run folders go (default $STUDIO_RUNS_DIR or ~/trn-studio/runs)")
        sub.set_defaults(func=func)
        return sub

    serve = command("serve", cmd_serve, "start the web app (the default command), or with a run id or model, an "
                    "OpenAI-compatible endpoint for it")
    serve.add_argument("target", nargs="*", metavar="RUN_OR_MODEL",
                       help="serve this run's model (or a model: a Hub id or folder) at /v1, OpenAI's API, instead "
                            "of the web app; several LoRA runs on one base: each its own model name, one base loaded")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=whole_number(1, 65535), help="port (default 7860 for the web app, 8000 for a "
                       "model)")
    serve.add_argument("--auth", help="the web app: user:password required to log in (needed for a non-loopback "
                       "--host)")
    serve.add_argument("--auth-file", help="the web app: file with one user:password per line")
    serve.add_argument("--api-key-file", help="a model: file holding the API key clients must send (needed for a "
                       "non-loopback --host)")
    serve.add_argument("--max-batch", type=int, choices=BATCH_BUCKETS, default=BATCH_BUCKETS[-1],
                       help="a model: at most this many requests decoded together, in batches of "
                            f"{', '.join(map(str, BATCH_BUCKETS))} at fixed shapes (default {BATCH_BUCKETS[-1]}; the "
                            "static KV cache has this many rows, its size is printed at start; 1: one request at a "
                            "time, as the Chat tab)")
    serve.add_argument("--max-queue", type=whole_number(1, 1024), default=32,
                       help="a model: requests that may wait for it (default 32); more get 503")
    serve.add_argument("--max-cache-len", type=whole_number(128, 16384), help="a model: its static cache's length "
                       f"in tokens, prompt and answer (default {MAX_CACHE_LEN}); a prompt may fill the largest bucket "
                       "(64, 128, 256... tokens) that leaves room for an answer")
    serve.add_argument("--compile", action="store_true", help="a model: compile the batched engine's graphs at "
                       "start on the CPU too (on Neuron and CUDA they always are: a graph per bucket, none after)")
    serve.add_argument("--plan", action="store_true", help="a model: say how it would be served (engine, graphs to "
                       "compile at start, buckets) and exit, loading nothing")
    serve.add_argument("--cores", help="a model: the core to load it on (default: the first free one); with vLLM "
                       "on a device, several (e.g. 0-3: tensor parallel over them)")
    serve.add_argument("--engine", choices=("studio", "vllm"), help="a model: who serves it: the studio's own "
                       "batched engine, or vLLM from its own environment (default: vLLM when it is set up and can "
                       "serve the runs, else the studio's; the choice and why are printed)")
    serve.add_argument("--setup-vllm", action="store_true", help="make vLLM's own environment (.venv-vllm) for this "
                       "machine's device from requirements-vllm-<device>.txt, check it and exit")
    serve.add_argument("--backend", choices=("cpu",), help="a model: serve it on the CPU even if a device is present")

    def run_flags(sub, name: str) -> None:
        """The layout's flags, each backend's flag and options, and --precompile/--jobs."""
        add_layout_flags(sub, Layout, whole_number, {"nodes": "a run on a cluster" + (
            f"; with --{EXPORT.name}-script: 2" if name == "plan" else "")})
        for backend in with_options():  # a place runs can go besides this machine: its flag and options
            group = sub.add_argument_group(backend.label, f"run on {backend.description}; --nproc is per node")
            if picked_by_option(backend):  # --ray ADDRESS: an option that picks the backend
                add_flags(group, backend.options_type)
                continue
            group.add_argument(f"--{backend.name}", action="store_true", help=(
                f"plan a run on {backend.label} (nothing is submitted)" if name == "plan" else
                f"submit the sweep's runs to {backend.label}" + (f" as one {backend.group}" if backend.group else "")
                if name == "sweep" else
                f"submit the run to {backend.label} instead of running it here"))
            add_flags(group, backend.options_type)
        sub.add_argument("--precompile", action="store_true",
                         help="compile the run's batch shapes before step 1, in parallel processes (needs "
                              "torch_compile; same as --set studio.precompile=true)" + (
                              "; a sweep's runs whose shapes are the same share one precompile" if name == "sweep"
                              else ""))
        sub.add_argument("--jobs", type=whole_number(1), metavar="N",
                         help="with --precompile: this many parallel compile processes (default: one per core, "
                              "at most 8, and on Neuron within the host's vCPUs and memory)")

    for name, func, help in (("train", cmd_train, "train a recipe, following it in the terminal"),
                             ("plan", cmd_plan, "print the launch a recipe would make; runs nothing")):
        sub = command(name, func, help)
        sub.add_argument("recipe", nargs="?" if name == "train" else None,
                         help="a recipe YAML file (see recipes/)")
        sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a recipe key, e.g. --set max_steps=50 --set studio.nproc=2")
        target = flags(Target)  # --instance, --lnc
        sub.add_argument(target["instance"], dest="instance", choices=sorted(INSTANCES),
                         help="plan for this instance type instead of the detected hardware")
        sub.add_argument("--backend", choices=("cpu",), help="plan for the CPU even if a device is present")
        sub.add_argument(target["lnc"], dest="lnc", type=int, choices=LNC_VALUES, default=Target.lnc,
                         help=f"with {target['instance']}: the LNC setting")
        run_flags(sub, name)
        if name == "plan":
            sub.add_argument("--export-script", metavar="FILE", help="also write a runnable bash launch script")
            sub.add_argument(f"--{EXPORT.name}-script", dest="submit_script", metavar="FILE", help=f"also write the "
                             f"{EXPORT.label} batch script Start would "
                             "submit, for a new run on --nodes nodes (default 2): `sbatch FILE` starts it, and "
                             "`launch.py runs` lists it")
            sub.add_argument("--no-forecast", action="store_true",
                             help="skip the shape forecast (it tokenizes the dataset as the trainer will)")
        if name == "train":
            sub.add_argument("--detach", action="store_true",
                             help="start the run and return; it goes on in the background")
            sub.add_argument("--resume", metavar="RUN_ID", help="go on with a run from its last checkpoint "
                             "(instead of a recipe), in the same run folder")
            sub.add_argument("--from-checkpoint", type=int, metavar="STEP", help="with --resume: this checkpoint")
            sub.add_argument("--no-queue", action="store_true", help="refuse the run (or the resume) when its "
                             "cores are busy (by default it waits in the queue and starts when they are free)")
    sweep = command("sweep", cmd_sweep, "train a recipe over a grid of values, a run per combination, through "
                    "the queue; --show SWEEP_ID: its runs, best first")
    sweep.add_argument("recipe", nargs="?", help="a recipe YAML file (see recipes/)")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                       help="a key and its values, e.g. --grid learning_rate=1e-4,3e-4 (repeat for more keys: every "
                            "combination is a run); values that hold commas as a YAML list, e.g. --grid "
                            "'lora_target_modules=[[q_proj, v_proj], [q_proj, k_proj, v_proj]]'")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a recipe key for every run, e.g. --set max_steps=50")
    sweep.add_argument("--yes", action="store_true", help=f"start a grid of more than {MAX_RUNS} runs")
    sweep.add_argument("--wait", action="store_true", help="follow the runs to their end (with --eval: and their "
                       "evaluations), then print the table")
    sweep.add_argument("--show", metavar="SWEEP_ID", help="the sweep's runs, best first (their evaluations, else "
                       "eval_loss, else loss)")
    sweep.add_argument("--backend", choices=("cpu",), help="run on the CPU even if a device is present")
    sweep.add_argument("--parallel", type=whole_number(1), metavar="N",
                       help="at most N of the sweep's runs at once (default: as many as the free cores allow; on "
                            + " or ".join(b.label for b in BACKENDS.values() if b.group) + ": as the cluster allows)")
    sweep.add_argument("--eval", action="store_true", help="evaluate each run when it has finished (the tuned model "
                       "against its base, as `launch.py eval RUN_ID`); the table ranks by it")
    sweep.add_argument("--eval-limit", type=whole_number(1), default=DEFAULT_EVAL_LIMIT, metavar="N",
                       help=f"with --eval: the first N rows of each run's evaluation set (default "
                            f"{DEFAULT_EVAL_LIMIT})")
    sweep.add_argument("--eval-metrics", metavar="M1,M2",
                       help="with --eval: these metrics (default: every one that applies)")
    run_flags(sweep, "sweep")
    command("runs", cmd_runs, "list runs with their state")
    queue = command("queue", cmd_queue, "list the queued runs in order, with what each waits for; move one")
    queue.add_argument("run_id", nargs="?", help="with --to: the queued run to move")
    queue.add_argument("--to", type=whole_number(1), metavar="PLACE", help="move the run to this place (1: next)")
    stop = command("stop", cmd_stop, "stop a run")
    stop.add_argument("run_id")
    stop.add_argument("--save", action="store_true", help="save a checkpoint at the next step, then stop "
                      "(resumable with train --resume)")
    chat = command("chat", cmd_chat, "chat with a run's model (or any model) in the terminal")
    chat.add_argument("target", help="a run id (its model or LoRA adapter), or a model: builtin:tiny-qwen3, "
                      "a Hub id, a local folder")
    chat.add_argument("--prompt", help="ask this once, print the answer and exit (else: an interactive chat)")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--base", action="store_true", help="also answer with the base model, for comparison")
    chat.add_argument("--image", help="an image file (PNG or JPEG) shown to a vision-language model with the first "
                      "message (with --single-turn, with every one); in a chat, /image FILE shows one with the next")
    chat.add_argument("--single-turn", action="store_true", help="answer each message alone (by default the model "
                      "sees the whole conversation; /clear starts over)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--max-new-tokens", type=whole_number(1, MAX_CACHE_LEN - SMALLEST_LENGTH), default=128,
                      help=f"the answer's length limit (the chat's cache holds {MAX_CACHE_LEN} tokens in all)")
    chat.add_argument("--cores", help="the core to chat on (default: the first free one)")
    chat.add_argument("--backend", choices=("cpu",), help="chat on the CPU even if a device is present")
    add_eval_parser(command)
    export = command("export", cmd_export, "export a finished run as a model folder with a card; push it")
    export.add_argument("run_id")
    export.add_argument("--out", required=True, help="a new (or empty) folder for the export")
    export.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base model")
    export.add_argument("--push", metavar="REPO_ID", help="then upload it to the Hub in one commit, e.g. you/my-model "
                        "(token: HF_TOKEN or your saved login)")
    export.add_argument("--private", dest="private", action="store_true", default=True,
                        help="a private repo (the default)")
    export.add_argument("--public", dest="private", action="store_false", help="a public repo")
    export.add_argument("--update", action="store_true", help="push as a new commit to a repo that exists")
    export.add_argument("--cores", help="on the CPU backend, the CPU core the export holds (default: next free)")
    cache = command("cache", cmd_cache, "show the compile cache's folder, size and entries, or clear it")
    cache.add_argument("--backend", choices=compile_cache.DEVICES,
                       help="whose cache (default: this machine's backend)")
    cache.add_argument("--clear", action="store_true", help="delete it; refused while a run is active")
    doctor = command("doctor", cmd_doctor, "check this machine for the studio, a line per check; exit 0 when "
                     "all pass (run it first on a new machine, and paste its output into a bug report)")
    doctor.add_argument("--smoke", action="store_true", help="instead, the first-run kit: a compiled SFT run, a "
                        "2-process run, a chat, an evaluation and a precompiled run of the built-in tiny model on "
                        "this machine's device; writes one report file to attach to a bug report (minutes; more on "
                        "Neuron)")
    return top
