"""doctor: check this machine for the studio, one line per check; exit 0 only when all pass.
With --smoke: the first-run kit (studio_core/doctor/smoke.py), the studio's own jobs end to end and
one report file to attach to a bug report; exit 0 only when every step passed."""

from __future__ import annotations

import sys

from cli.options import runs_folder
from studio_core.doctor import doctor, smoke


def cmd_doctor(args) -> int:
    if args.smoke:
        return cmd_smoke(args)
    runs_dir = runs_folder(args)  # its "runs folder" check says whether runs can be written there
    print("Checking this machine for the studio (the device checks take a minute on CPU, more on Neuron):\n",
          flush=True)
    results = []
    for check in doctor.checks(runs_dir):
        results.append(check)
        print(check.line(), flush=True)
    print("\n" + doctor.verdict(results))
    return 0 if all(c.ok for c in results) else 1


def cmd_smoke(args) -> int:
    runs_dir = runs_folder(args, write=True)  # the smoke's runs and report go under it
    print("Smoke test: the studio's own jobs on this machine's device, with the built-in tiny model (a few minutes "
          "on CPU, longer on Neuron, where each new shape compiles). Ctrl-C stops it.\n", flush=True)
    test = smoke.Smoke(runs_dir)
    steps = []
    try:
        for step in test.run():
            steps += [step] if step.ok is not None else []
            print(step.line(), flush=True)
    except KeyboardInterrupt:
        print("\nStopped; the steps so far are in the report.", flush=True)
    except smoke.SmokeFolderError as error:  # before any step
        print(f"Smoke test not started: {error}", file=sys.stderr)
        return 2
    print(f"\n{smoke.verdict(steps)}")
    if steps and steps[0].details.get("held_at_start") and not all(s.ok for s in steps):
        print("Cores were held by other runs, chats or evaluations when it started: run it again when the "
              "machine is idle.")
    if test.report_path is not None:
        print(f"Report (attach it to a bug report): {test.report_path}\n"
              f"Readable copy: {test.report_path.with_suffix('.md')}")
    return 0 if len(steps) == len(smoke.STEPS) and all(s.ok for s in steps) else 1
