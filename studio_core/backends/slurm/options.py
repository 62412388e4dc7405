"""What a user chooses for a Slurm run: the job's sbatch settings, the recipe's `studio.slurm`
block. Each field's metadata (backends.base.option) is what the command line makes its flag
from and the form its widget; `check` is the one rule for the values (tools.check_options),
said under the recipe's keys or under the flag's or widget's name."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from studio_core.backends.base import option, options_from_dict
from studio_core.backends.slurm import tools

KEY = "studio.slurm"  # the recipe key the options are read from


def partition_choices() -> tuple[list[str], str]:
    """The cluster's partitions (from sinfo), and a line saying their nodes and which is the default."""
    try:
        found = tools.partitions()
    except tools.SlurmError as error:
        return [], f"no Slurm here: {error}"
    default = next((p.name for p in found.values() if p.default), None)
    return list(found), ", ".join(f"{p.name}: {p.nodes} node(s)" + (" (default)" if p.name == default else "")
                                  for p in found.values())


@dataclass
class SlurmOptions:
    partition: str | None = option(None, label="Partition", flag="--partition", choices=partition_choices,
                                   help="the partition (default: the cluster's default)",
                                   recipe="the partition (default: the cluster's default)")
    time: str | None = option(None, label="Time limit", flag="--time", placeholder="partition default",
                              help="the job's time limit, as sbatch reads it: 90 (minutes), 1:30:00, 2-00:00:00",
                              recipe="the time limit")
    account: str | None = option(None, label="Account", flag="--account", placeholder="your default",
                                 help="the account charged for the job", recipe="the account charged")
    sbatch_args: list = option([], label="Other sbatch options", flag="--sbatch-arg", kind="list",
                               placeholder="e.g. --qos=high --gres=neuron:16",
                               help="other sbatch options, e.g. --qos=high; the studio sets --output, --nodes, "
                               "--job-name and the like itself", recipe="a list of other sbatch options")
    auto_resume: bool = option(False, label="HyperPod auto-resume (srun --auto-resume=1)", flag="--auto-resume",
                               kind="bool", offered=tools.auto_resume_supported,
                               help="SageMaker HyperPod: srun --auto-resume=1 (offered when this cluster's srun "
                               "has it)", recipe="true: HyperPod's srun --auto-resume=1")

    @classmethod
    def from_dict(cls, data) -> tuple:
        """The options of a recipe's block, and what the dataclass cannot hold."""
        return options_from_dict(cls, KEY, data)

    def to_dict(self) -> dict:
        """The recipe's block: only the fields that say something (not their default), in field order."""
        return {f.name: list(value) if isinstance(value, list) else value for f in fields(self)
                if (value := getattr(self, f.name)) != _default(f)}

    def settled(self) -> SlurmOptions:
        """The options as they are kept once checked: each extra sbatch option one word, as sbatch
        gets it (the form's "--qos high" is kept as --qos=high)."""
        if not isinstance(self.sbatch_args, list):
            return self
        return replace(self, sbatch_args=tools.sbatch_words(self.sbatch_args)[0])

    def check(self, labels: dict | None = None) -> list[str]:
        """Every problem with the values, each under its label: `labels` maps a field to what the
        user typed it in (--time, Time limit); the recipe's key (studio.slurm.time) by default."""
        problems = tools.check_options(self.to_dict(), labels)  # under studio.slurm.KEY unless labelled
        if not isinstance(self.auto_resume, bool):
            problems.append(f"{(labels or {}).get('auto_resume', f'{KEY}.auto_resume')}: write true or false")
        return problems


def _default(f):
    return f.default_factory() if callable(f.default_factory) else f.default
