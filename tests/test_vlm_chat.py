"""Issue 49: chatting with and serving a vision-language run. The session's tiny VLM run
(conftest.vlm_runs: 120 steps on builtin:shapes) answers held-out images through `launch.py chat
--image`, and through the chat process behind the OpenAI endpoint (the real openai client, each
image a base64 data URL), as plain Transformers answers them from the run's saved folder. A bad
image, an image for a text model and a web address get messages that say what to change, before
any model loads; evaluation says it takes no images yet.
"""

from __future__ import annotations

import base64
import json
import re
import socket
from pathlib import Path

import pytest

from conftest import launch_py
from studio_core.data.builtin_images import ensure_shapes_dataset

NEW_TOKENS = 6


def held_out(count: int) -> list[tuple[str, object]]:
    """(the question, the image file) of the shapes set's first held-out rows."""
    folder = ensure_shapes_dataset()
    rows = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()[:count]]
    return [(next(p["text"] for p in row["messages"][0]["content"] if p["type"] == "text"),
             folder / row["images"][0]) for row in rows]


def plain_answers(output, asked, new_tokens: int = NEW_TOKENS) -> list[str]:
    """What plain Transformers answers, greedily, from a saved folder: AutoModelForImageTextToText
    and AutoProcessor, the prompt rendered by the processor's chat template, unpadded."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = AutoModelForImageTextToText.from_pretrained(output), AutoProcessor.from_pretrained(output)
    answers = []
    for question, image in asked:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=prompt, images=[Image.open(image)], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        answers.append(processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return answers


@pytest.fixture(scope="module")
def vlm_run(vlm_runs, tmp_path_factory):
    """The full VLM run, copied here: (its runs folder, its id, plain Transformers' answers to the
    first 3 held-out rows)."""
    runs = tmp_path_factory.mktemp("vlm-chat") / "runs"
    manager = vlm_runs.copy_to(runs, "full")
    run_id = vlm_runs.ids["full"]
    return runs, run_id, plain_answers(manager.runs_dir / run_id / "output", held_out(3))


def test_launch_py_chat_with_an_image_answers_as_plain_transformers(vlm_run):
    runs, run_id, expected = vlm_run
    (question, image), = held_out(1)
    done = launch_py("chat", run_id, "--image", str(image), "--prompt", question, "--max-new-tokens",
                     str(NEW_TOKENS), "--runs-dir", str(runs))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected[0], (done.stdout, expected)
    assert any(word in expected[0] for word in ("red", "green", "blue")), expected  # learnt, not noise


def test_the_endpoint_takes_base64_images_and_refuses_a_web_address(vlm_run):
    import openai

    from studio_core.machine.hardware import cpu_hardware
    from studio_core.serve.batching import BATCH_BUCKETS
    from studio_core.serve.chat import ChatProcess
    from studio_core.serve.openai_api import ApiServer

    runs, run_id, expected = vlm_run
    chat = ChatProcess.start(run_id, runs, cpu_hardware(), max_batch=BATCH_BUCKETS[-1])  # as `launch.py serve`
    server = None
    try:
        assert chat.info["vision"] and chat.max_batch == 1 and "vision-language" in chat.info["engine"]["says"]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = ApiServer(chat, run_id, port=port).start()
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)

        def ask(question, url):
            return client.chat.completions.create(model=run_id, max_tokens=NEW_TOKENS, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}])

        for (question, image), answer in zip(held_out(3), expected):
            url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
            assert ask(question, url).choices[0].message.content.strip() == answer
        with pytest.raises(openai.BadRequestError, match="never fetches"):
            ask("What is it?", "http://127.0.0.1:9/cat.png")
        with pytest.raises(openai.BadRequestError, match="not an image Pillow can read"):
            ask("What is it?", "data:image/png;base64," + base64.b64encode(b"not a picture").decode())
        # a plain text message to the same model is answered too
        text = client.chat.completions.create(model=run_id, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert text.choices[0].finish_reason in ("length", "stop")
    finally:
        if server is not None:
            server.stop()
        chat.unload()


def test_images_that_cannot_be_shown_are_refused_before_a_model_loads(vlm_run, tmp_path):
    runs, run_id, _ = vlm_run
    (_, image), = held_out(1)
    not_image = tmp_path / "notes.png"
    not_image.write_text("not a picture")
    for target, path, said in [
            ("builtin:tiny-qwen3", image, "builtin:tiny-qwen3 is a text model and takes no images"),
            (run_id, tmp_path / "missing.png", "no image file there"),
            (run_id, not_image, "is not an image Pillow can read")]:
        done = launch_py("chat", target, "--image", str(path), "--prompt", "What is it?", "--runs-dir", str(runs))
        assert done.returncode == 2 and said in done.stderr, (target, done.stderr)
        assert "Traceback" not in done.stderr and "Chatting with" not in done.stderr  # nothing loaded



def test_a_vlm_run_is_evaluated_on_held_out_images_as_it_answers_them_in_chat(vlm_run):
    runs, run_id, expected = vlm_run
    test_file = ensure_shapes_dataset() / "test.jsonl"
    done = launch_py("eval", run_id, "--data", str(test_file), "--limit", "3", "--max-new-tokens", str(NEW_TOKENS),
                     "--json", "--runs-dir", str(runs))
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[0])
    saved = Path(re.search(r"Saved in (\S+) \(rows\.jsonl", done.stderr)[1])
    rows = [json.loads(line) for line in (saved / "rows.jsonl").read_text().splitlines()]
    assert [row["tuned"]["answer"] for row in rows] == expected  # the chat's answers to the same images
    assert rows[0]["prompt"][0]["content"][0] == {"type": "image"}  # no image data in the saved rows
    from app.eval_tab import prompt_text

    assert prompt_text(rows[0]["prompt"]) == f"[image] {held_out(1)[0][0]}"  # as the Evaluate tab's table shows it
    assert all(row["reference"] in ("a red circle", "a green circle", "a blue circle", "a red square",
                                    "a green square", "a blue square", "a red triangle", "a green triangle",
                                    "a blue triangle") for row in rows), rows  # its text, not a repr of parts
    # the untrained built-in base answers noise: the tuned model's reference loss is far lower
    assert results["tuned"]["eval_loss"] < 0.5 * results["base"]["eval_loss"], results
