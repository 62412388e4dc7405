"""What the recipe and hardware options of train, plan and chat stand for: a spec and a Hardware."""

from __future__ import annotations

from studio_core.hardware import cpu_hardware, detect_hardware, instance_hardware
from studio_core.spec import RunSpec, SpecError


def hardware_for(args):
    if getattr(args, "instance", None):
        try:
            return instance_hardware(args.instance, lnc=args.lnc)
        except ValueError as error:
            raise SpecError([f"--instance/--lnc: {error}"]) from error
    if getattr(args, "backend", None) == "cpu":
        return cpu_hardware()
    return detect_hardware()


def load_spec(args) -> RunSpec:
    layout = [f"studio.{key}={value}" for key in ("nproc", "tp_size", "fsdp_size", "cores")
              if (value := getattr(args, key)) is not None]
    if args.cores is not None:
        layout[-1] = f"studio.cores='{args.cores}'"  # a core set is text, even "3"
    spec = RunSpec.load(args.recipe).with_overrides([*args.set, *layout])  # checked once, by plan or start
    slurm = {key: value for key, value in (("partition", args.partition), ("time", args.time),
                                           ("account", args.account)) if value is not None}
    slurm |= {"sbatch_args": args.sbatch_arg} if args.sbatch_arg else {}
    slurm |= {"auto_resume": True} if args.auto_resume else {}
    if args.slurm or spec.layout.run_on == "slurm":  # the flag, or a recipe written for Slurm
        spec.layout.run_on = "slurm"
        spec.layout.slurm = {**spec.layout.slurm, **slurm}
        spec.layout.nodes = args.nodes if args.nodes is not None else spec.layout.nodes
    else:
        given = [{"sbatch_args": "--sbatch-arg"}.get(key, f"--{key.replace('_', '-')}") for key in slurm]
        given += ["--nodes"] if args.nodes is not None and not getattr(args, "slurm_script", None) else []
        if given:
            raise SpecError([f"{', '.join(given)}: these are for a run on Slurm: add --slurm"])
    return spec
