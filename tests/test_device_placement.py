"""Every model call the studio makes reaches the model on its device: tried on a stand-in device,
since this machine has no Neuron or CUDA one.

tests/fake_device.py renames PyTorch's PrivateUse1 backend to "neuron" in a child process; there
the real Neuron paths run (`device_map="neuron"`, bf16, generate's inputs on CPU) and any op that
mixes a CPU tensor with a device tensor fails as it would on the device. The tiny model runs on
it directly (Generator.score and generate, tuned and base), as the chat process (a chat and the
OpenAI endpoint over it) and as the evaluation process (the losses it scores, lm-eval's task).
The rule itself (studio_core.machine.placement) is checked in this process on PyTorch's `meta` device.

    .venv/bin/python -m pytest -q tests/test_device_placement.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.data.builtin import BUILTIN_MODEL, ensure_tiny_model

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FAKE = TESTS / "fake_device.py"
sys.path.insert(0, str(TESTS))

MISMATCH = "Expected all tensors to be on the same device"


def on_fake_device(script: str, tmp_path: Path, timeout: float = 300) -> dict:
    """Run `script` in a child Python on the fake "neuron" device; the JSON of its last stdout line.
    Fails with the child's error (a device mismatch among them) if it does not end well."""
    from fake_device import LOG_ENV, NAME_ENV

    path, log = tmp_path / "script.py", tmp_path / "mismatches.log"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           NAME_ENV: "neuron", LOG_ENV: str(log)}
    done = subprocess.run([sys.executable, str(FAKE), str(path)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert done.returncode == 0, f"the child failed:\n{done.stderr[-3000:]}"
    assert not log.exists(), f"a CPU tensor met a device tensor:\n{log.read_text()[:3000]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def fake_children(tmp_path, monkeypatch):
    """Every child the studio starts in this test (the chat process, the evaluation process) runs
    on the fake "neuron" device; yields the file its device mismatches are written to."""
    from fake_device import LOG_ENV, NAME_ENV, sitecustomize_dir

    folder = sitecustomize_dir(tmp_path / "fake-site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(NAME_ENV, "neuron")
    log = tmp_path / "mismatches.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    yield log
    assert not log.exists(), f"a CPU tensor met a device tensor:\n{log.read_text()[:3000]}"


# --- the rule, in this process --------------------------------------------------------------
@pytest.mark.fast
def test_importing_the_fake_device_leaves_this_process_and_its_children_compiling():
    """Importing fake_device (this module's tests do, in the test processes) leaves this process
    as it was: the device's switches (Dynamo off) belong to the child processes that install it,
    or no later run of the suite compiles."""
    import fake_device  # noqa: F401
    import torch._dynamo

    assert "TORCH_COMPILE_DISABLE" not in os.environ and not torch._dynamo.config.disable


@pytest.mark.fast
def test_a_forwards_inputs_go_where_the_models_parameters_are_also_under_a_lora_wrapper():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio_core.machine.placement import model_device, on_model_device

    ids, config = torch.tensor([[1, 2, 3]]), AutoConfig.from_pretrained(ensure_tiny_model())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    for one in (model, wrapped):
        assert model_device(one).type == "meta"
        placed = on_model_device(one, input_ids=ids, attention_mask=torch.ones_like(ids))
        assert {name: t.device.type for name, t in placed.items()} == {"input_ids": "meta", "attention_mask": "meta"}
        # generate keeps its inputs on CPU only on Neuron (checked on the fake device below)
        assert on_model_device(one, generate=True, input_ids=ids)["input_ids"].device.type == "meta"
    on_cpu = torch.nn.Linear(2, 2)
    assert on_model_device(on_cpu, x=ids)["x"] is ids  # already there: not copied
    assert model_device(torch.nn.ReLU()).type == "cpu"  # no parameters


# --- the Generator on the device --------------------------------------------------------------
GENERATOR = """
import json, math, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from studio_core.data.builtin import ensure_tiny_model
from studio_core.serve.generation import Generator

tiny = str(ensure_tiny_model())
adapter = "ADAPTER"
lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(r=2, target_modules=["q_proj"]))
lora.save_pretrained(adapter)
messages = [{"role": "user", "content": "What colour is the studio mascot?"}]
out = {}
for kind, target in (("lora", {"adapter": adapter}), ("full", {"base": tiny})):
    g = Generator({"label": kind, "model": tiny, "tokenizer": tiny, **target}, "neuron", 256)
    out[kind] = {"device": str(next(g.model.parameters()).device), "dtype": str(next(g.model.parameters()).dtype),
                 "scores": {side: g.score(messages, "The studio mascot is teal.", side) for side in ("tuned", "base")}}
out["answer"] = g.generate(messages, which="base", max_new_tokens=3)
from studio_core.machine.placement import on_model_device
ids = torch.tensor([[1, 2]])
out["generate_inputs"] = on_model_device(g.model, generate=True, input_ids=ids)["input_ids"].device.type
out["forward_inputs"] = on_model_device(g.model, input_ids=ids)["input_ids"].device.type
print(json.dumps(out))
"""


def test_the_generator_scores_and_answers_on_the_device_tuned_and_base(tmp_path):
    out = on_fake_device(GENERATOR.replace("ADAPTER", str(tmp_path / "adapter")), tmp_path)
    for kind in ("lora", "full"):
        assert out[kind]["device"] == "neuron:0" and out[kind]["dtype"] == "torch.bfloat16"
        for side in ("tuned", "base"):
            loss, tokens = out[kind]["scores"][side]
            assert tokens > 0 and 0 < loss < float("inf"), (kind, side, loss, tokens)
    assert (out["generate_inputs"], out["forward_inputs"]) == ("cpu", "neuron")
    assert out["answer"]["new_tokens"] >= 1 and out["answer"]["bucket"] == 64


VISION = """
import json
from studio_core.data.builtin_images import ensure_shapes_dataset
from studio_core.data.builtin_vlm import ensure_tiny_vlm
from studio_core.serve.generation import Generator
from studio_core.serve.images import image_part

vlm, shapes = str(ensure_tiny_vlm()), ensure_shapes_dataset()
row = json.loads((shapes / "test.jsonl").read_text().splitlines()[0])
messages = [{"role": "user", "content": [image_part(shapes / row["images"][0], "image"),
                                         {"type": "text", "text": "Describe the image."}]}]
g = Generator({"label": "vlm", "model": vlm, "tokenizer": vlm, "vision": True}, "neuron", 256)
print(json.dumps({"device": str(next(g.model.parameters()).device), "answer": g.generate(messages, max_new_tokens=3),
                  "score": g.score(messages, "a red circle")}))
"""


def test_a_vision_language_model_answers_and_scores_an_image_on_the_device(tmp_path):
    """Its pixel_values go to the model's device (a forward's rule, for generate() too: the vision
    tower reads them in the first forward), its ids stay on CPU for generate() on Neuron."""
    out = on_fake_device(VISION, tmp_path)
    assert out["device"] == "neuron:0" and out["answer"]["new_tokens"] >= 1 and out["answer"]["bucket"] == 128
    loss, tokens = out["score"]
    assert tokens > 0 and 0 < loss < float("inf")


# --- the chat process, the OpenAI endpoint and the evaluation process on the device ------------
def test_the_chat_process_and_the_endpoint_over_it_answer_on_the_device(tmp_path, fake_children):
    import openai

    from studio_core.serve.chat import ChatProcess
    from studio_core.machine.hardware import instance_hardware
    from studio_core.serve.openai_api import ApiServer

    chat = ChatProcess.start(BUILTIN_MODEL, tmp_path / "runs", instance_hardware("trn2.3xlarge"), max_cache_len=128)
    server = None
    try:
        assert chat.info["backend"] == "neuron"
        events = list(chat.generate([{"role": "user", "content": "Hi"}], max_new_tokens=3))
        assert events[-1]["type"] == "done" and events[-1]["new_tokens"] >= 1
        with socket.socket() as probe:  # a free port
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = ApiServer(chat, "tiny", port=port).start()
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3)
        assert answer.choices[0].finish_reason in ("length", "stop") and answer.usage.completion_tokens >= 1
    finally:
        if server is not None:
            server.stop()
        chat.unload()


def test_the_evaluation_scores_its_losses_and_runs_lm_eval_on_the_device(tmp_path, fake_children):
    from studio_core.evaluate.evaluation import EvalProcess, EvalRequest
    from studio_core.machine.hardware import instance_hardware

    include = tmp_path / "tasks"  # an lm-eval task of the user's, offline, as in tests/test_eval.py
    include.mkdir()
    (include / "two.jsonl").write_text(json.dumps({"question": "Which colour?", "choices": ["teal", "red"],
                                                   "label": 0}) + "\n")
    (include / "two.yaml").write_text(json.dumps({
        "task": "studio_two_choices", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(include / "two.jsonl")}}, "output_type": "multiple_choice",
        "doc_to_text": "{{question}}", "doc_to_choice": "choices", "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    request = EvalRequest(BUILTIN_MODEL, data="builtin:preference", metrics=("eval_loss", "preference_accuracy"),
                          limit=2, max_new_tokens=3, max_cache_len=128, tasks=("studio_two_choices",),
                          task_include=str(include))
    evaluation = EvalProcess.start(request, tmp_path / "runs", instance_hardware("trn2.3xlarge"))
    done = list(evaluation.events())[-1]
    assert done["type"] == "done", done
    summary = done["summary"]
    assert "harness_error" not in summary, summary.get("harness_error")
    assert summary["harness"]["studio_two_choices"]["samples"] == 1
    rows = [json.loads(line) for line in (Path(done["dir"]) / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        scored = row["tuned"]
        assert scored["reference_tokens"] > 0 and 0 < scored["reference_loss"] < float("inf")
        assert 0 < scored["chosen_loss"] < float("inf") and 0 < scored["rejected_loss"] < float("inf")
