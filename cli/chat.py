"""chat: talk to a run's model (or any model) in the terminal, or ask it once with --prompt."""

from __future__ import annotations

import sys

from cli.options import CommandLineError, check_one_core, hardware_for, runs_folder
from studio_core.chat import ChatError, ChatProcess
from studio_core.cores import format_cores
from studio_core.runs.manager import RunManager


def cmd_chat(args) -> int:
    if not args.temperature >= 0:  # NaN too
        raise CommandLineError(f"--temperature {args.temperature}: use 0 (greedy, the default) or more")
    if not 0 < args.top_p <= 1:
        raise CommandLineError(f"--top-p {args.top_p}: use a number above 0, at most 1 (the default)")
    manager = RunManager(runs_folder(args, write=True))  # the chat holds a core there
    hardware = hardware_for(args)
    check_one_core(args.cores, hardware)
    try:
        chat = ChatProcess.start(args.target, manager.runs_dir, hardware, cores=args.cores)
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
