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
    return RunSpec.load(args.recipe).with_overrides([*args.set, *layout])  # checked once, by plan or start
