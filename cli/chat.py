"""chat: talk to a run's model (or any model) in the terminal, or ask it once with --prompt.

The answer streams to stdout without <think> tags or runs of blank lines; a reasoning block
goes to stderr, labelled; an empty answer prints a placeholder saying what it means."""

from __future__ import annotations

import sys
from pathlib import Path

from cli.options import CommandLineError, check_one_core, hardware_for, runs_folder
from studio_core.serve.chat import EMPTY_ANSWER, UNTRAINED, ChatError, ChatProcess, resolve, shown, split_reasoning
from studio_core.serve.images import ImageError, image_part, user_content
from studio_core.machine.cores import format_cores
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
        image = first_image(args, manager.runs_dir)
        chat = ChatProcess.start(args.target, manager.runs_dir, hardware, cores=args.cores)
    except (ChatError, ImageError) as error:
        print(f"Cannot chat: {error}", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    settings = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens}
    print(f"Chatting with {args.target} on {chat.info['backend']} core {format_cores(chat.cores)}.", file=sys.stderr)
    if args.prompt is None:
        print("The model sees the whole conversation; /clear starts over." if not args.single_turn else
              "Single-turn: each message is answered alone.", file=sys.stderr)
    for which in chat.target.untrained:
        if which == "tuned" or args.base:
            print(f"The {'base ' if which == 'base' else ''}model is {UNTRAINED}.", file=sys.stderr)
    try:
        while True:
            text = args.prompt if args.prompt is not None else read_turn()
            if text is None:
                return 0
            if text.strip() == "/clear":
                history = []
                continue
            if text.strip().startswith("/image"):
                image = next_image(text.strip().removeprefix("/image").strip(), chat) or image
                continue
            if args.single_turn:
                history = []
            history.append({"role": "user", "content": user_content(text, image)})
            if not args.single_turn:
                image = None  # shown once: the conversation keeps it
            for which in ("tuned", "base") if args.base else ("tuned",):
                if args.base:
                    print(f"[{which}] ", end="", flush=True)
                done, answer = print_answer(chat.generate(system + history, which=which, **settings), chat.thinking)
                if which == "tuned":
                    history.append({"role": "assistant", "content": answer})
            print(f"({done['new_tokens']} tokens in {done['seconds']:.2f} s; {len(done['shapes'])} distinct "
                  "input shapes so far, each a compilation on Neuron)", file=sys.stderr)
            if args.prompt is not None:
                return 0
    except ChatError as error:
        print(f"Chat failed: {error}", file=sys.stderr)
        return 1
    finally:
        chat.unload()


def first_image(args, runs_dir) -> dict | None:
    """--image's part for the chat process, checked before the model loads (ImageError or ChatError
    saying what to change); None without one."""
    if args.image is None:
        return None
    target = resolve(args.target, runs_dir)
    if not target.vision:
        raise ChatError(f"--image: {target.label} is a text model and takes no images; leave --image out, or chat "
                        "with a vision-language model's run")
    return image_part(Path(args.image).expanduser(), f"--image {args.image}")


def next_image(path: str, chat: ChatProcess) -> dict | None:
    """`/image FILE`: the image shown with the next message; None, said why, if it cannot be."""
    if not chat.target.vision:
        print(f"{chat.target.label} is a text model: it takes no images.", file=sys.stderr)
        return None
    if not path:
        print("Give the image's file: /image photo.png", file=sys.stderr)
        return None
    try:
        part = image_part(Path(path).expanduser(), path)
    except ImageError as error:
        print(f"Not shown: {error}", file=sys.stderr)
        return None
    print(f"{path} goes with your next message.", file=sys.stderr)
    return part


def print_answer(events, thinking: bool) -> tuple[dict, str]:
    """Stream an answer's text as it grows, then its reasoning; (the done event, the answer)."""
    text, printed, done = "", "", {}
    for event in events:
        if event["type"] != "token":
            done = event
            continue
        text += event["text"]
        answer = shown(split_reasoning(text, thinking)[1])
        if answer.startswith(printed):  # it only grows (whitespace is held back until text follows)
            print(answer[len(printed):], end="", flush=True)
            printed = answer
    reasoning, answer = (shown(part) for part in split_reasoning(text, thinking))
    print("" if answer else EMPTY_ANSWER)
    if reasoning:
        print(f"(reasoning, not part of the answer: {reasoning})", file=sys.stderr)
    return done, answer


def read_turn() -> str | None:
    try:
        return input("you> ")
    except EOFError:
        return None
