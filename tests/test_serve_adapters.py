"""`launch.py serve RUN1 RUN2`: several LoRA runs on one base served by one process, the base
loaded once, each run its own model name; requests for different runs decoded in the same
batches (each row gathering its own adapter) answer as each run does alone. The second run here
is a copy of the tiny LoRA SFT run with its adapter's B matrices zeroed: it answers as the base
model does, so the two runs' answers differ and a mix-up would show. `--plan` says how runs would
be served, loading nothing; an adapter the batched engine cannot gather (DoRA) is served one
request at a time, each request switching to its run's adapter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_openai_api import KEY, QA, ROOT, client, free_port, question


def blank_copy(runs_dir, lora: str, suffix: str = "-blank") -> str:
    """A copy of the LoRA run `lora` (its id + `suffix`: each test file its own, as a worker's runs
    folder is shared) whose adapter's B matrices are zero: it answers as its base model does."""
    from safetensors.torch import load_file, save_file  # here, not at the top: collecting imports no torch

    blank = f"{lora}{suffix}"
    shutil.copytree(runs_dir / lora, runs_dir / blank)
    weights = runs_dir / blank / "output" / "adapter_model.safetensors"
    tensors = load_file(weights)
    assert any("lora_B" in name for name in tensors)
    save_file({name: t.zero_() if "lora_B" in name else t for name, t in tensors.items()}, weights)
    return blank


@pytest.fixture(scope="module")
def two_adapters(trained_runs):
    manager, ids = trained_runs
    return manager, ids["lora"], blank_copy(manager.runs_dir, ids["lora"]), ids["full"]


def serve(manager, *names: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "launch.py", "serve", *names, "--port", str(free_port()), "--runs-dir",
                             str(manager.runs_dir), "--engine", "studio", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_lora_runs_on_one_base_are_two_models_decoded_together(two_adapters, tmp_path):
    import openai

    manager, lora, blank, _ = two_adapters
    key = tmp_path / "key"
    key.write_text(KEY)
    proc = serve(manager, lora, blank, extra=("--api-key-file", str(key)))
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"Serving {lora}, {blank} at "), line + proc.stderr.read()
        server = {"url": line.split(" at ")[1].split(" ")[0]}
        api = client(server, timeout=300)
        assert [m.id for m in api.models.list().data] == [lora, blank]

        def ask(model: str, i: int) -> str:
            return api.chat.completions.create(model=model, messages=question(i), max_tokens=32,
                                               temperature=0).choices[0].message.content

        alone = {(model, i): ask(model, i) for model in (lora, blank) for i in range(3)}
        assert all(alone[(lora, i)] == QA[i][1]["content"] for i in range(3))  # the tuned adapter's answers
        assert all(alone[(blank, i)] != alone[(lora, i)] for i in range(3))  # the blank one answers as the base
        with ThreadPoolExecutor(max_workers=6) as pool:  # both runs' requests at once: decoded in shared batches
            together = dict(zip(alone, pool.map(lambda key: ask(*key), alone)))
        assert together == alone
        with pytest.raises(openai.NotFoundError, match="this server serves"):
            api.chat.completions.create(model="gpt-4o", messages=question(0), max_tokens=4)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("which, extra, says", [
    ("full", (), "served together only as LoRA adapters on one base"),
    ("blank", ("--max-batch", "1"), "leave out --max-batch 1"),
])
def test_runs_that_cannot_share_a_base_are_refused_before_loading(two_adapters, which, extra, says):
    manager, lora, blank, full = two_adapters
    proc = serve(manager, lora, {"full": full, "blank": blank}[which], extra=extra)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and says in err and "Traceback" not in err, err


def dora_copy(runs_dir, lora: str, suffix: str = "-dora") -> str:
    """A copy of the LoRA run `lora` (its id + `suffix`) whose adapter says use_dora: PEFT loads it as
    DoRA (its magnitudes, missing from the file, taken from the base weights), which the batched
    engine cannot gather per row."""
    dora = f"{lora}{suffix}"
    shutil.copytree(runs_dir / lora, runs_dir / dora)
    config = runs_dir / dora / "output" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))
    return dora


def test_the_plan_says_how_runs_would_be_served_and_a_dora_adapter_is_served_one_request_at_a_time(
        two_adapters, tmp_path):
    manager, lora, blank, _ = two_adapters
    dora = dora_copy(manager.runs_dir, lora)

    def plan(*names: str, extra: tuple[str, ...] = ()) -> str:
        done = subprocess.run([sys.executable, "launch.py", "serve", *names, "--plan", "--runs-dir",
                               str(manager.runs_dir), "--engine", "studio", *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "batched, not compiled" in plan(lora, blank)
    assert "29 graphs compiled at start by inductor" in plan(lora, blank, extra=("--compile",))
    assert "one request at a time" in plan(lora, dora) and "DoRA" in plan(lora, dora)
    proc = serve(manager, lora, dora)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"Serving {lora}, {dora} at ") and "one request at a time" in line, line
        engine = next(line for line in proc.stderr if line.startswith("Engine: "))
        assert "one request at a time (transformers' generate)" in engine and "DoRA" in engine, engine
        api = client({"url": line.split(" at ")[1].split(" ")[0]}, key="none", timeout=300)
        reply = api.chat.completions.create(model=lora, messages=question(0), max_tokens=32, temperature=0)
        assert reply.choices[0].message.content == QA[0][1]["content"]  # its own adapter, switched to per request
        other = api.chat.completions.create(model=dora, messages=question(0), max_tokens=32, temperature=0)
        assert other.choices[0].message.content != reply.choices[0].message.content
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
