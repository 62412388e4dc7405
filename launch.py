"""Trainium fine-tuning studio: the web app, and the same jobs headless.

    python launch.py                          start the web app on http://127.0.0.1:7860
    python launch.py train RECIPE.yaml        train, with a progress bar; Ctrl-C stops the run
    python launch.py plan RECIPE.yaml         print the exact command, environment and shape forecast; runs nothing
    python launch.py runs                     list the runs in the runs folder
    python launch.py stop RUN_ID [--save]     stop a run (--save: a checkpoint first, to resume from)
    python launch.py train --resume RUN_ID    go on from the run's last checkpoint [--from-checkpoint STEP]
    python launch.py chat RUN_OR_MODEL        chat with a run's model (--prompt TEXT: ask once)
    python launch.py export RUN_ID --out DIR  a model folder with a card [--merge] [--push REPO_ID]
    python launch.py cache [--clear]          show the compile cache (folder, size, entries); clear it

Every command takes --runs-dir (default $STUDIO_RUNS_DIR, else ~/trn-studio/runs).
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import time
from pathlib import Path

from studio_core import compile_cache, hub
from studio_core.chat import ChatError, ChatProcess
from studio_core.cores import format_cores
from studio_core.export import ExportError, export_run
from studio_core.forecast import forecast_in_subprocess
from studio_core.hardware import INSTANCES, cpu_hardware, detect_hardware, instance_hardware
from studio_core.runs.manager import RunManager
from studio_core.runs.view import FINAL_STATES, RunView, late_compile_text
from studio_core.scripts import launch_script, slurm_script
from studio_core.spec import RunSpec, SpecError

COMMANDS = ("serve", "train", "plan", "runs", "stop", "cache", "chat", "export")


def main(argv: list[str]) -> int:
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as error:
        print(f"Cannot launch: fix these and try again:\n{error}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        sub.add_argument("--runs-dir", help="where run folders go (default $STUDIO_RUNS_DIR or ~/trn-studio/runs)")
        sub.set_defaults(func=func)
        return sub

    serve = command("serve", cmd_serve, "start the web app (the default command)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=7860)
    serve.add_argument("--auth", help="user:password required to log in (needed for a non-loopback --host)")
    serve.add_argument("--auth-file", help="file with one user:password per line")

    for name, func, help in (("train", cmd_train, "train a recipe, following it in the terminal"),
                             ("plan", cmd_plan, "print the launch a recipe would make; runs nothing")):
        sub = command(name, func, help)
        sub.add_argument("recipe", nargs="?" if name == "train" else None,
                         help="a recipe YAML file (see recipes/)")
        sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a recipe key, e.g. --set max_steps=50 --set studio.nproc=2")
        sub.add_argument("--instance", choices=sorted(INSTANCES),
                         help="plan for this instance type instead of the detected hardware")
        sub.add_argument("--backend", choices=("cpu",), help="plan for the CPU even if a device is present")
        sub.add_argument("--lnc", type=int, choices=(1, 2), default=2, help="with --instance: the LNC setting")
        for option, key in (("--nproc", "nproc"), ("--tp", "tp_size"), ("--fsdp", "fsdp_size"), ("--cores", "cores")):
            sub.add_argument(option, dest=key, help=f"the layout's {key} (same as --set studio.{key}=...)")
        if name == "plan":
            sub.add_argument("--export-script", metavar="FILE", help="also write a runnable bash launch script")
            sub.add_argument("--slurm-script", metavar="FILE", help="also write a Slurm batch script for --nodes nodes")
            sub.add_argument("--nodes", type=int, default=2, help="nodes for --slurm-script (default 2)")
            sub.add_argument("--no-forecast", action="store_true",
                             help="skip the shape forecast (it tokenizes the dataset as the trainer will)")
        if name == "train":
            sub.add_argument("--detach", action="store_true",
                             help="start the run and return; it goes on in the background")
            sub.add_argument("--resume", metavar="RUN_ID", help="go on with a run from its last checkpoint "
                             "(instead of a recipe), in the same run folder")
            sub.add_argument("--from-checkpoint", type=int, metavar="STEP", help="with --resume: this checkpoint")
    command("runs", cmd_runs, "list runs with their state")
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
    chat.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--max-new-tokens", type=int, default=128)
    chat.add_argument("--cores", help="the core to chat on (default: the first free one)")
    chat.add_argument("--backend", choices=("cpu",), help="chat on the CPU even if a device is present")
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
    cache.add_argument("--backend", choices=compile_cache.BACKENDS,
                       help="whose cache (default: this machine's backend)")
    cache.add_argument("--clear", action="store_true", help="delete it; refused while a run is active")
    return top


def hardware_for(args):
    if getattr(args, "instance", None):
        try:
            return instance_hardware(args.instance, lnc=args.lnc)
        except ValueError as error:
            raise SpecError([f"--instance/--lnc: {error}"]) from error
    if getattr(args, "backend", None) == "cpu":
        return cpu_hardware()
    return detect_hardware()


def load_spec(args) -> RunSpec:
    layout = [f"studio.{key}={value}" for key in ("nproc", "tp_size", "fsdp_size", "cores")
              if (value := getattr(args, key)) is not None]
    if args.cores is not None:
        layout[-1] = f"studio.cores='{args.cores}'"  # a core set is text, even "3"
    return RunSpec.load(args.recipe).with_overrides([*args.set, *layout])  # checked once, by plan or start


def cmd_plan(args) -> int:
    spec = load_spec(args)
    hardware = hardware_for(args)
    launch = RunManager(args.runs_dir).plan(spec, hardware, this_machine=not args.instance)
    print(f"Hardware: {hardware.describe()}\n")
    print(launch.describe())
    if launch.errors:
        return 2
    if not args.no_forecast:
        try:
            print("\n" + forecast_in_subprocess(launch.spec, hardware.backend).describe())
        except SpecError as error:
            print(f"\nNo shape forecast: {error}")
    for path, text in ((args.export_script, launch_script(launch) if args.export_script else None),
                       (args.slurm_script, slurm_script(launch, args.nodes) if args.slurm_script else None)):
        if path:
            Path(path).write_text(text)
            Path(path).chmod(0o755)
            print(f"\nWrote {path}")
    return 0


def cmd_train(args) -> int:
    manager = RunManager(args.runs_dir)
    if args.resume:
        if args.recipe or args.set:
            raise SpecError(["--resume goes on with the run's own settings: give no recipe and no --set"])
        view = manager.resume(args.resume, hardware_for(args), step=args.from_checkpoint)
        print(f"Run {view.id} resumed from step {view.step}; its folder: {view.dir}")
    elif not args.recipe:
        raise SpecError(["give a recipe (e.g. recipes/tiny-sft.yaml), or --resume RUN_ID"])
    else:
        view = manager.start(load_spec(args), hardware_for(args))
        print(f"Run {view.id} started; its folder: {view.dir}")
    if args.detach:
        return 0

    def stop(signum, frame):
        print(f"\nStopping run {view.id} ...", file=sys.stderr)
        manager.stop(view.id)
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return follow(manager, view)


def follow(manager: RunManager, view: RunView) -> int:
    from tqdm import tqdm

    bar, shown, warned, fetch = None, 0, 0, None
    while True:
        view = manager.view(view.id)
        if bar is None:
            fetch = follow_download(view, fetch)
        if bar is None and view.max_steps:
            if fetch is not None:
                fetch.close()
            bar = tqdm(total=view.max_steps, unit="step", dynamic_ncols=True)
        for event in view.metrics[shown:]:
            line = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in event.items()
                             if k not in ("type", "time"))
            (bar.write if bar else print)(line)
        shown = len(view.metrics)
        finished_steps = [late for late in view.late_compiles()
                          if late["step"] <= view.step or view.live_state in FINAL_STATES]
        for late in finished_steps[warned:]:
            (bar.write if bar else print)(f"warning: {late_compile_text(late)}")
        warned = len(finished_steps)
        if bar is not None:
            bar.update(view.step - bar.n)
            bar.set_postfix_str(compiling_text(view), refresh=False)
        state = view.live_state
        if state in FINAL_STATES:
            break
        time.sleep(0.5)
    for open_bar in (fetch, bar):
        if open_bar is not None:
            open_bar.close()
    print(f"Run {view.id}: {state} (exit code {view.exit_code})")
    if state == "failed":
        for event in view.errors[-1:]:
            print(event.get("traceback") or "", file=sys.stderr)
        print(f"Error: {view.error_text}", file=sys.stderr)
        print(f"Full log: {view.dir / 'train.log'}", file=sys.stderr)
        return 1
    if state == "finished":
        print(f"Model saved in {view.dir / 'output'}")
        return 0
    return 1


def follow_download(view: RunView, fetch):
    """Before training, a byte bar for the run's download of a Hub model or dataset (its latest
    `download` event); a new bar when the next one starts. -> the bar, or None."""
    from tqdm import tqdm

    download = view.download
    if not download:
        return fetch
    what = download.get("model") or f"dataset {download.get('dataset')}"
    if fetch is None or fetch.desc != f"downloading {what}":
        if fetch is not None:
            fetch.close()
        fetch = tqdm(total=download["total_bytes"], unit="B", unit_scale=True, dynamic_ncols=True,
                     desc=f"downloading {what}")
    fetch.total = download["total_bytes"]
    fetch.update(download["done_bytes"] - fetch.n)
    return fetch


def compiling_text(view: RunView) -> str:
    """The progress bar's postfix: what compiles now, and the compile time so far."""
    now = [f"compiling {graph} {phase}" for graph, phase in view.compiling]
    total = view.compile_seconds()
    return ", ".join(now + ([f"{len(view.compiles)} compiled in {total:.1f} s"] if view.compiles else []))


def cmd_runs(args) -> int:
    runs = RunManager(args.runs_dir).list()
    print(f"{'run':48} {'state':9} {'step':>11}  model / dataset")
    for view in runs:
        steps = f"{view.step}/{view.max_steps or '?'}"
        spec = view.spec
        print(f"{view.id:48} {view.live_state:9} {steps:>11}  "
              f"{spec.get('model_name_or_path')} / {spec.get('dataset_name')}")
    return 0


def cmd_stop(args) -> int:
    manager = RunManager(args.runs_dir)
    if args.save:
        manager.stop_and_save(args.run_id)
        view = manager.wait(args.run_id)
        point = view.resume_point()
        print(f"Run {view.id}: {view.live_state}" + (f"; resume it from step {point['step']} with "
                                                     f"`launch.py train --resume {view.id}`" if point else ""))
        return 0
    view = manager.stop(args.run_id)
    print(f"Run {view.id}: {view.live_state}")
    return 0


def cmd_chat(args) -> int:
    manager = RunManager(args.runs_dir)
    try:
        chat = ChatProcess.start(args.target, manager.runs_dir, hardware_for(args), cores=args.cores)
    except ChatError as error:
        print(f"Cannot chat: {error}", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    settings = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens}
    print(f"Chatting with {args.target} on {chat.info['backend']} core {format_cores(chat.cores)}.", file=sys.stderr)
    try:
        while True:
            text = args.prompt if args.prompt is not None else read_turn()
            if text is None:
                return 0
            if text.strip() == "/clear":
                history = []
                continue
            history.append({"role": "user", "content": text})
            for which in ("tuned", "base") if args.base else ("tuned",):
                if args.base:
                    print(f"[{which}] ", end="", flush=True)
                done = {}
                for event in chat.generate(system + history, which=which, **settings):
                    if event["type"] == "token":
                        print(event["text"], end="", flush=True)
                    done = event
                print()
                if which == "tuned":
                    history.append({"role": "assistant", "content": done.get("text", "")})
            print(f"({done['new_tokens']} tokens in {done['seconds']:.2f} s; {len(done['shapes'])} distinct "
                  "input shapes so far, each a compilation on Neuron)", file=sys.stderr)
            if args.prompt is not None:
                return 0
    except ChatError as error:
        print(f"Chat failed: {error}", file=sys.stderr)
        return 1
    finally:
        chat.unload()


def read_turn() -> str | None:
    try:
        return input("you> ")
    except EOFError:
        return None


def cmd_export(args) -> int:
    manager = RunManager(args.runs_dir)
    try:
        token, source = hub.resolve_token(None) if args.push else (None, None)
        result = export_run(manager.runs_dir / args.run_id, args.out, merge=args.merge,
                            hardware=detect_hardware(), cores=args.cores)
    except (ExportError, hub.HubError) as error:
        print(f"Cannot export: {error}", file=sys.stderr)
        return 2
    print(f"Exported {result['kind']} model to {result['folder']}: {', '.join(result['files'])}")
    if not args.push:
        return 0
    try:
        url = hub.push(result["folder"], args.push, token, source, private=args.private, update=args.update)
    except hub.HubError as error:
        print(f"Push failed: {error}", file=sys.stderr)
        return 1
    print(f"Pushed ({'private' if args.private else 'public'}): {url}")
    return 0


def cmd_cache(args) -> int:
    folder = compile_cache.compile_cache_dir(args.backend or detect_hardware().backend)
    if args.clear:
        try:
            compile_cache.clear(folder, RunManager(args.runs_dir).active_runs())
        except compile_cache.CacheInUse as error:
            print(error, file=sys.stderr)
            return 2
        print(f"Cleared {folder}")
    print(compile_cache.summary(folder).describe())
    return 0


def cmd_serve(args) -> int:
    auth = read_auth(args)
    if not is_loopback(args.host) and not auth:
        print(f"Refusing to listen on {args.host}: anyone who can reach it could train and read your "
              "runs. Add --auth user:password (or --auth-file FILE), or keep the default 127.0.0.1.",
              file=sys.stderr)
        return 2
    from app.main import CSS, build_app

    demo = build_app(args.runs_dir)
    print(f"Studio on http://{args.host}:{args.port}", flush=True)
    demo.queue().launch(server_name=args.host, server_port=args.port, auth=auth, show_error=True,
                        quiet=True, css=CSS,
                        footer_links=["gradio", "settings"])
    return 0


def read_auth(args) -> list[tuple[str, str]] | None:
    lines = []
    if args.auth:
        lines.append(args.auth)
    if args.auth_file:
        lines += [line.strip() for line in Path(args.auth_file).read_text().splitlines() if line.strip()]
    pairs = [tuple(line.split(":", 1)) for line in lines]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit("--auth / --auth-file: write each login as user:password")
    return pairs or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
