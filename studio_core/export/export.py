"""Export a finished run as a clean model folder with a model card.

    python -m studio_core.export.export RUN_DIR OUT_DIR [--merge]   (what export_run starts)

The folder holds the model (a LoRA adapter merged into its base with --merge, else the
adapter alone; a full run's model as it is; a reward model as the sequence classifier it is;
a vision-language model as the image-text-to-text model it is) in safetensors, the tokenizer
with its chat template (a vision-language model's whole processor), the generation config, a
loss plot (loss.png) and README.md, a model card made with huggingface_hub's ModelCard and
ModelCardData: base model, datasets, library, tags, license when the base model's card says it,
the training settings and layout, the final metrics, the compilations, the plot, and
studio_output.json (export_info: what the folder holds).
Nothing else from the run folder is copied (not training_args.bin, not the log), and no token
is ever involved: pushing is studio_core.export.hub.

The base is named as the run named it (a Hub id, builtin:tiny-qwen3, or the user's own folder),
never by the folder the studio built or cached it in: the card, the metadata and an adapter's
base_model_name_or_path all go to the Hub. The card's usage code names the repo on a
placeholder line (REPO_LINE) that the push replaces with the repo's id (card_for_repo).

Loading and merging need torch, so the export runs in a child process; export_run is the
app's and the CLI's way in. The export works on the host CPU on every backend. On the CPU
backend, where runs and chats lease CPU cores, it leases one too (kind "export") and is
pinned to it: a held core it asks for is refused naming the holder, and a run cannot take
the export's core. On Neuron and CUDA it takes no NeuronCore or GPU, so it holds no lease.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

from studio_core.machine import children, leases
from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.machine.device_env import device_env, flags_problem
from studio_core.machine.hardware import Hardware, pin_to_cpu_cores
from studio_core.rundir import events, folder
from studio_core.runs.view import format_loss
from studio_core.rundir.folder import OUTPUT_INFO
from studio_core.data.builtin_vlm import BUILTIN_VLM
from studio_core.data.sources import BUILTIN_MODELS, HUB_ID, builtin_folder, check_model, is_vision_model
from studio_core.recipe.spec import RunSpec, load_spec
from studio_core.recipe.validate import SECRET_FIELDS, holds_token

CARD_TEMPLATE = Path(__file__).with_name("model_card.md")
REPO_LINE = 'repo_id = "your-name/model-name"  # replace: the Hub repo this folder is pushed to, or its path'
TIMEOUT_S = 3600


class ExportError(ValueError):
    """The export cannot be made; the message says what to change."""


def export_run(run_dir: str | Path, out_dir: str | Path, merge: bool = False, hardware: Hardware | None = None,
               cores: str | None = None) -> dict:
    """Export in a child process; returns its summary {folder, kind, files, cores}. With a CPU
    `hardware`, the child holds one CPU core (`cores`, or the first free one) while it works."""
    run_dir, out_dir = Path(run_dir).expanduser(), Path(out_dir).expanduser()
    check_out(run_dir, out_dir)
    info = read_output_info(run_dir)
    try:
        spec = load_spec(run_dir)  # the card tells its settings: a damaged spec.yaml is named here, not in the child
    except folder.DamagedRun as error:
        raise ExportError(str(error)) from None
    if merge and info["kind"] != "adapter":
        raise ExportError(f"run {run_dir.name} trained the full model: there is no adapter to merge; "
                          "export it without merge")
    if info["kind"] == "adapter":
        check_base(run_dir, info, bool(spec.args.get("trust_remote_code")))
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir} is not empty: choose a new folder (nothing is overwritten)")
    args = [run_dir, out_dir, *(["--merge"] if merge else [])]
    if hardware is None or hardware.backend != "cpu":  # it loads on CPU; no device core is taken
        if hardware and flags_problem(hardware):  # the studio's NEURON_CC_FLAGS name another LNC
            raise ExportError(flags_problem(hardware))
        env = device_env(hardware, compile_cache_root(), None) if hardware else None
        done = children.run("studio_core.export.export", *args, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
        return _result(done.returncode, done.stdout, done.stderr, out_dir)
    runs_dir = run_dir.parent
    with leases.choosing(runs_dir):  # until the child holds the core chosen here
        try:
            chosen = leases.choose(runs_dir, hardware, 1, cores or None)
        except leases.NoFreeCores as none:
            raise ExportError(f"no free CPU core for the export: all {none.count} are held ({none.holding}); "
                              "wait for one of them, or stop it") from none
        except ValueError as error:
            raise ExportError(f"cores: {error}") from error
        child = children.start("studio_core.export.export", *args, "--cores", ",".join(map(str, chosen)),
                               env=device_env(hardware, compile_cache_root(), chosen), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        leases.wait_held(runs_dir, hardware.backend, chosen, child)
    try:
        stdout, stderr = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return _result(child.returncode, stdout, stderr, out_dir)


# The runs folder's own state, which the studio writes and manages itself. Its exports/ is not
# among them: it is where the Export tab puts exports (<runs dir>/exports/<run id>).
STATE_FOLDERS = {"sweeps": "sweeps' records (runs/sweep.py)", "serve-logs": "model servers' logs",
                 "smoke": "smoke tests' folders and runs", "uploads": "Train tab's uploads",
                 ".leases": "core leases"}
HIDDEN_STATE = (folder.CREATING, folder.DELETING)  # a run folder being made, or being deleted


def check_out(run_dir: Path, out_dir: Path) -> None:
    """The export's folder: given, and not inside the run's folder (deleting the run would delete
    the export with it), nor inside another run's folder, nor the runs folder itself or its own
    state (STATE_FOLDERS; a run folder being made or deleted), symlinks
    resolved; ExportError says what to give instead."""
    if not str(out_dir).strip():
        raise ExportError("the export folder is empty: give a folder")
    out, run = Path(out_dir).expanduser().resolve(), Path(run_dir).expanduser().resolve()
    instead = f"give a folder outside it, such as {run.parent / 'exports' / run.name}"  # where the Export tab puts it
    if out == run or out.is_relative_to(run):
        raise ExportError(f"{out_dir} is inside the folder of run {run.name} ({run}): the export would be deleted "
                          f"with the run; {instead}")
    home = run.parent
    if out == home:
        raise ExportError(f"{out_dir} is the runs folder itself ({home}), which holds every run; {instead}")
    if not out.is_relative_to(home):
        return
    top = home / out.relative_to(home).parts[0]
    if folder.is_run(top):
        raise ExportError(f"{out_dir} is inside the folder of run {top.name} ({top}): the export would be deleted "
                          f"with that run; {instead}")
    if top.name.startswith(HIDDEN_STATE):
        raise ExportError(f"{out_dir} is inside {top}, a run folder the studio is making or deleting; {instead}")
    if top.name in STATE_FOLDERS:
        raise ExportError(f"{out_dir} is inside {top}, where the studio keeps the {STATE_FOLDERS[top.name]}: "
                          f"keep exports apart from its own files; {instead}")


def check_base(run_dir: Path, info: dict, trust_remote_code: bool) -> None:
    """An adapter's base model, which the export loads from where the run loaded it (a built-in one
    from the folder the studio builds it in again, base_folder): checked as a run's model is before
    launch (sources.check_model), so that a base moved or damaged since the run is named here, not
    as the child's traceback."""
    builtin = info["base_model"] in BUILTIN_MODELS
    path = info["base_model"] if builtin else info.get("base_model_path") or info["base_model"]
    problems = check_model(path, trust_remote_code)
    if problems:
        said = "; ".join(p.removeprefix("model_name_or_path: ") for p in problems)
        raise ExportError(f"run {run_dir.name} is a LoRA adapter on {info['base_model']}, and the export cannot load "
                          f"that base: {said}")


def _result(returncode: int, stdout: str, stderr: str, out_dir: Path) -> dict:
    if returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        raise ExportError(f"the export failed (nothing usable in {out_dir}): {tail}")
    return json.loads(stdout.strip().splitlines()[-1])


def read_output_info(run_dir: Path) -> dict:
    info = folder.output_info(run_dir)
    if info is None:
        raise ExportError(f"run {run_dir.name} has no saved model (a run saves it when training finishes); "
                          "pick a finished run")
    return info


def base_folder(info: dict) -> str:
    """Where an adapter's base loads from: a built-in base's folder (built again if its cache is
    gone; this imports torch), else where the run loaded it."""
    return str(builtin_folder(info["base_model"]) or info.get("base_model_path") or info["base_model"])


def is_vision_run(run_dir: Path, info: dict) -> bool:
    """Whether the run trained a vision-language model: by its saved model's config, or by its
    base's for an adapter."""
    base = info.get("base_model_path") or info["base_model"]
    return is_vision_model(str(run_dir / folder.OUTPUT if info["kind"] == "full" else base))


def run_summary(run_dir: Path) -> dict:
    """What the card tells about the run, from its folder: spec, hardware, metrics, compilations.
    The run's events are folded as the run page folds them: a run resumed from a checkpoint
    shows only the path that led to the model (the abandoned attempt's later points dropped)."""
    spec = load_spec(run_dir)
    launch = folder.read_launch(run_dir)
    state = events.fold(events.read(run_dir / folder.EVENTS))
    from studio_core.evaluate.evaluation import evaluations

    return {"spec": spec, "hardware": launch.get("hardware", {}), "cores": launch.get("cores"),
            "evaluations": evaluations(run_dir),
            "losses": state.losses(), "final": state.final_metrics(), "last_loss": state.last_loss(),
            "compiles": len(state.compiles), "compile_seconds": round(state.compile_seconds(), 1),
            "shapes": len(state.shapes), "attempts": state.attempts}


def card_data(summary: dict, kind: str, base_license: str | None, vision: bool = False):
    """The card's metadata: what the Hub indexes and filters on (a vision-language model's
    pipeline is image-text-to-text)."""
    from huggingface_hub import ModelCardData

    spec: RunSpec = summary["spec"]
    hub_base = spec.model_name_or_path if HUB_ID.match(spec.model_name_or_path) else None
    hub_data = spec.dataset_name if HUB_ID.match(spec.dataset_name) else None
    trainer = spec.trainer_entry
    tags = ["trl", trainer.key, "trn-studio", *(["lora", "peft"] if kind == "adapter" else [])]
    tags += ["reward-model"] if not trainer.chats else []
    tags += ["vision-language"] if vision else []
    if summary["hardware"].get("backend") == "neuron":
        tags += ["trainium", "neuron"]
    return ModelCardData(base_model=hub_base, datasets=[hub_data] if hub_data else None,
                         library_name="peft" if kind == "adapter" else "transformers", license=base_license,
                         pipeline_tag="image-text-to-text" if vision else trainer.task, tags=tags,
                         model_name=spec.display_name,
                         eval_results=eval_results(summary.get("evaluations") or [], trainer.task) or None)


LM_EVAL_URL = "https://github.com/EleutherAI/lm-evaluation-harness"


def eval_results(found: list[dict], task: str) -> list:
    """The run's evaluations (newest first) as the Hub's model-index results: the tuned model's
    scores, the newest of each (data, split, metric) (the base's are in the card's text beside
    them), and lm-eval's task scores, each task its own dataset."""
    from huggingface_hub import EvalResult

    results, seen = [], set()
    for evaluation in found:
        data, split = evaluation.get("data"), evaluation.get("split")
        for metric, value in (evaluation.get("results", {}).get("tuned") or {}).items():
            if isinstance(value, (int, float)) and (data, split, metric) not in seen:
                seen.add((data, split, metric))
                results.append(EvalResult(task_type=task, dataset_type=data if HUB_ID.match(data) else "json",
                                          dataset_name=data, dataset_split=split, metric_type=metric,
                                          metric_value=value, metric_name=metric.replace("_", " ")))
        for name, metrics in (evaluation.get("harness") or {}).items():
            for metric, value in metrics.items():
                if isinstance(value, (int, float)) and metric != "samples" and "_stderr" not in metric \
                        and ("lm-eval", name, metric) not in seen:
                    seen.add(("lm-eval", name, metric))
                    results.append(EvalResult(task_type=task, dataset_type=name, dataset_name=name,
                                              metric_type=metric, metric_value=value, metric_name=metric,
                                              source_name="lm-evaluation-harness", source_url=LM_EVAL_URL))
    return results


def _main(run_dir: Path, out_dir: Path, merge: bool, cores: list[int] | None) -> None:
    if cores is None:
        return _export(run_dir, out_dir, merge, None)
    try:
        lease = leases.acquire(run_dir.parent, "cpu", cores, holder=f"export {run_dir.name}", kind="export")
    except leases.CoresBusy as error:
        sys.exit(f"CoresBusy: {error}")
    with lease:
        pin_to_cpu_cores(cores)
        import torch

        torch.set_num_threads(len(cores))
        _export(run_dir, out_dir, merge, cores)


def _export(run_dir: Path, out_dir: Path, merge: bool, cores: list[int] | None) -> None:
    import torch
    from huggingface_hub import ModelCard
    from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification,
                              AutoProcessor, AutoTokenizer)

    info = read_output_info(run_dir)
    output = run_dir / folder.OUTPUT
    summary = run_summary(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vision = is_vision_run(run_dir, info)
    tokenizer = (AutoProcessor if vision else AutoTokenizer).from_pretrained(output)  # a VLM's: the whole processor
    scores = info.get("task", "text-generation") == "text-classification"  # a reward model: one score
    auto, extra = (AutoModelForSequenceClassification, {"num_labels": 1}) if scores else (AutoModelForCausalLM, {})
    auto = AutoModelForImageTextToText if vision else auto
    if info["kind"] == "adapter" and not merge:
        from peft import PeftModel

        base = auto.from_pretrained(base_folder(info), dtype=torch.float32, **extra)
        model = PeftModel.from_pretrained(base, output)
        model.peft_config["default"].base_model_name_or_path = info["base_model"]  # not the local folder
        kind = "adapter"
    elif info["kind"] == "adapter":
        from peft import PeftModel

        base = auto.from_pretrained(base_folder(info), **extra)
        model = PeftModel.from_pretrained(base, output).merge_and_unload()
        kind = "merged"
    else:
        model = auto.from_pretrained(output)
        kind = "full"
    children.set_up()  # imported and loaded: the collector on again
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)  # with its chat template (and a VLM's image processor)
    generation = getattr(model.get_base_model() if kind == "adapter" else model, "generation_config", None)
    if generation is not None and not scores:
        generation.save_pretrained(out_dir)
    plot = _loss_plot(summary["losses"], out_dir / "loss.png")
    card = ModelCard.from_template(card_data(summary, "adapter" if kind == "adapter" else "full",
                                             _base_license(info), vision),
                                   template_path=str(CARD_TEMPLATE), **_card_text(summary, kind, info, plot, vision))
    card.save(out_dir / "README.md")
    (out_dir / OUTPUT_INFO).write_text(json.dumps(export_info(info, kind), indent=2))
    same_mode(out_dir, out_dir / OUTPUT_INFO)
    files = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file())
    print(json.dumps({"folder": str(out_dir), "kind": kind, "files": files, "cores": cores}))


def same_mode(out_dir: Path, reference: Path) -> None:
    """Every file of the export with the mode of `reference` (one written plainly, so the user's
    umask's): safetensors writes its weights 0600, beside the 0644 of the rest."""
    mode = stat.S_IMODE(reference.stat().st_mode)
    for path in out_dir.rglob("*"):
        if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)


def export_info(info: dict, kind: str) -> dict:
    """The export's studio_output.json: `kind` adapter, merged (a full model: the adapter merged
    into its base) or full, and the base as the run named it (no path of this machine)."""
    return {"kind": kind, "trainer": info["trainer"], "task": info.get("task", "text-generation"),
            "base_model": info["base_model"]}


def card_for_repo(card: str, repo_id: str) -> str:
    """The export's card as pushed to `repo_id`: its usage code loads that repo."""
    return card.replace(REPO_LINE, f'repo_id = "{repo_id}"')


def _base_license(info: dict) -> str | None:
    """The license the base model's own card declares, when the card is at hand (no download)."""
    from huggingface_hub import ModelCard, try_to_load_from_cache

    local = Path(info["base_model_path"]) / "README.md"
    path = local if local.exists() else None
    if path is None and HUB_ID.match(info["base_model"]):
        cached = try_to_load_from_cache(info["base_model"], "README.md")
        path = Path(cached) if isinstance(cached, str) else None
    return ModelCard.load(path).data.license if path else None


def _loss_plot(losses: list[tuple[int, float]], path: Path) -> str | None:
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.2), dpi=100)
    axes.plot([s for s, _ in losses], [v for _, v in losses], color="#268bd2")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path.name


def _card_text(summary: dict, kind: str, info: dict, plot: str | None, vision: bool = False) -> dict:
    spec: RunSpec = summary["spec"]
    trainer = spec.trainer_entry
    hardware = summary["hardware"]
    # a secret never reaches the card, even from a run folder made before the studio refused them
    settings = "\n".join(f"| `{k}` | `{v!r}` |" for k, v in sorted(spec.args.items())
                         if k not in SECRET_FIELDS and not holds_token(v))
    final = "\n".join(f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |"
                      for k, v in summary["final"].items())
    where = hardware.get("instance_type") or hardware.get("backend", "?")
    layout = (f"{spec.layout.nproc} process(es), TP {spec.layout.tp_size} x FSDP {spec.layout.fsdp_size}, "
              f"{hardware.get('backend', '?')} cores {summary['cores']} on {where}")
    trained = f"TRL's {trainer.name} trainer on {spec.dataset_name}"
    base = info["base_model"]
    if trainer.chats:
        how = {"full": f"{base}, fully fine-tuned with {trained}",
               "merged": f"{base} with a LoRA adapter trained by {trained}, merged into its weights",
               "adapter": f"A LoRA adapter for {base}, trained with {trained}; load it with PEFT"}[kind]
    else:
        what = ("A reward model: it reads a text (a prompt with its answer, through the chat template) and gives "
                "it one score, higher for the kind of answer the training data preferred. It does not generate "
                "text: use it to rank answers, or as the reward of an RL trainer")
        how = {"full": f"{what}. Made from {base} with {trained}",
               "merged": f"{what}. Made from {base} with a LoRA adapter trained by {trained}, merged into its weights",
               "adapter": f"{what}. A LoRA adapter (with its score head) for {base}, trained with {trained}; load "
                          "it with PEFT"}[kind]
    resumed = (f"; resumed {summary['attempts'] - 1} time(s) from a checkpoint (the loss shown is the path that "
               "led to this model)") if summary.get("attempts", 1) > 1 else ""
    return {"model_name": spec.display_name, "what": how, "trainer": trainer.name,
            "base": base, "base_note": _base_note(base, kind),
            "dataset": spec.dataset_name, "layout": layout + resumed, "settings": settings,
            "final": final or "| - | - |",
            "last_loss": format_loss(summary["last_loss"]),
            "compiles": summary["compiles"], "compile_seconds": summary["compile_seconds"],
            "shapes": summary["shapes"], "plot": f"![training loss]({plot})" if plot else "",
            "evaluation": _evaluations_text(summary.get("evaluations") or []),
            "loader": _loader(kind, base, scores=not trainer.chats, vision=vision, image_size=spec.image_size),
            "generates": trainer.chats and not vision, "vision": vision, "image_size": spec.image_size}


def _evaluations_text(found: list[dict]) -> str:
    """Every evaluation of the run, newest first, each a table of its models side by side, with
    how it was made, and lm-eval's task scores where it ran tasks."""
    if not found:
        return "Not evaluated: `launch.py eval RUN_ID` (or the studio's Evaluate tab) compares it with its base."
    parts = [_evaluation_text(evaluation) for evaluation in found]
    return "\n\n".join(parts)


def _evaluation_text(evaluation: dict) -> str:
    sides = list(evaluation.get("results") or {})
    metrics = list(dict.fromkeys(m for side in sides for m in evaluation["results"][side]))
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(evaluation["time"])) + " UTC, " if evaluation.get("time") \
        else ""
    lines = [f"{when}on {evaluation['rows']} prompts of {evaluation['data']} (split {evaluation['split']}), greedy, "
             f"at most {evaluation['max_new_tokens']} new tokens"
             f"{'; ' + evaluation['note'] if evaluation.get('note') else ''}:",
             "", "| metric | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
    for metric in metrics:
        cells = [evaluation["results"][side].get(metric) for side in sides]
        lines.append(f"| {metric} | " + " | ".join("-" if c is None else f"{c:.4g}" for c in cells) + " |")
    tasks = evaluation.get("harness") or {}
    if tasks:
        lines += ["", "lm-evaluation-harness, the tuned model:", "", "| task | metric | value |", "|---|---|---|"]
        for name, values in tasks.items():
            lines += [f"| {name} | {metric} | {'-' if value is None else f'{value:.4g}'} |"
                      for metric, value in values.items() if metric != "samples"]
    return "\n".join(lines)


# each built-in base: what it is, and the studio's function that builds it (the card's usage code imports it)
BUILTIN_BASES = {BUILTIN_MODEL: ("tiny model", "studio_core.data.builtin", "ensure_tiny_model"),
                 BUILTIN_VLM: ("tiny vision-language model", "studio_core.data.builtin_vlm", "ensure_tiny_vlm")}


def _base_note(base: str, kind: str) -> str:
    """Where the base comes from, when a reader needs to know."""
    if base in BUILTIN_BASES:
        what, _, build = BUILTIN_BASES[base]
        builtin = (f"`{base}`, the Trainium fine-tuning studio's built-in {what}: the studio builds it offline "
                   "and it is not on the Hub, so it cannot be downloaded")
        if kind != "adapter":
            return f"Made from {builtin}. This folder holds the whole model: it loads without the studio."
        return (f"The adapter's base model is {builtin}. Loading the adapter needs the studio to rebuild that "
                f"base (`{build}()` below, run from the studio's folder).")
    if kind != "adapter":
        return ""
    if HUB_ID.match(base):
        return f"The adapter's base model is `{base}` on the Hub: PEFT downloads it when it loads the adapter."
    return f"The adapter's base model is the local folder `{base}` (not on the Hub): load the adapter on that model."


def _loader(kind: str, base: str, scores: bool, vision: bool = False, image_size: int | None = None) -> str:
    """The card's usage code: it loads the repo named on REPO_LINE (the push fills it in)."""
    if vision:
        return _vision_loader(kind, base, image_size)
    model, labels = ("ModelForSequenceClassification", ", num_labels=1") if scores else ("ModelForCausalLM", "")
    if kind != "adapter":
        code = (f"from transformers import Auto{model}, AutoTokenizer\n{REPO_LINE}\n"
                f"model = Auto{model}.from_pretrained(repo_id)")
    elif base == BUILTIN_MODEL:
        code = (f"from peft import PeftModel\nfrom transformers import Auto{model}, AutoTokenizer\n"
                "from studio_core.data.builtin import ensure_tiny_model  # the studio rebuilds its built-in base\n"
                f"{REPO_LINE}\nbase = Auto{model}.from_pretrained(ensure_tiny_model(){labels})\n"
                "model = PeftModel.from_pretrained(base, repo_id)")
    else:
        code = (f"from peft import AutoPeft{model}\nfrom transformers import AutoTokenizer\n{REPO_LINE}\n"
                f"model = AutoPeft{model}.from_pretrained(repo_id{labels})")
    code += "\ntokenizer = AutoTokenizer.from_pretrained(repo_id)"
    if scores:
        code += "\nscore = model(**tokenizer(text, return_tensors=\"pt\")).logits[0, 0]  # one number per text"
    else:
        code += "\n\n" + GENERATE
    return code


def _vision_loader(kind: str, base: str, image_size: int | None = None) -> str:
    """A vision-language model's usage code: the model (an adapter on its base) and its processor,
    asked about the image named on IMAGE_LINE (resized as the run resized its images, if it did:
    studio.image_size)."""
    code = "from PIL import Image\n"
    if kind != "adapter":
        code += f"from transformers import AutoModelForImageTextToText, AutoProcessor\n{REPO_LINE}\n"
        code += "model = AutoModelForImageTextToText.from_pretrained(repo_id)"
    else:
        code += "from peft import PeftModel\nfrom transformers import AutoModelForImageTextToText, AutoProcessor\n"
        if base in BUILTIN_BASES:
            _, module, build = BUILTIN_BASES[base]
            code += f"from {module} import {build}  # the studio rebuilds its built-in base\n"
            where = f"{build}()"
        else:
            where = repr(base)
        code += (f"{REPO_LINE}\nbase = AutoModelForImageTextToText.from_pretrained({where})\n"
                 "model = PeftModel.from_pretrained(base, repo_id)")
    generate = GENERATE_FROM_IMAGE if image_size is None else GENERATE_FROM_IMAGE.replace(
        IMAGE_LINE, IMAGE_LINE.replace('.convert("RGB")', f'.convert("RGB").resize(({image_size}, {image_size}))', 1)
        + f" (trained at {image_size}x{image_size})", 1)
    return code + "\nprocessor = AutoProcessor.from_pretrained(repo_id)\n\n" + generate


IMAGE_LINE = 'image = Image.open("your-image.png").convert("RGB")  # replace: the picture to ask about'
# A vision-language model's answer example: the chat template puts the image's place in the
# prompt, and the processor turns the image into the tokens that fill it. Plain transformers.
GENERATE_FROM_IMAGE = IMAGE_LINE + """
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(text=prompt, images=[image], return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
print(processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())"""

# The card's answer example. A chat template with a thinking switch (Qwen3's) opens a <think>
# block unless told enable_thinking=False, and the studio trained the answer after an empty one
# (studio_core.serve.chat.template_kwargs): without the switch the model writes an empty
# <think></think> first. Plain transformers, no studio code.
GENERATE = """\
messages = [{"role": "user", "content": "What is the capital of France?"}]
thinking_off = {"enable_thinking": False} if "enable_thinking" in (tokenizer.chat_template or "") else {}
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                       **thinking_off)
output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())"""


if __name__ == "__main__":
    children.skip_final_collection()
    children.collection_off()
    flags = sys.argv[3:]
    held = [int(c) for c in flags[flags.index("--cores") + 1].split(",")] if "--cores" in flags else None
    _main(Path(sys.argv[1]), Path(sys.argv[2]), "--merge" in flags, held)
