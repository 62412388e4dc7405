"""The Chat tab: load a finished run's model (or any model) into a chat process, talk to it
with streaming, compare it with its base side by side, stop, clear, unload.

The model lives in the chat process (studio_core.serve.chat), never in this one; the app holds
one chat at a time, shared by its pages, and Unload ends the process and frees its core.
Each page keeps what the model wrote (a State) apart from what its chatbots show: a reasoning
block as a collapsed "Reasoning" part, the answer without tags or runs of blank lines, a
placeholder for an empty answer; the next prompt carries only the earlier answers. The page
says that the model sees the whole conversation (a second, unrelated question is answered in
the light of the first) and offers Single-turn, where each message is asked alone.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import gradio as gr

from studio_core.data.sources import BUILTIN_MODELS
from studio_core.serve.chat import (BATCH_BUCKETS, EMPTY_ANSWER, MAX_CACHE_LEN, UNTRAINED, ChatError, ChatProcess,
                                    shown, split_reasoning)
from studio_core.machine.cores import format_cores
from studio_core.machine.hardware import Hardware
from studio_core.serve.images import ImageError, image_part, is_image, user_content
from studio_core.serve.openai_api import ApiServer
from studio_core.serve.vllm_server import VllmServer, decide
from studio_core.runs.history import runs_with_a_model
from studio_core.runs.manager import RunManager


class ChatHolder:
    """The app's one chat process (loading another unloads it first)."""

    def __init__(self):
        self.chat: ChatProcess | None = None
        self.server: ApiServer | None = None  # the loaded model behind OpenAI's API, when served
        self.served: ChatProcess | None = None  # a batched process of its own, when other runs are served with it
        self.vllm: VllmServer | None = None  # vLLM's server, when it serves them
        self.lock = threading.Lock()

    def load(self, name: str, manager: RunManager, hardware: Hardware) -> str:
        with self.lock:
            self._unload()
            self.chat = ChatProcess.start(name, manager.runs_dir, hardware)
            info = self.chat.info
            side = "; side by side with its base available" if info["has_base"] else ""
            untrained = "".join(f" The {'base ' if which == 'base' else ''}model is {UNTRAINED}."
                                for which in self.chat.target.untrained)
            vision = " A vision-language model: give it an image with a message." if self.chat.target.vision else ""
            return (f"Loaded `{name}` on {info['backend']} core {format_cores(self.chat.cores)} (static cache "
                    f"of {info['max_cache_len']} tokens){side}.{untrained}{vision}")

    def unload(self) -> str:
        with self.lock:
            if self.chat is None:
                return "Nothing loaded."
            cores = format_cores(self.chat.cores)
            self._unload()
            return f"Unloaded: the chat process has ended and core {cores} is free."

    def _unload(self) -> None:
        self._stop_serving()
        if self.chat is not None:
            self.chat.unload()
            self.chat = None

    def serve(self, on: bool, port: int, also: list[str] | None = None, manager: RunManager | None = None,
              hardware: Hardware | None = None, engine: str = "auto") -> tuple[str, str]:
        """Serve the loaded model at http://127.0.0.1:PORT/v1 (on), or stop; (status, client snippet).
        With `also` (other LoRA runs of its base), the runs are served together by a batched chat
        process of their own, on another core (this tab's chat keeps its own). `engine`: auto,
        studio or vllm (serve/vllm_server.py's `decide`); vLLM loads its own copy on a core of its own."""
        with self.lock:
            self._stop_serving()
            if not on:
                return "Not served.", ""
            if self.chat is None or not self.chat.alive:
                return "**Load a run or a model first**, then serve it.", ""
            label, also = self.chat.target.label, [name for name in also or [] if name != self.chat.target.label]
            names = [label, *also]
            try:
                chosen, why, env = decide(None if engine == "auto" else engine, names, manager.runs_dir,
                                          hardware.backend, BATCH_BUCKETS[-1])
                if chosen == "vllm":
                    self.vllm = VllmServer.start(names, manager.runs_dir, hardware, env, "127.0.0.1", int(port), None,
                                                 MAX_CACHE_LEN, BATCH_BUCKETS[-1])
            except ChatError as error:
                self._stop_serving()
                return f"**Not served:** {error}", ""
            if self.vllm is not None:
                listed = ", ".join(f"`{name}`" for name in names)
                return (f"Serving {listed} at **{self.vllm.url}** (OpenAI's API, this machine only) through "
                        f"**vLLM** {env.version}: {why}. Its log: `{self.vllm.log}`."), \
                    client_snippet(self.vllm.url, label)
            try:  # this machine only, and no key: another host goes through `launch.py serve --api-key-file`
                if also:
                    self.served = ChatProcess.start(label, manager.runs_dir, hardware, max_batch=BATCH_BUCKETS[-1],
                                                    also=tuple(also))
                self.server = ApiServer(self.served or self.chat, label, "127.0.0.1", int(port)).start()
            except (ChatError, OSError) as error:
                self._stop_serving()
                return f"**Not served:** {error}", ""
            how = (f"{len(names)} runs on one base, each its own model name, decoded together on core "
                   f"{format_cores(self.served.cores)}: {self.served.info['engine']['says']}") if also else (
                "requests take turns with this tab's chat")
            return (f"Serving {', '.join(f'`{name}`' for name in names)} at **{self.server.url}** (OpenAI's API, this "
                    f"machine only; the studio's engine, {why}; {how}). To serve to other hosts, with a key: "
                    f"`launch.py serve {' '.join(names)} --host 0.0.0.0 --api-key-file FILE`."), \
                client_snippet(self.server.url, label)

    def _stop_serving(self) -> None:
        if self.vllm is not None:
            self.vllm.stop()
            self.vllm = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.served is not None:
            self.served.unload()
            self.served = None


def client_snippet(url: str, model: str) -> str:
    return (f'from openai import OpenAI\n\nclient = OpenAI(base_url="{url}", api_key="none")\n'
            f'reply = client.chat.completions.create(\n    model="{model}",\n'
            '    messages=[{"role": "user", "content": "Hello!"}],\n    max_tokens=64, temperature=0)\n'
            'print(reply.choices[0].message.content)\n')


def chat_targets(manager: RunManager) -> list[str]:
    """Finished runs with a saved model that answers prompts, newest first, then the built-in models."""
    return [*runs_with_a_model(manager, chats=True), *BUILTIN_MODELS]


def saved_info(manager: RunManager, name: str | None) -> dict:
    """What the run `name` saved (its output info), or {} for a model, a run that saved nothing, or none."""
    view = manager.view_or_none(name) if name else None
    return (view.output_info() or {}) if view is not None else {}


def lora_runs_beside(manager: RunManager, loaded: str | None) -> list[str]:
    """The Serve box's other runs: the LoRA runs of the loaded run's base, newest first, the loaded
    run left out; none unless a LoRA run is loaded (a full run or a model is served alone)."""
    mine = saved_info(manager, loaded)
    if mine.get("kind") != "adapter":
        return []
    return [run_id for run_id in runs_with_a_model(manager, chats=True) if run_id != loaded
            and (info := saved_info(manager, run_id)).get("kind") == "adapter"
            and info.get("base_model") == mine.get("base_model")]


def for_model(conversation: list[dict], thinking: bool) -> list[dict]:
    """The conversation as the next prompt carries it: each earlier answer without its reasoning."""
    return [{"role": m["role"], "content": shown(split_reasoning(m["content"], thinking)[1])}
            if m["role"] == "assistant" else m for m in conversation]


HISTORY_NOTE = "The model sees the whole conversation; **Clear** to start over."
SINGLE_TURN_NOTE = "Single-turn: the model sees only your latest message (and the system prompt)."


def asked(conversation: list[dict], text: str, system_prompt: str, thinking: bool, single_turn: bool,
          image: dict | None = None) -> list[dict]:
    """The messages sent for a new message `text`: the system prompt, the earlier turns (none when
    `single_turn`), then the message (with `image`, an image part: the image first, as TRL's
    vision data puts it)."""
    system_turn = [{"role": "system", "content": system_prompt}] if system_prompt else []
    earlier = [] if single_turn else for_model(conversation, thinking)
    return [*system_turn, *earlier, {"role": "user", "content": user_content(text, image)}]


def user_bubble(message: dict) -> dict:
    """A user message as a chatbot shows it: its image (the file it came from) above its text."""
    content = message["content"]
    if not isinstance(content, list):
        return message
    shown_parts = [{"path": part["shown"]} if is_image(part) else part.get("text", "") for part in content]
    return {"role": "user", "content": shown_parts}


def for_chatbot(conversation: list[dict], thinking: bool, answering: bool = False) -> list[dict]:
    """The conversation as a chatbot shows it: a reasoning block as a collapsed "Reasoning" part
    (open while the model is still in it), the answer without tags or runs of blank lines, and
    a placeholder for an empty answer (not while `answering` the last one)."""
    bubbles = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            bubbles.append(user_bubble(message))
            continue
        reasoning, answer = (shown(part) for part in split_reasoning(message["content"], thinking))
        last = answering and i == len(conversation) - 1
        if reasoning:
            status = "pending" if last and not answer else "done"
            bubbles.append({"role": "assistant", "content": reasoning,
                            "metadata": {"title": "Reasoning", "status": status}})
        bubbles.append({"role": "assistant", "content": answer or ("" if last else EMPTY_ANSWER)})
    return bubbles


def shapes_text(done: dict) -> str:
    return (f"{done['new_tokens']} tokens in {done['seconds']:.2f} s (first after {done['ttft_s']:.2f} s); "
            f"prompt {done['prompt_tokens']} tokens padded to {done['bucket']}"
            + (f", {done['dropped_turns']} oldest turn(s) left out to fit the cache" if done["dropped_turns"] else "")
            + f". **{len(done['shapes'])} distinct input shapes** so far in this chat (on Neuron, each one is a "
            "compilation): " + ", ".join("x".join(map(str, s)) for s in done["shapes"]))


def build(manager: RunManager, hardware: Hardware, page: gr.Blocks) -> tuple[gr.Dropdown, Callable]:
    """The Chat tab, in the current Blocks context; its run-or-model pick and that pick's choices
    now, for another tab to hand it a run (the Sweeps section's "Chat with it")."""
    holder = ChatHolder()
    with gr.Row():
        target = gr.Dropdown([], value=None, allow_custom_value=True, scale=4,
                             label="Run or model", info="a finished run (its model or LoRA adapter), or a model: "
                             "builtin:tiny-qwen3, a Hub id, a local folder", elem_id="chat-target")
        load = gr.Button("Load", variant="primary", scale=1, elem_id="chat-load")
        unload = gr.Button("Unload", scale=1, elem_id="chat-unload")
    status = gr.Markdown("Nothing loaded.", elem_id="chat-status")
    with gr.Accordion("Generation settings", open=False):
        system = gr.Textbox(label="System prompt", lines=2, elem_id="chat-system")
        with gr.Row():
            temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature (0: greedy)")
            top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top_p")
            max_new_tokens = gr.Slider(1, 512, value=128, step=1, label="max_new_tokens")
    compare = gr.Checkbox(False, label="Side by side: the same prompt to the base model", elem_id="chat-compare")
    with gr.Row():
        tuned = gr.Chatbot(label="Tuned", height=380, elem_id="chat-tuned")
        base = gr.Chatbot(label="Base", height=380, visible=False, elem_id="chat-base")
    conversations = gr.State({"tuned": [], "base": []})  # what the model was asked and wrote, as written
    with gr.Row():
        message = gr.Textbox(label="Message", placeholder="Ask something, then Enter", elem_id="chat-input", scale=4)
        image = gr.Image(type="filepath", sources=["upload", "clipboard"], label="Image, sent with the message",
                         visible=False, height=140, scale=1, elem_id="chat-image")
    with gr.Row():
        history_note = gr.Markdown(HISTORY_NOTE, elem_id="chat-history-note")
        single_turn = gr.Checkbox(False, label="Single-turn: answer each message alone", elem_id="chat-single-turn")
    with gr.Row():
        send = gr.Button("Send", variant="primary", elem_id="chat-send")
        stop = gr.Button("Stop", variant="stop", elem_id="chat-stop")
        clear = gr.Button("Clear", elem_id="chat-clear")
    shapes = gr.Markdown("", elem_id="chat-shapes")
    with gr.Accordion("Serve: the loaded model behind OpenAI's API", open=False, elem_id="serve-box"):
        with gr.Row():
            serving = gr.Checkbox(False, label="Serve at http://127.0.0.1:PORT/v1 (this machine only)",
                                  elem_id="serve-on")
            port = gr.Number(8000, label="Port", precision=0, minimum=1, maximum=65535, elem_id="serve-port")
        engine = gr.Radio([("Auto: vLLM when it is set up and can serve the runs, else the studio's", "auto"),
                           ("The studio's engine", "studio"), ("vLLM", "vllm")], value="auto", label="Engine",
                          elem_id="serve-engine")
        also = gr.Dropdown([], value=[], multiselect=True, elem_id="serve-also",
                           label="With other LoRA runs of its base (optional): each its own model name, served "
                                 "together in batches by a process of their own")
        served = gr.Markdown("Not served.", elem_id="serve-status")
        snippet = gr.Code("", language="python", label="A client (pip install openai)", elem_id="serve-snippet")

    def on_load(name):
        try:
            loaded = holder.load(name or "", manager, hardware)
        except ChatError as error:
            return f"**Not loaded:** {error}", gr.update(label="Base"), gr.update(visible=False, value=None)
        untrained = "base" in holder.chat.target.untrained
        return (loaded, gr.update(label="Base (untrained: random weights)" if untrained else "Base"),
                gr.update(visible=holder.chat.target.vision, value=None))

    def on_send(text, picture, kept, side_by_side, system_prompt, temp, p, max_new, alone):
        chat = holder.chat
        if chat is None or not chat.alive:
            yield gr.skip(), gr.skip(), kept, text, gr.skip(), "**Load a run or a model first.**"
            return
        if not (text or "").strip():
            yield gr.skip(), gr.skip(), kept, "", gr.skip(), ""
            return
        shown_image = None
        if picture and chat.target.vision:
            try:
                shown_image = {**image_part(Path(picture), "The image"), "shown": picture}
            except ImageError as error:
                yield gr.skip(), gr.skip(), kept, text, gr.skip(), f"**Not sent:** {error}"
                return
        kept = {which: list(conversation) for which, conversation in kept.items()}
        note = ""

        def shown_now(answering: str | None = None):
            return [for_chatbot(kept[which], chat.thinking, answering == which) for which in ("tuned", "base")]

        for which in ("tuned", "base") if side_by_side else ("tuned",):
            conversation = kept[which]
            messages = asked(conversation, text, system_prompt, chat.thinking, alone, shown_image)
            conversation += [{"role": "user", "content": user_content(text, shown_image)},
                             {"role": "assistant", "content": ""}]
            try:
                for event in chat.generate(messages, which=which, temperature=temp, top_p=p,
                                           max_new_tokens=int(max_new)):
                    if event["type"] == "token":
                        conversation[-1]["content"] += event["text"]
                    else:
                        note = shapes_text(event) + (" Stopped." if event["stopped"] else "")
                    yield *shown_now(which if event["type"] == "token" else None), kept, "", None, note
            except ChatError as error:
                yield *shown_now(), kept, "", None, f"**Chat failed:** {error}"
                return

    def on_stop():
        if holder.chat is not None:
            holder.chat.stop_generation()

    inputs = [message, image, conversations, compare, system, temperature, top_p, max_new_tokens, single_turn]
    outputs = [tuned, base, conversations, message, image, shapes]
    load.click(on_load, target, [status, base, image]).then(lambda: (False, "Not served.", ""), None,
                                                      [serving, served, snippet])
    unload.click(holder.unload, None, status).then(lambda: (False, "Not served.", ""), None,
                                                   [serving, served, snippet])
    serving.input(lambda on, port, others, which: holder.serve(on, port, others, manager, hardware, which),
                  [serving, port, also, engine], [served, snippet])
    also.focus(lambda: gr.update(choices=lora_runs_beside(manager, holder.chat.target.label if holder.chat else None)),
               None, also)
    send.click(on_send, inputs, outputs)
    message.submit(on_send, inputs, outputs)
    stop.click(on_stop, None, None)
    clear.click(lambda: ([], [], {"tuned": [], "base": []}, ""), None, [tuned, base, conversations, shapes])
    compare.change(lambda on: gr.update(visible=on), compare, base)
    single_turn.change(lambda on: SINGLE_TURN_NOTE if on else HISTORY_NOTE, single_turn, history_note)
    target.focus(lambda: gr.update(choices=chat_targets(manager)), None, target)
    page.load(lambda: gr.update(choices=chat_targets(manager)), None, target)  # after a login, not before
    return target, lambda: chat_targets(manager)
