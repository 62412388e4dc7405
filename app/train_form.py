"""The Train tab's form: its widgets, and the one place where their values become a RunSpec.

Every widget is named after the setting it holds (TRL's name where TRL has one); a trainer's
own settings (studio_core.recipe.trainers) are named `<trainer>.<setting>` and show only for that
trainer. LoRA and the advanced settings are folded away. Labels and choices come from TRL's
config classes (studio_core.recipe.trl_schema).
"""

from __future__ import annotations

import importlib.util
import math
import re

import gradio as gr
import yaml

from app import fields as option_fields
from studio_core import backends
from studio_core.backends import BACKENDS, DEFAULT
from studio_core.recipe import trainers
from studio_core.data import sources
from studio_core.data.builtin import BUILTIN_DATASETS, BUILTIN_MODEL
from studio_core.machine.hardware import INSTANCES, LNC_VALUES, Hardware, Target
from studio_core.recipe.spec import TRACKERS, Layout, RunSpec, SpecError
from studio_core.recipe.validate import check_args
from studio_core.recipe.trainers import FormField
from studio_core.recipe.trl_schema import trainer_fields

THIS_MACHINE = "this machine"
LAYOUT_LABELS = option_fields.labels(Layout)  # the layout's widgets' labels: Layout's metadata, with its flags
TARGET_LABELS = option_fields.labels(Target)  # Plan for and LNC, beside --instance and --lnc
# The form's starting values suit the built-in tiny model: from random weights, it learns its
# facts in seconds at this rate. Any other model starts at TRL's default for the trainer.
TINY_LEARNING_RATE = 2e-3
# the built-in models' starting learning rates: high, as they start from random weights
BUILTIN_LEARNING_RATES = {BUILTIN_MODEL: TINY_LEARNING_RATE, sources.BUILTIN_VLM: 1e-3}
# The number boxes whose label is not the setting's name (the others are labelled with TRL's name).
WHOLE = re.compile(r"[+-]?[0-9]+")  # a whole number as typed (int() also reads 1_000)
NUMBER_LABELS = {"eval_fraction": "Hold out for evaluation (fraction)", "precompile_jobs": "Precompile jobs",
                 "image_size": "Resize images to (pixels a side)",
                 **{name: LAYOUT_LABELS[name] for name in ("nproc", "tp_size", "fsdp_size", "nodes")}}


def number_box(start, **settings) -> gr.Textbox:
    """A number's box, in the current Blocks context. A one-line text box, not gr.Number: the
    browser's number input hands Gradio nothing for what is no number (`abc`, `1e999`), so the
    box blanked and the form read 0; text reaches `read_number`, which says what was typed."""
    return gr.Textbox(None if start is None else str(start), max_lines=1, **settings)


def parse_number(value) -> float | int | None:
    """A number box's value (its text, or a number a clone or a test put there) as a number;
    None when it is none (empty, `abc`, `nan`). A whole number written whole stays an exact int."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    else:
        number = _from_text(str(value or "").strip())
    return None if number is None or number != number else number  # nan is no number


def _from_text(text: str) -> float | int | None:
    if WHOLE.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return None


def _as_float(number: int | float) -> float:
    """The number as a float, infinite where a whole number is too large for one."""
    try:
        return float(number)
    except OverflowError:
        return math.inf if number > 0 else -math.inf


def read_number(value, label: str, whole: bool = False, blank: int | float | None = None) -> int | float:
    """A number box's value as the recipe holds it: an int where the setting counts (`whole`),
    else a float; `blank` for an empty box (None: a number is needed). SpecError naming the box,
    what was typed and why it is refused, and what to write instead."""
    text = "" if value is None else str(value).strip()
    wanted = "a whole number, e.g. 4" if whole else "a number, e.g. 0.5 or 2e-5"
    if not text:
        if blank is None:
            raise SpecError([f"{label}: empty; write {wanted}"])
        return blank
    number = parse_number(value)
    if number is None:
        raise SpecError([f"{label}: {text!r} is not a number; write {wanted}"])
    if whole and isinstance(number, int):
        return number
    size = _as_float(number)
    if math.isinf(size):
        sign = "minus " if size < 0 else ""
        raise SpecError([f"{label}: {text!r} reads as {sign}infinity (too large to hold); write {wanted}"])
    if whole and not size.is_integer():
        raise SpecError([f"{label}: {text!r} is not a whole number; write {wanted}"])
    return int(size) if whole else size


class FormNumbers:
    """The form's number boxes read by name, every refusal kept (by setting) to be said at once."""

    def __init__(self, values: dict):
        self.values, self.problems = values, {}

    def __call__(self, name: str, whole: bool = False, blank: int | float | None = None, label: str | None = None):
        try:
            return read_number(self.values.get(name), label or NUMBER_LABELS.get(name, name), whole, blank)
        except SpecError as error:
            self.problems[name] = error.problems[0]
            return 0 if blank is None else blank

    def check(self, overridden=()) -> None:
        """SpecError with every box refused, but those whose setting "Other TRL settings" gives (applied last)."""
        problems = [problem for name, problem in self.problems.items() if name not in overridden]
        if problems:
            raise SpecError(problems)


def report_choices() -> list[str]:
    """TRL's report_to values this environment can run: none, and each tracker installed (an
    environment set up without requirements.txt may lack one: a run reporting to it would fail)."""
    return ["none", *[name for name in TRACKERS if importlib.util.find_spec(name) is not None]]


def report_info(choices: list[str]) -> str:
    if len(choices) > 1:
        return "TRL's report_to; the Runs tab says where to open it"
    return ("neither TensorBoard nor Trackio is installed here: `pip install -r requirements.txt` "
            "in the studio's environment installs both; then restart the studio")


def learning_rate_start(trainer: str, model: str) -> float:
    """The form's starting learning rate: the tiny model's, or TRL's default for the trainer."""
    return BUILTIN_LEARNING_RATES.get((model or "").strip(), trainer_fields(trainer)["learning_rate"]["default"])


def learning_rate_info(trainer: str, model: str, own: bool = False) -> str:
    """Where the learning rate shown comes from, and TRL's default for the trainer."""
    entry = trainers.get(trainer)
    trl_default = f"TRL's default for {entry.name} ({entry.config_class}) is " \
                  f"{trainer_fields(trainer)['learning_rate']['default']:g}"
    if own:
        return f"your value; {trl_default}"
    if (model or "").strip() in BUILTIN_LEARNING_RATES:
        return (f"{learning_rate_start(trainer, model):g} and the other starting values suit the built-in tiny "
                f"model (seconds on a CPU); {trl_default}, set when you pick another model")
    return f"{trl_default}; the built-in tiny model starts at {TINY_LEARNING_RATE:g}"


def help_choices(trainer: str, field: str) -> list[str]:
    """The values TRL's help text lists for a field (TRL keeps some choices only there)."""
    text = trainer_fields(trainer)[field]["help"]
    sentence = re.split(r"(?:Possible|Supported) values are:?", text)[-1].split(".")[0]
    return re.findall(r"'([a-z_]+)'", sentence)


def trainer_info(trainer: str) -> str:
    """The line under the trainer's choice: what it learns, and from what data."""
    entry = trainers.get(trainer)
    return f"{entry.name} {entry.help}; it reads {entry.data_help}"


def field_choices(trainer: str, field: FormField) -> list[str]:
    """A choice field's values: the registry's, else TRL's own for the field, else its help text's."""
    return list(field.choices) or trainer_fields(trainer)[field.name]["choices"] or help_choices(trainer, field.name)


def field_widget(trainer: str, field: FormField) -> gr.Component:
    """The widget of one of a trainer's own settings (studio_core.recipe.trainers.FormField)."""
    common = {"label": field.name, "info": field.info, "elem_id": f"{trainer}-{field.name}"}
    if field.kind == "rewards":  # a code box's label is one short line (its buttons cover the rest): help above
        gr.Markdown(field.info, elem_classes="field-help")
        return gr.Code(field.start, language="yaml", lines=4, elem_id=common["elem_id"],
                       label="Reward functions (YAML list)")
    if field.kind == "choice":
        return gr.Dropdown(field_choices(trainer, field), value=field.start, **common)
    return number_box(field.start, **common)


class TrainForm:
    """Creates the widgets in the current Blocks context; `values()` maps names to widgets."""

    def __init__(self, hardware: Hardware):
        most = hardware.cores
        w = self.widgets = {}
        w["trainer"] = gr.Radio([(t.label, key) for key, t in trainers.TRAINERS.items()], value=trainers.DEFAULT,
                                label="Trainer", info=trainer_info(trainers.DEFAULT), elem_id="trainer")
        with gr.Row():
            # the models in this machine's Hugging Face cache come when the list gets focus (train_tab)
            w["model"] = gr.Dropdown(list(sources.BUILTIN_MODELS), value=BUILTIN_MODEL,
                                     allow_custom_value=True, label="Model", info="built-in tiny model, one "
                                     "in your Hugging Face cache, a Hub id (Qwen/Qwen3-0.6B) or a local folder",
                                     elem_id="model")
            w["dataset"] = gr.Dropdown(list(BUILTIN_DATASETS), value="builtin:qa", allow_custom_value=True,
                                       label="Dataset", info="built-in sample, a local JSONL/JSON/CSV/Parquet "
                                       "file, or a Hub id", elem_id="dataset")
        with gr.Accordion("Dataset: upload, Hub options, preview, column mapping", open=False,
                          elem_id="dataset-box") as self.dataset_box:
            self.upload = gr.File(label="Upload a dataset file", file_types=[".jsonl", ".json", ".csv", ".parquet"],
                                  elem_id="upload")
            with gr.Row():
                w["dataset_config"] = gr.Textbox(label="Config (Hub datasets)", placeholder="default")
                w["dataset_split"] = gr.Textbox("train", label="Split")
            self.check_button = gr.Button("Check dataset against the trainer", elem_id="check-dataset")
            self.data_report = gr.Markdown("", elem_id="data-report")
            self.preview = gr.Dataframe(label="First rows", interactive=False, visible=False, wrap=True,
                                        elem_id="data-preview")
            # vision data in a local file: its first rows' images, each captioned with its row (train_tab)
            self.images = gr.Gallery(label="First rows' images", columns=6, height=150, object_fit="contain",
                                     format="png", interactive=False, visible=False, elem_id="data-images")
            with gr.Row():
                with gr.Column():
                    gr.Markdown("Column map: YAML `old: new`, e.g. `question: prompt`", elem_classes="field-help")
                    w["column_map"] = gr.Code("", language="yaml", lines=2, elem_id="column_map",
                                              label="Column map (YAML)")
                w["keep_columns"] = gr.Textbox(label="Keep only these columns (comma-separated; empty: all)",
                                               elem_id="keep_columns")
            self.fix_button = gr.Button("Apply the suggested fix", visible=False, elem_id="apply-fix")
            with gr.Row():  # studio_core.recipe.eval_data: the evaluation set, plotted during training
                w["eval_fraction"] = number_box(0, label=NUMBER_LABELS["eval_fraction"],
                                                info="e.g. 0.1: a tenth of the rows, the same ones for the same seed; "
                                                "0: none", elem_id="eval_fraction")
                w["eval_dataset"] = gr.Textbox(label="Or evaluate on a separate dataset", placeholder="a file or Hub id",
                                               info="its loss is plotted beside the training loss",
                                               elem_id="eval_dataset")
                # studio_core.data.image_size: one image token count (one compile) for a vision-language model
                w["image_size"] = number_box(0, label=NUMBER_LABELS["image_size"], elem_id="image_size",
                                             info="vision-language models: every image made this square, so each "
                                             "has the same token count; 0: the processor's own size")
        with gr.Row():
            w["max_steps"] = number_box(300, label="max_steps", info="0: train by epochs",
                                        elem_id="max_steps")
            w["num_train_epochs"] = number_box(3, label="num_train_epochs", info="used when max_steps is 0")
            w["learning_rate"] = number_box(learning_rate_start(trainers.DEFAULT, BUILTIN_MODEL), label="learning_rate",
                                            info=learning_rate_info(trainers.DEFAULT, BUILTIN_MODEL),
                                            elem_id="learning_rate")
        with gr.Row():
            w["per_device_train_batch_size"] = number_box(4, label="per_device_train_batch_size",
                                                          elem_id="batch_size")
            w["max_length"] = number_box(128, label="max_length", elem_id="max_length",
                                         info="tokens (not for the trainers that generate); 0: no truncation")
            w["logging_steps"] = number_box(10, label="logging_steps", elem_id="logging_steps")
        self.trainer_groups = {}  # trainer -> the group of its own settings, shown for it alone
        self.reward_checks = {}  # trainer -> (its "Check reward functions" button, the report)
        for key, entry in trainers.TRAINERS.items():
            if entry.fields:
                with gr.Group(visible=key == trainers.DEFAULT) as self.trainer_groups[key]:
                    with gr.Row():
                        for field in (f for f in entry.fields if f.kind != "rewards"):
                            w[f"{key}.{field.name}"] = field_widget(key, field)
                    for field in (f for f in entry.fields if f.kind == "rewards"):
                        w[f"{key}.{field.name}"] = field_widget(key, field)
                        self.reward_checks[key] = (
                            gr.Button("Check reward functions (runs your reward files on the first rows)",
                                      size="sm", elem_id=f"{key}-check-rewards"),
                            gr.Markdown("", elem_id=f"{key}-rewards-report"))
        w["run_name"] = gr.Textbox(label="Run name", placeholder="e.g. tiny-sft", elem_id="run_name")
        with gr.Accordion("Layout: processes, parallelism, cores", open=False,
                          elem_id="layout-box") as self.layout_box:
            with gr.Row():
                w["nproc"] = number_box(1, label=NUMBER_LABELS["nproc"],
                                        info=f"one per core; up to {most} here", elem_id="nproc")
                w["tp_size"] = number_box(1, label=NUMBER_LABELS["tp_size"], elem_id="tp_size",
                                          info="tensor parallel (Neuron/CUDA)")
                w["fsdp_size"] = number_box(1, label=NUMBER_LABELS["fsdp_size"],
                                            elem_id="fsdp_size", info="TP x FSDP = processes")
            with gr.Row():
                w["cores"] = gr.Textbox(label=LAYOUT_LABELS["cores"], placeholder="next free", elem_id="cores",
                                        info="e.g. 0-3 or 0,1; empty: the first free valid block")
                w["queue_if_busy"] = gr.Checkbox(True, label="Queue it if its cores are busy", elem_id="queue_if_busy",
                                                 info="it starts when they are free, in its turn; off: Start refuses")
                w["target"] = gr.Dropdown([THIS_MACHINE, *INSTANCES], value=THIS_MACHINE,
                                          label=TARGET_LABELS["instance"],
                                          info="another instance type: preview and export only",
                                          elem_id="target")
                w["lnc"] = gr.Dropdown(sorted(LNC_VALUES, reverse=True), value=Target.lnc, label=TARGET_LABELS["lnc"],
                                       elem_id="lnc")
            with gr.Row():  # studio_core/training/precompile.py
                w["precompile"] = gr.Checkbox(False, label="Precompile: compile the run's batch shapes before step 1, "
                                              "in parallel", elem_id="precompile",
                                              info="needs torch_compile (on by default on Neuron); one-process local "
                                              "runs; the run then finds its graphs in the compile cache")
                w["precompile_jobs"] = number_box(0, label=NUMBER_LABELS["precompile_jobs"],
                                                  info="parallel compile processes, each on a free core; 0: one per "
                                                  "core, at most 8 (on Neuron also within the host's vCPUs and "
                                                  "memory)", elem_id="precompile_jobs")
            elsewhere = backends.with_options()
            w["run_on"] = gr.Radio([(backend.label, name) for name, backend in BACKENDS.items()], value=DEFAULT,
                                   label="Run on", elem_id="run_on",
                                   info="; ".join(f"{backend.label}: the studio submits the run to "
                                                  f"{backend.description} (start it where it can submit)"
                                                  for backend in elsewhere)
                                   + "; Processes is then per node, and Plan for is the nodes' type")
            # one Nodes for every engine that runs on several machines, shown when the run goes to one
            with gr.Row(visible=False, elem_id="nodes-box") as self.nodes_box:
                w["nodes"] = number_box(1, label=NUMBER_LABELS["nodes"], elem_id="nodes",
                                        info="each runs the processes above; HSDP replicates across nodes")
            self.option_boxes = {}  # backend -> the box of its options, shown when the run goes there
            for backend in elsewhere:
                # a Column, not a Group: Gradio 6 gives a Group's elem_id to two nested elements (two #slurm-box)
                with gr.Column(visible=False, elem_id=f"{backend.name}-box", variant="panel") as box:
                    w.update(option_fields.widgets(backend.options_type))
                self.option_boxes[backend.name] = box
            self.core_map = gr.HTML("", elem_id="core-map")
        with gr.Accordion("LoRA", open=False):
            w["use_peft"] = gr.Checkbox(False, label="Train a LoRA adapter instead of the full model",
                                        elem_id="use_peft")
            with gr.Row():
                w["lora_r"] = number_box(16, label="lora_r")
                w["lora_alpha"] = number_box(32, label="lora_alpha")  # a float too, as PEFT takes it
                w["lora_dropout"] = number_box(0.05, label="lora_dropout")
                w["lora_target_modules"] = gr.Textbox("all-linear", label="lora_target_modules",
                                                      info="all-linear, or names: q_proj, v_proj")
        with gr.Accordion("Advanced", open=False, elem_id="advanced-box") as self.advanced_box:
            with gr.Row():
                w["gradient_accumulation_steps"] = number_box(1, label="gradient_accumulation_steps")
                w["warmup_steps"] = number_box(0, label="warmup_steps")
                w["lr_scheduler_type"] = gr.Dropdown(trainer_fields(trainers.DEFAULT)["lr_scheduler_type"]["choices"],
                                                     value="linear", label="lr_scheduler_type")
                w["seed"] = number_box(42, label="seed")
                w["save_steps"] = number_box(0, label="save_steps",
                                             info="a checkpoint every N steps; 0: only the final model")
            trackers = report_choices()
            w["report_to"] = gr.Dropdown(trackers, value="none", label="report_to (experiment tracking)",
                                         info=report_info(trackers), elem_id="report_to")
            w["trust_remote_code"] = gr.Checkbox(False, label="trust_remote_code: run the model's own Python "
                                                 "code (only for authors you trust)")
            w["extra"] = gr.Code(label="Other TRL settings (YAML, TRL's names), e.g. `save_steps: 100`",
                                 language="yaml", lines=3, value="", elem_id="extra")
            self.extra_check = gr.Markdown("", elem_id="extra-check")

    def components(self) -> set:
        return set(self.widgets.values())

    def named(self, values: dict) -> dict:
        """Gradio's {component: value} -> {name: value}."""
        return {name: values[widget] for name, widget in self.widgets.items() if widget in values}


def _yaml(text: str, what: str, kind: type):
    try:
        value = yaml.safe_load(text or "")
    except yaml.YAMLError as error:
        raise SpecError([f"{what}: not valid YAML ({error})"]) from error
    value = kind() if value is None else value
    if not isinstance(value, kind):
        raise SpecError([f"{what}: write a YAML {'mapping' if kind is dict else 'list'}"])
    return value


def check_extra(trainer: str, text: str) -> str:
    """The live verdict under the 'Other TRL settings' box."""
    try:
        problems = check_args(trainer, _yaml(text, "Other TRL settings", dict))
    except SpecError as error:
        problems = error.problems
    if problems:
        return "\n".join(f"- {p}" for p in problems)
    return "TRL settings recognised." if (text or "").strip() else ""


def _whole_if_whole(number: float) -> int | float:
    """A number as the recipe writes it: 32 (not 32.0), or 16.5."""
    return int(number) if number.is_integer() else number


def spec_from_form(v: dict, complete: bool = True) -> RunSpec:
    """Widget values (by name) -> RunSpec. Raises SpecError for values that are not even well-formed
    (a number box holding no number among them, each said with what was typed) and, with `complete`,
    for a setting the run's place cannot do without left empty (a Ray run's address: the core map
    is drawn before it is typed)."""
    trainer, number = v["trainer"], FormNumbers(v)
    # TRL takes a float below 1 for these step counts: a fraction of the run's steps
    save_steps, logging_steps, warmup_steps = (_whole_if_whole(number(name, blank=blank)) for name, blank in
                                               (("save_steps", 0.0), ("logging_steps", 1.0), ("warmup_steps", 0.0)))
    args = {
        "max_steps": number("max_steps", whole=True, blank=0) or -1,  # the form's 0: TRL's -1, train by epochs
        "num_train_epochs": number("num_train_epochs", blank=0.0),
        "learning_rate": number("learning_rate"),
        "per_device_train_batch_size": number("per_device_train_batch_size", whole=True),
        "logging_steps": logging_steps,
        "gradient_accumulation_steps": number("gradient_accumulation_steps", whole=True, blank=1),
        "warmup_steps": warmup_steps,
        "lr_scheduler_type": v["lr_scheduler_type"],
        "seed": number("seed", whole=True, blank=0),
        **({"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}),
    }
    entry, rewards = trainers.get(trainer), []
    if entry.uses_max_length:
        args["max_length"] = number("max_length", whole=True, blank=0) or None
    for field in entry.fields:
        value = v[f"{trainer}.{field.name}"]
        if field.kind == "rewards":
            rewards = _yaml(value, "Reward functions", list)
        elif field.kind in ("int", "float"):
            args[field.name] = number(f"{trainer}.{field.name}", whole=field.kind == "int", blank=0,
                                      label=field.name)
        else:
            args[field.name] = [value] if field.as_list else value
    if v["use_peft"]:
        targets = [t.strip() for t in (v["lora_target_modules"] or "").split(",") if t.strip()]
        args |= {"use_peft": True, "lora_r": number("lora_r", whole=True, blank=0),
                 "lora_alpha": _whole_if_whole(number("lora_alpha", blank=0.0)),
                 "lora_dropout": number("lora_dropout", blank=0.0), "lora_target_modules": targets or None}
    if v["trust_remote_code"]:
        args["trust_remote_code"] = True
    if v.get("report_to") not in (None, "none"):
        args["report_to"] = v["report_to"]
    extra = _yaml(v["extra"], "Other TRL settings", dict)
    args |= extra
    keep = [c.strip() for c in (v["keep_columns"] or "").split(",") if c.strip()]
    backend = run_backend(v)
    here = backend.local_cores  # a run on this machine's cores, else on nodes of its own
    layout = Layout(nproc=number("nproc", whole=True, blank=1), tp_size=number("tp_size", whole=True, blank=1),
                    fsdp_size=number("fsdp_size", whole=True, blank=1), run_on=backend.name,
                    cores=(v["cores"] or "").strip() or None if here else None,
                    nodes=1 if here else number("nodes", whole=True, blank=1),
                    options=option_fields.read(v, backend, complete) if backend.options_type else None)
    eval_fraction, jobs = number("eval_fraction", blank=0.0), number("precompile_jobs", whole=True, blank=0)
    image_size = number("image_size", whole=True, blank=0)
    number.check(overridden=extra)
    return RunSpec(trainer=trainer, model_name_or_path=(v["model"] or "").strip(),
                   dataset_name=(v["dataset"] or "").strip(),
                   dataset_config=(v["dataset_config"] or "").strip() or None,
                   dataset_train_split=(v["dataset_split"] or "").strip() or "train",
                   run_name=(v["run_name"] or "").strip() or None, args=args, layout=layout,
                   column_map=_yaml(v["column_map"], "Column map", dict), keep_columns=keep or None, rewards=rewards,
                   eval_fraction=eval_fraction or None, eval_dataset=(v.get("eval_dataset") or "").strip() or None,
                   precompile=bool(v.get("precompile")), precompile_jobs=jobs or None, image_size=image_size or None)


def export_spec(v: dict) -> RunSpec:
    """The spec of the batch script Export writes (backends.EXPORT), whatever Run on says: the
    form's own Nodes and the cluster's settings, as if the run went there."""
    return spec_from_form(v | {"run_on": backends.EXPORT.name})


def run_backend(v: dict):
    """The run backend the form sends the run to (its Run on)."""
    return BACKENDS.get(v.get("run_on") or DEFAULT, BACKENDS[DEFAULT])


def target_hardware(v: dict, detected: Hardware) -> Hardware:
    """The hardware the form plans for: this machine (`detected` itself), or a known instance type."""
    target = Target(None if v["target"] in (None, THIS_MACHINE) else v["target"], int(v["lnc"] or Target.lnc))
    try:
        return target.hardware(lambda: detected)
    except ValueError as error:
        raise SpecError([f"{TARGET_LABELS['instance']}: {error}"]) from error


def form_values(spec: RunSpec, trackers: list[str] | None = None) -> dict:
    """The inverse of spec_from_form: widget values (by name) that make this spec again.

    Settings with a widget go into it; every other TRL setting, and any value a widget cannot
    hold exactly (`save_strategy: epoch`, a learning rate that is not a number), goes into
    "Other TRL settings" as YAML, which spec_from_form applies last. Settings the spec leaves
    out take TRL's defaults, so `spec_from_form(form_values(spec))` is the same run, with
    TRL's defaults written out for the widgets' settings. Only the widgets this trainer uses are given (the other
    trainers' and, without use_peft, the LoRA widgets keep what they hold). The form cannot
    hold: reward functions for a trainer that takes none, a column name with a comma in
    keep_columns, an empty dataset_train_split (the form's default is "train").
    `trackers`: the report_to choices offered (default: what is installed here)."""
    fields, args = trainer_fields(spec.trainer), spec.args
    trackers = report_choices() if trackers is None else trackers
    schedulers = trainer_fields(trainers.DEFAULT)["lr_scheduler_type"]["choices"]

    def get(key):
        return args.get(key, fields[key]["default"] if key in fields else None)

    def num(key):
        value = get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def choice(key, choices, fallback):
        value = get(key)
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        return value if isinstance(value, str) and value in choices else fallback

    v = {"trainer": spec.trainer, "model": spec.model_name_or_path, "dataset": spec.dataset_name,
         "dataset_config": spec.dataset_config or "", "dataset_split": spec.dataset_train_split,
         "run_name": spec.run_name or "",
         "column_map": yaml.safe_dump(spec.column_map, sort_keys=False) if spec.column_map else "",
         "keep_columns": ", ".join(map(str, spec.keep_columns or [])),
         "eval_fraction": spec.eval_fraction or 0, "eval_dataset": spec.eval_dataset or "",
         "precompile": spec.precompile is True, "precompile_jobs": spec.precompile_jobs or 0,
         "image_size": spec.image_size or 0,
         "nproc": spec.layout.nproc, "tp_size": spec.layout.tp_size, "fsdp_size": spec.layout.fsdp_size,
         "cores": spec.layout.cores or "", "run_on": spec.layout.run_on, "nodes": spec.layout.nodes,
         "max_steps": max(num("max_steps") or 0, 0), "num_train_epochs": num("num_train_epochs"),
         "learning_rate": num("learning_rate"), "per_device_train_batch_size": num("per_device_train_batch_size"),
         "logging_steps": num("logging_steps"), "gradient_accumulation_steps": num("gradient_accumulation_steps"),
         "warmup_steps": num("warmup_steps"), "seed": num("seed"),
         "lr_scheduler_type": choice("lr_scheduler_type", schedulers, "linear"),
         "save_steps": 0 if get("save_strategy") == "no" else num("save_steps"),
         "use_peft": get("use_peft") is True, "trust_remote_code": get("trust_remote_code") is True,
         "report_to": choice("report_to", trackers, "none")}
    for backend in BACKENDS.values():  # each place's options: the run's own, the others' empty
        if backend.options_type is not None:
            v |= option_fields.shown(backend.options(spec.layout), backend.options_type)
    entry = spec.trainer_entry
    if entry.uses_max_length:
        v["max_length"] = 0 if get("max_length") is None else num("max_length")
    for field in entry.fields:
        name = f"{spec.trainer}.{field.name}"
        if field.kind == "rewards":
            v[name] = yaml.safe_dump(spec.rewards, sort_keys=False, default_flow_style=None) if spec.rewards else ""
        elif field.kind in ("int", "float"):
            v[name] = num(field.name)
        else:
            v[name] = choice(field.name, field_choices(spec.trainer, field), field.start)
    if v["use_peft"]:
        targets = get("lora_target_modules")
        v |= {"lora_r": num("lora_r"), "lora_alpha": num("lora_alpha"), "lora_dropout": num("lora_dropout"),
              "lora_target_modules": ", ".join(targets) if isinstance(targets, list) else str(targets or "")}
    # What the widgets alone make; the rest (and what they make differently) goes to "extra",
    # also values equal to TRL's default: the planner would replace a missing one with its own.
    made = spec_from_form(v | {"extra": ""}).args
    extra = {key: value for key, value in args.items() if key not in made or made[key] != value}
    extra |= {key: fields[key]["default"] for key in made.keys() - args.keys()
              if key in fields and made[key] != fields[key]["default"]}
    v["extra"] = yaml.safe_dump(extra, sort_keys=False) if extra else ""
    return v
