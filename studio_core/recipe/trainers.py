"""The trainers the studio offers: one entry per TRL trainer, and everything that differs
between them. Every other module reads this one; none names a trainer of its own.

An entry says which TRL classes train it, how the page labels it, which built-in sample it
starts on, which of TRL's dataset types it trains on (studio_core.recipe.data_check detects them),
the columns to look for when a dataset names them otherwise, its own form fields, whether it
takes reward functions, generates while it trains, keeps a reference model, reads
max_length, gets a shape forecast, what its saved model is, and the settings the planner
applies for it, with their reasons.

Adding a trainer is its entry here, a recipe in recipes/, a built-in sample in
studio_core/data/samples/ (named in data/builtin.py) and its tests.

No import of TRL here: the web app reads this module, and importing TRL costs seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Default:
    """A setting the studio applies unless the recipe sets it; `force` applies it anyway (the
    recipe's value cannot run here). `when`: applied only if it holds for the run's settings."""

    key: str
    value: object
    reason: str
    force: bool = False
    when: Callable[[dict], bool] | None = None


@dataclass(frozen=True)
class FormField:
    """A setting of the trainer's own that the Train form shows (TRL's name). `kind`: int,
    float, choice (`choices`, else those of TRL's field or its help text), or rewards (the
    reward functions, a YAML list: the spec's studio.rewards, not a TRL setting). `as_list`:
    TRL takes a list (DPO's loss_type); the form holds one value."""

    name: str
    kind: str
    start: object
    info: str = ""
    as_list: bool = False
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Role:
    """A column the trainer reads, to find by its usual names when the dataset names it otherwise
    (data_check.suggest_column_map); `also`: more names for it with this trainer."""

    column: str
    required: bool = True
    also: tuple[str, ...] = ()


@dataclass(frozen=True)
class Trainer:
    key: str  # studio.trainer
    name: str  # how people write it: SFT, DPO, ...
    label: str  # the Train form's choice
    help: str  # what it trains, on what
    config_class: str  # TRL's config dataclass (its fields are the recipe's settings)
    trainer_class: str
    sample: str  # the built-in dataset it starts on
    data_types: tuple[str, ...]  # TRL dataset types it trains on (data_check.TYPE_COLUMNS)
    data_help: str  # the columns it needs, in words
    roles: tuple[Role, ...]  # the columns suggest_column_map looks for
    fields: tuple[FormField, ...] = ()
    rewards: bool = False  # takes reward functions; every other dataset column goes to them
    generates: bool = False  # generates completions as it trains (the Neuron generation defaults)
    reference_model: bool = False  # keeps a frozen copy of the model to compare with
    sequences_per_example: int = 1  # what one example puts through the model in a step (memory.py)
    uses_max_length: bool = True  # truncates samples at max_length
    not_forecast: str = ""  # why the shape forecast does not apply, when it does not
    task: str = "text-generation"  # what the saved model does: text-generation (chat) or text-classification
    # its collator of vision-language data pads to pad_to_multiple_of (TRL 1.16's DPO and KTO ones raise
    # NotImplementedError at the first batch when it is set: trl/trainer/dpo_trainer.py, kto_trainer.py)
    vision_pads: bool = True
    defaults: tuple[Default, ...] = ()  # applied on every backend
    neuron_defaults: tuple[Default, ...] = ()
    # The run page's plots of the trainer's own metrics, beside loss and learning rate: (title,
    # names as TRL logs them, fnmatch patterns). A plot with nothing logged is not shown.
    plots: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def forecast(self) -> bool:
        """The shape forecast walks this trainer's batches (studio_core.training.forecast)."""
        return not self.not_forecast

    @property
    def chats(self) -> bool:
        """The saved model answers prompts (a reward model scores texts instead)."""
        return self.task == "text-generation"


REWARD_LIST_HELP = ("Reward functions (YAML list): built-ins length {target}, regex {pattern}, exact_match "
                    "{column}; or {file: my_rewards.py, function: name}; each with a weight. Your own file is "
                    "Python code that runs with your rights, on Check reward functions and on Start (Preview "
                    "only reads it), as trust_remote_code runs a model's code: use files you trust")
DEFAULT_REWARDS = "- {name: length, target: 40, weight: 1.0}\n- {name: exact_match, column: reference, weight: 1.0}\n"

# Online RL generates on the training device; on Neuron every new shape compiles for minutes.
GENERATION_NEURON_DEFAULTS = (
    Default("cache_implementation", "static", "with the dynamic cache every generated token is a new shape, "
            "and a step takes minutes of compiling"),
    Default("use_vllm", False, "vLLM does not run on Neuron: the trainer generates with Transformers", force=True),
)


GENERATES = "its shapes come from what the model generates"
PREFERENCE_REWARDS = ("Rewards (chosen, rejected, margin)", ("rewards/chosen", "rewards/rejected", "rewards/margins"))
# TRL logs `kl` only with a KL term (beta > 0; GRPO's default beta is 0)
ONLINE_PLOTS = (("Rewards (total and per function)", ("reward", "rewards/*/mean")), ("KL to the reference", ("kl",)),
                ("Completion length (tokens)", ("completions/mean_length",)))


PREFERENCE_HELP = "`prompt`+`chosen`+`rejected` (or `chosen`+`rejected` holding the prompt)"
# What the online RL trainers (GRPO, RLOO) share: they differ in how they weigh the rewards.
ONLINE_RL = dict(
    sample="builtin:prompts", data_types=("prompt_only", "prompt_completion"),
    data_help="`prompt` (other columns go to the reward functions)", roles=(Role("prompt"),),
    fields=(FormField("num_generations", "int", 4, "completions per prompt"),
            FormField("max_completion_length", "int", 16, "tokens per completion"),
            FormField("temperature", "float", 1.0, "sampling temperature of the completions"),
            FormField("rewards", "rewards", DEFAULT_REWARDS, REWARD_LIST_HELP)),
    rewards=True, generates=True, uses_max_length=False, not_forecast=GENERATES,
    neuron_defaults=GENERATION_NEURON_DEFAULTS, plots=ONLINE_PLOTS)


TRAINERS: dict[str, Trainer] = {t.key: t for t in (
    Trainer(
        key="sft", name="SFT", label="SFT (supervised fine-tuning)",
        help="learns to write the dataset's answers or conversations",
        config_class="SFTConfig", trainer_class="SFTTrainer", sample="builtin:qa",
        data_types=("language_modeling", "prompt_completion"),
        data_help="`messages`, `text` (or the column dataset_text_field names), or `prompt`+`completion`",
        roles=(Role("prompt"), Role("completion", also=("chosen",))),
        # The other trainers leave it off on Neuron: the sources (TRL's Trainium guide, the
        # TorchNeuron announcement) compile SFT only, and GRPO/RLOO rely on generate()'s own
        # static-cache compile path. A recipe may still turn it on; the plan warns then.
        neuron_defaults=(Default("torch_compile", True, "compiled steps run faster than eager (Qwen3-0.6B, one "
                                 "core: 1.15 s vs 1.71 s per step); the backend becomes \"neuron\" by itself"),),
        plots=(("Token accuracy", ("mean_token_accuracy",)),)),
    Trainer(
        key="dpo", name="DPO", label="DPO (preference pairs)",
        help="learns to prefer the chosen answer to the rejected one",
        config_class="DPOConfig", trainer_class="DPOTrainer", sample="builtin:preference",
        data_types=("preference", "preference_implicit"), data_help=PREFERENCE_HELP,
        roles=(Role("chosen"), Role("rejected"), Role("prompt", required=False)),
        fields=(FormField("beta", "float", 0.1, "how far from the reference model"),
                FormField("loss_type", "choice", "sigmoid", "DPO loss", as_list=True)),
        reference_model=True, sequences_per_example=2,  # the chosen and the rejected answer
        vision_pads=False,
        plots=(PREFERENCE_REWARDS, ("Reward accuracy (chosen above rejected)", ("rewards/accuracies",)))),
    Trainer(
        key="kto", name="KTO", label="KTO (answers marked good or bad)",
        help="learns from single answers labelled desirable or not; no pairs needed",
        config_class="KTOConfig", trainer_class="KTOTrainer", sample="builtin:feedback",
        data_types=("unpaired_preference", "preference", "preference_implicit"),
        data_help="`prompt`+`completion`+`label` (true for a desirable answer), or preference pairs, which it unpairs",
        roles=(Role("prompt"), Role("completion"), Role("label", also=("desirable", "good", "thumbs_up"))),
        fields=(FormField("beta", "float", 0.1, "how far from the reference model"),
                FormField("loss_type", "choice", "kto", "KTO loss",
                          choices=("kto", "apo_zero_unpaired")),  # from KTOConfig's docstring
                FormField("desirable_weight", "float", 1.0, "weight of the desirable answers' loss"),
                FormField("undesirable_weight", "float", 1.0, "weight of the undesirable answers' loss")),
        reference_model=True, sequences_per_example=2,  # the answer, and a mismatched pair for the KL term
        vision_pads=False,
        plots=(PREFERENCE_REWARDS, ("KL to the reference", ("kl",))),
        not_forecast="its KL term sends a second batch, of other shapes, through the model at each step, and the "
                     "forecast walks one per step"),
    Trainer(
        key="grpo", name="GRPO", label="GRPO (online RL with reward functions)",
        help="generates answers and learns from their rewards, compared within each group",
        config_class="GRPOConfig", trainer_class="GRPOTrainer", **ONLINE_RL),
    Trainer(
        key="rloo", name="RLOO", label="RLOO (online RL, leave-one-out baseline)",
        help="generates answers and learns from their rewards against the others' mean",
        config_class="RLOOConfig", trainer_class="RLOOTrainer", **ONLINE_RL),
    Trainer(
        key="reward", name="reward modeling", label="Reward model (scores answers)",
        help="learns a score that ranks the chosen answer above the rejected one; the model it saves scores "
             "texts and does not chat",
        config_class="RewardConfig", trainer_class="RewardTrainer", sample="builtin:preference",
        data_types=("preference", "preference_implicit"), data_help=PREFERENCE_HELP,
        roles=(Role("chosen"), Role("rejected"), Role("prompt", required=False)),
        task="text-classification", sequences_per_example=2,  # the chosen and the rejected answer
        plots=(("Accuracy (chosen scored above rejected)", ("accuracy",)), ("Score margin", ("margin",))),
        defaults=(Default("lora_task_type", "SEQ_CLS", "a reward model is a sequence classifier: PEFT then trains "
                          "and saves its score head with the adapter", when=lambda args: args.get("use_peft")),)),
)}


DEFAULT = "sft"  # the trainer a new form or a recipe without studio.trainer starts with


def get(key: str) -> Trainer:
    """The trainer called `key`; KeyError saying which there are."""
    try:
        return TRAINERS[key]
    except (KeyError, TypeError):
        raise KeyError(f"studio.trainer: {key!r} is not available; choose {', '.join(TRAINERS)}") from None


def config_classes() -> dict[str, str]:
    """{trainer: its TRL config class}."""
    return {key: t.config_class for key, t in TRAINERS.items()}


def taking(data_type: str) -> list[Trainer]:
    """The trainers that train on this TRL dataset type."""
    return [t for t in TRAINERS.values() if data_type in t.data_types]
