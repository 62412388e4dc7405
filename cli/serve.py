"""serve: the web app, local-only unless a login is given; or, given a run or model, an
OpenAI-compatible endpoint for it (studio_core/serve/openai_api.py), local-only unless an API key is."""

from __future__ import annotations

import ipaddress
import os
import shlex
import signal
import stat
import sys
import threading
from pathlib import Path

from cli.options import CommandLineError, runs_folder
from studio_core.machine.children import collection_off, set_up
from studio_core.machine.cores import parse_cores

GRACEFUL_SHUTDOWN_S = 1  # Ctrl-C: how long the web app waits for open pages' connections to end


def cmd_serve(args) -> int:
    if args.setup_vllm:
        return setup_vllm(args)
    if args.target:
        return serve_model(args)
    given = [flag for flag, value in (("--api-key-file", args.api_key_file), ("--cores", args.cores),
                                      ("--backend", args.backend), ("--max-cache-len", args.max_cache_len),
                                      ("--compile", args.compile), ("--plan", args.plan), ("--engine", args.engine))
             if value]
    if given:
        raise CommandLineError(f"{', '.join(given)}: these go with a model to serve (launch.py serve RUN_OR_MODEL)")
    args.port = args.port or 7860
    auth = read_auth(args)
    if not is_loopback(args.host) and not auth:
        print(f"Refusing to listen on {args.host}: anyone who can reach it could train and read your "
              "runs. Add --auth user:password (or --auth-file FILE), or keep the default 127.0.0.1.",
              file=sys.stderr)
        return 2
    runs_dir = runs_folder(args, write=True)  # before the app starts: it makes runs there
    collection_off()  # while Gradio is imported and the page is built (studio_core/machine/children.py)
    try:
        from app.main import build_app, launch_settings, queued

        demo = build_app(runs_dir)
    finally:
        set_up()
    # launch() returns once the port answers; the line says so only then, for whoever reads it to connect
    queued(demo).launch(server_name=args.host, server_port=args.port, auth=auth, show_error=True, quiet=True,
                        footer_links=["gradio", "settings"], prevent_thread_lock=True, **launch_settings(runs_dir))
    print(f"Studio on http://{args.host}:{args.port}", flush=True)
    wait_for_ctrl_c(demo)
    return 0


def wait_for_ctrl_c(demo) -> None:
    """Gradio's block_thread, closing sooner. On Ctrl-C Gradio asks uvicorn to stop and waits 5 s
    for it, while uvicorn waits, with no limit, for an open page's event streams to end; a page
    never ends them, so the app used to exit after those 5 s with its server still running. Now
    uvicorn cancels them after GRACEFUL_SHUTDOWN_S (its own setting, read when it shuts down) and
    its server ends within about 2 s; their cancellation is expected, not logged as an error."""
    import logging
    import signal
    import time

    # Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it started, and a
    # non-interactive shell starts a background job (`launch.py &` in a script) with it ignored:
    # such an app never heard Ctrl-C or `kill -INT`. It hears it now wherever it was started from.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    demo.server.config.timeout_graceful_shutdown = GRACEFUL_SHUTDOWN_S
    try:
        while demo.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("Ctrl-C: closing the studio (runs go on; see launch.py runs)", flush=True)
        logging.getLogger("uvicorn.error").disabled = True
        demo.server.close()
        if demo.server.thread.is_alive():
            print("The web server did not stop within 5 s; exiting anyway.", flush=True)
        else:
            print("Studio closed.", flush=True)


def read_auth(args) -> list[tuple[str, str]] | None:
    lines = []
    if args.auth:
        lines.append(args.auth)
    if args.auth_file:
        try:
            text = Path(args.auth_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            why = getattr(error, "strerror", None) or "not UTF-8 text"
            raise CommandLineError(f"--auth-file {args.auth_file}: cannot read it ({why}): give a text file "
                                   "with one user:password per line") from None
        found = [line.strip() for line in text.splitlines() if line.strip()]
        if not found:
            raise CommandLineError(f"--auth-file {args.auth_file} holds no login: write one user:password per line")
        lines += found
    pairs = [tuple(line.split(":", 1)) for line in lines]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise CommandLineError("--auth / --auth-file: write each login as user:password")
    return pairs or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_model(args) -> int:
    """An OpenAI-compatible endpoint for a run's model, in a chat process on a core of its own,
    until Ctrl-C."""
    from cli.options import check_one_core, hardware_for
    from studio_core.serve.chat import MAX_CACHE_LEN, ChatError, ChatProcess
    from studio_core.serve.openai_api import ApiServer
    from studio_core.serve.vllm_server import decide

    if args.auth or args.auth_file:
        raise CommandLineError("--auth / --auth-file are the web app's logins; a model's endpoint takes "
                               "--api-key-file")
    key = read_api_key(args.api_key_file) if args.api_key_file else None
    if not is_loopback(args.host) and key is None:
        print(f"Refusing to serve on {args.host} without a key: anyone who can reach it could use the model. Add "
              "--api-key-file FILE (a file holding the key), or keep the default 127.0.0.1.", file=sys.stderr)
        return 2
    runs_dir = runs_folder(args, write=not args.plan)  # the chat process holds a core there
    hardware = hardware_for(args)
    max_cache_len = args.max_cache_len or MAX_CACHE_LEN
    try:
        engine, why, env = decide(args.engine, args.target, runs_dir, hardware.backend, args.max_batch)
    except ChatError as error:
        print(f"Cannot serve: {error}", file=sys.stderr)
        return 2
    print(f"Engine chosen: {'vLLM' if engine == 'vllm' else 'the studio engine'}: {why}", file=sys.stderr, flush=True)
    if engine == "vllm":
        return serve_with_vllm(args, runs_dir, hardware, env, key, max_cache_len)
    check_one_core(args.cores, hardware)
    if args.plan:
        return print_plan(args, runs_dir, hardware, max_cache_len)
    try:
        chat = ChatProcess.start(args.target[0], runs_dir, hardware, cores=args.cores, max_cache_len=max_cache_len,
                                 max_batch=args.max_batch, also=tuple(args.target[1:]), compiled=args.compile,
                                 on_warmup=say_warmup)
    except ChatError as error:
        print(f"Cannot serve: {error}", file=sys.stderr)
        return 2
    try:
        server = ApiServer(chat, args.target[0], args.host, args.port or 8000, key, args.max_queue,
                           setting="launch.py serve --max-cache-len").start()
    except OSError as error:
        chat.unload()
        print(f"Cannot serve: {error}", file=sys.stderr)
        return 2
    engine = chat.info["engine"]
    batching = (f"up to {chat.max_batch} requests decoded together, a static KV cache of {chat.max_batch} rows x "
                f"{chat.info['max_cache_len']} tokens: {chat.info['cache_mib']:.0f} MiB" if chat.max_batch > 1
                else "one request at a time")
    needs_key = "required" if key else "not required"
    print(f"Serving {', '.join(args.target)} at {server.url} (OpenAI's API; key {needs_key}; {batching}); Ctrl-C "
          "ends it", flush=True)
    warmed = f"; compiled in {engine['warmup_s']:.1f} s" if "warmup_s" in engine else ""
    print(f"Engine: {engine['says']}{warmed}", file=sys.stderr, flush=True)
    # SIGTERM only sets a flag: the ending below (requests cut, server, chat process) runs once, whole
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        while not terminated.wait(0.5) and server.thread.is_alive() and chat.alive:
            continue
        if not chat.alive:
            print("The chat process ended; the endpoint stops.", file=sys.stderr)
            return 1
        if terminated.is_set():
            print("Stopped (SIGTERM): the requests in progress got an error, the endpoint ends and the model's "
                  "core is freed.", file=sys.stderr)
    except KeyboardInterrupt:
        print("Stopped (Ctrl-C): the requests in progress got an error, the endpoint ends and the model's core is "
              "freed.", file=sys.stderr)
    finally:
        server.stop()  # every request ends first (the one answering after its current token): nothing to wait for
        chat.unload(timeout=10)
    return 0


def say_warmup(event: dict) -> None:
    """A line per graph compiled at start (on Neuron each takes minutes)."""
    print(f"Compiling the server's graphs before the first request: {event['done']} of {event['total']}",
          file=sys.stderr, flush=True)


def print_plan(args, runs_dir, hardware, max_cache_len: int) -> int:
    """How the runs would be served (serve/batching.py's plan), from their folders: nothing loaded."""
    from studio_core.serve.chat import ChatError, serve_plan

    try:
        plan = serve_plan(args.target[0], runs_dir, hardware.backend, max_cache_len, args.max_batch,
                          tuple(args.target[1:]), args.compile)
    except ChatError as error:
        print(f"Cannot serve: {error}", file=sys.stderr)
        return 2
    print(f"Serving {', '.join(args.target)} on {hardware.backend} with a {max_cache_len}-token cache per request: "
          f"{plan.describe()}")
    return 0


def read_api_key(path: str) -> str:
    """The key in the file's first line (never printed)."""
    try:
        lines = Path(path).read_text().split("\n")
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or "not UTF-8 text"
        raise CommandLineError(f"--api-key-file {path}: cannot read it ({why}): give a text file whose first line "
                               "is the key") from None
    key = lines[0].strip()
    if len(key) < 8:
        raise CommandLineError(f"--api-key-file {path}: its first line must hold a key of at least 8 characters")
    mode = stat.S_IMODE(Path(path).stat().st_mode)
    if mode & 0o077:  # as ssh warns of a private key others can read
        print(f"Warning: --api-key-file {path} is open to other users of this machine (mode {mode:04o}): they can "
              f"read the key (or change it). Run chmod 600 {path}", file=sys.stderr)
    return key


def serve_with_vllm(args, runs_dir, hardware, env, key: str | None, max_cache_len: int) -> int:
    """The runs behind vLLM's own OpenAI server (serve/vllm_server.py), until Ctrl-C or SIGTERM."""
    from studio_core.serve.chat import ChatError
    from studio_core.serve.vllm_server import START_TIMEOUT_S, VllmServer, arguments, plan

    port = args.port or 8000
    if args.plan:
        try:
            serving = plan(args.target, runs_dir, args.max_batch)
        except ChatError as error:
            print(f"Cannot serve: {error}", file=sys.stderr)
            return 2
        cores = len(parse_cores(args.cores)) if args.cores else 1
        argv = arguments(serving, hardware.backend, args.host, port, max_cache_len, args.max_batch, cores, args.compile)
        print(f"Serving {', '.join(serving.names)} with {env.describe()}: {env.python} -m "
              f"vllm.entrypoints.openai.api_server {shlex.join(argv)}")
        return 0
    said = [0.0]

    def waiting(waited: float) -> None:
        if waited - said[0] >= 30:
            said[0] = waited
            print(f"Waiting for vLLM to start: {waited:.0f} s (at most {START_TIMEOUT_S} s)", file=sys.stderr,
                  flush=True)

    try:
        server = VllmServer.start(args.target, runs_dir, hardware, env, args.host, port, key, max_cache_len,
                                  args.max_batch, cores=args.cores, compiled=args.compile, on_wait=waiting)
    except ChatError as error:
        print(f"Cannot serve: {error}", file=sys.stderr)
        return 2
    needs_key = "required" if key else "not required"
    print(f"Serving {', '.join(server.plan.names)} at {server.url} (OpenAI's API through vLLM {env.version}; key "
          f"{needs_key}; up to {args.max_batch} requests together; its log: {server.log}); Ctrl-C ends it", flush=True)
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        while not terminated.wait(0.5) and server.alive:
            continue
        if not server.alive:
            print(f"vLLM ended (exit code {server.proc.returncode}): {server.failure()} (its whole log: {server.log})",
                  file=sys.stderr)
            return 1
        print("Stopped (SIGTERM): vLLM and its workers end, the cores are freed.", file=sys.stderr)
    except KeyboardInterrupt:
        print("Stopped (Ctrl-C): vLLM and its workers end, the cores are freed.", file=sys.stderr)
    finally:
        left = server.stop()
        if left:
            print(f"Warning: vLLM processes {left} outlived SIGKILL", file=sys.stderr)
    return 0


def setup_vllm(args) -> int:
    """Make .venv-vllm for this machine's device, then check it."""
    from cli.options import hardware_for
    from studio_core.serve import vllm_env

    if args.target:
        raise CommandLineError("--setup-vllm takes no run: run it alone, then serve")
    backend = hardware_for(args).backend
    print(f"Making vLLM's environment for {backend} in {vllm_env.VENV} from {vllm_env.REQUIREMENTS[backend]} "
          "(a few minutes; several GB)", flush=True)
    try:
        env = vllm_env.setup(backend)
    except RuntimeError as error:
        print(f"vLLM setup failed: {error}", file=sys.stderr)
        return 1
    print(env.describe(), file=sys.stdout if env.usable else sys.stderr)
    if not env.usable:
        return 1
    if os.environ.get(vllm_env.PYTHON_VARIABLE):
        print(f"Note: {vllm_env.PYTHON_VARIABLE} is set and names another vLLM; unset it to serve with this one",
              file=sys.stderr)
    return 0
