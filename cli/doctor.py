"""doctor: check this machine for the studio, one line per check; exit 0 only when all pass."""

from __future__ import annotations

from cli.options import runs_folder
from studio_core import doctor


def cmd_doctor(args) -> int:
    runs_dir = runs_folder(args)  # its "runs folder" check says whether runs can be written there
    print("Checking this machine for the studio (the device checks take a minute on CPU, more on Neuron):\n",
          flush=True)
    results = []
    for check in doctor.checks(runs_dir):
        results.append(check)
        print(check.line(), flush=True)
    print("\n" + doctor.verdict(results))
    return 0 if all(c.ok for c in results) else 1
