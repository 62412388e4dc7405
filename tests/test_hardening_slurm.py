"""Slurm values are refused, or written so that they cannot start a command (issue 29): the
one rule for them (studio_core.backends.slurm.tools.check_options) in the command line, the form and the
backend itself; the batch script's quoting, run by a real bash; `--sbatch-arg` as README writes
it; and which node of a failed job failed first, from the node supervisors' records."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from studio_core.backends.base import SubmitError
from studio_core.backends.slurm.backend import SlurmBackend, batch_script, sbatch_argv
from studio_core.backends.slurm.options import SlurmOptions
from studio_core.backends.nodes import first_failed_node
from studio_core.backends.slurm.records import NODES, SCRIPT, node_records, record_node
from studio_core.machine.hardware import cpu_hardware
from studio_core.training.plan import plan
from studio_core.backends.slurm.tools import check_options, sbatch_words
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validate

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "tiny-sft.yaml")
ATTACK = "x\ntouch /tmp/pwned"  # the issue's --account, which ran `touch` on the node


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def slurm_plan(tmp_path: Path, run_dir: Path | None = None, **options):
    spec = RunSpec.load(RECIPE).with_overrides(["studio.run_on=slurm", "studio.nodes=2"])
    spec.layout.options = SlurmOptions(**options)
    run_dir = run_dir or tmp_path / "runs" / "r1"
    return plan(spec, cpu_hardware(), run_dir=run_dir, run_id=run_dir.name, compile_cache=tmp_path / "cache")


@pytest.mark.parametrize("option,value,says", [
    ("--account", ATTACK, "a line break"),  # item 1: the attack
    ("--account", "x;touch y", "it holds ' ' and ';'"),  # item 3: it reached sbatch
    ("--partition", "trn\n#SBATCH --output=/x", "a line break"),
    ("--time", "90\ntouch /tmp/pwned", "a line break"),
    ("--time", "1:2:3:4", "hours:minutes:seconds"),
    ("--sbatch-arg", "--qos=high\ntouch /tmp/pwned", "a line break"),
    ("--sbatch-arg", "--comment=$(touch /tmp/pwned)", "its value holds '$'"),
])
def test_the_command_line_refuses_a_slurm_value_naming_the_option_and_what_to_change(option, value, says, tmp_path,
                                                                                     capsys):
    code, out, err = cli(capsys, "plan", RECIPE, "--slurm", f"{option}={value}", "--no-forecast", "--runs-dir",
                         str(tmp_path / "runs"))
    assert code == 2 and out == ""
    assert f"{option}: " in err and says in err, err
    assert "Traceback" not in err


def test_the_form_refuses_the_account_attack_under_its_widget_name():
    from app.train_form import form_values, spec_from_form

    spec = RunSpec.load(RECIPE).with_overrides(["studio.run_on=slurm", "studio.nodes=2"])
    values = form_values(spec, trackers=["none"]) | {"target": "this machine", "lnc": 2}
    with pytest.raises(SpecError) as refused:
        spec_from_form(values | {"account": ATTACK})
    assert "Account: 'x\\ntouch /tmp/pwned' is not a Slurm account name (it holds a line break)" in str(refused.value)
    with pytest.raises(SpecError, match="Other sbatch options: extra sbatch option '--out=/x': sbatch reads --out as "
                                        "--output"):
        spec_from_form(values | {"sbatch_args": "--out=/x"})
    # an option and its value as two words: one word for sbatch
    assert spec_from_form(values | {"sbatch_args": "--qos high --exclusive"}).layout.options.sbatch_args == [
        "--qos=high", "--exclusive"]


def test_a_recipe_with_the_attack_is_refused_by_the_spec_check():
    spec = RunSpec.load(RECIPE).with_overrides(["studio.run_on=slurm"])
    spec.layout.options = SlurmOptions(account=ATTACK, partition="trn;x")
    problems = " ".join(validate(spec))
    assert "studio.slurm.account: 'x\\ntouch /tmp/pwned' is not a Slurm account name" in problems
    assert "studio.slurm.partition: 'trn;x' is not a Slurm partition name (it holds ';')" in problems


@pytest.mark.parametrize("key,value", [("account", ATTACK), ("partition", "a;b"), ("time", "90\ntouch x"),
                                       ("sbatch_args", ["--qos=high", "x\ntouch /tmp/pwned"]),
                                       ("sbatch_args", ["--chd=/tmp"])])
def test_the_backend_refuses_a_bad_value_even_called_directly(key, value, tmp_path):
    launch = slurm_plan(tmp_path)
    assert not launch.errors
    setattr(launch.spec.layout.options, key, value)  # past every earlier check: the backend is the last one
    backend = SlurmBackend()
    [problem] = backend.check(launch.spec.layout, "cpu")  # before asking any cluster
    assert problem.startswith(f"studio.slurm.{key}: ")
    run_dir = Path(launch.argv[-1])
    run_dir.mkdir(parents=True)
    with pytest.raises(SubmitError, match=f"studio.slurm.{key}: "):
        backend.submit(run_dir, launch, device="cpu")
    assert not (run_dir / SCRIPT).exists()  # nothing written, nothing submitted
    launch.spec.layout.options = SlurmOptions()
    launch.spec.layout.nodes = "2\ntouch /tmp/pwned"
    assert backend.check(launch.spec.layout, "cpu") == ["studio.nodes: '2\\ntouch /tmp/pwned' must be a whole number of "
                                                 "nodes, 1 or more"]


def test_a_script_for_tricky_but_valid_values_runs_no_command_but_srun(tmp_path):
    # a runs folder whose path a shell would read as commands, unquoted
    odd = tmp_path / "runs $(touch pwned1) `touch pwned2`; touch pwned3 'q' #x"
    launch = slurm_plan(tmp_path, run_dir=odd / "r1", partition="trn", account="ml-team.a_1", time="2-12:00:00",
                        sbatch_args=["--comment=a b&c|d", "--constraint=trn2&efa", "--nodelist=n[1-2]"])
    launch.spec.run_name, launch.spec.model_name_or_path = None, "/models/m;touch pwned4\n"  # the job's name
    launch.env["STUDIO_TEST_VALUE"] = "it's $(touch pwned5) `touch pwned6`; touch pwned7"
    script = batch_script(launch)
    records = script[script.index("<<'STUDIO_RUN_RECORDS'\n"):script.index("\nSTUDIO_RUN_RECORDS\n")]
    for line in script.replace(records, "").splitlines():  # the job step's records: a quoted here-document
        if line.startswith("#SBATCH "):
            assert len(shlex.split(line[len("#SBATCH "):])) == 1, line  # one option, as sbatch reads it
        elif not line.startswith("#") and line.strip() and line != "STUDIO_RUN_RECORDS":
            assert line.split()[0] in ("set", "export", "srun", "cd", "exec", sys.executable), line
    (tmp_path / "work").mkdir()
    path = tmp_path / "slurm.sh"
    path.write_text(script)
    # the script run by a real bash as its job's step; srun, Slurm's launcher, a function that prints what it gets
    done = subprocess.run(["bash", "-c", f'srun() {{ printf "%s\\n" "$@" "$STUDIO_TEST_VALUE"; }}; '
                           f'source {shlex.quote(str(path))}'],
                          cwd=tmp_path / "work", capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "9"})
    assert done.returncode == 0, done.stderr
    assert (odd / "r1" / "train.log").read_text().splitlines() == [  # the job's output goes to the run folder
        "--label", "--kill-on-bad-exit=1", sys.executable, "-m", "studio_core.training.supervisor", str(odd / "r1"),
        launch.env["STUDIO_TEST_VALUE"]]
    assert json.loads((odd / "r1" / "launch.json").read_text())["env"]["STUDIO_TEST_VALUE"] == launch.env[
        "STUDIO_TEST_VALUE"]  # the job step's records, as data
    assert list((tmp_path / "work").iterdir()) == [] and not list(tmp_path.glob("pwned*"))
    assert f"exec >>{shlex.quote(f'{odd}/r1/train.log')} 2>&1" in script
    assert "#SBATCH --job-name=sft-m_touch_pwned4_" in script and "#SBATCH --account=ml-team.a_1" in script
    assert sbatch_argv(launch.spec.layout) == ["sbatch", "--parsable", "--comment=a b&c|d", "--constraint=trn2&efa",
                                               "--nodelist=n[1-2]", SCRIPT]


def test_a_run_folder_with_a_line_break_gets_no_batch_script(tmp_path):
    launch = slurm_plan(tmp_path, run_dir=tmp_path / "runs\n#SBATCH x" / "r1")
    with pytest.raises(ValueError, match="holds a control character"):
        batch_script(launch)
    assert "(none: the run folder" in "\n".join(SlurmBackend().describe_launch(launch))  # Preview says why


def test_sbatch_options_in_either_form_are_one_word_each_and_the_studio_s_own_are_refused():
    assert sbatch_words(["--qos", "high", "--comment=a b", "--exclusive", "--gres neuron:16"]) == (
        ["--qos=high", "--comment=a b", "--exclusive", "--gres=neuron:16"], [])
    for refused, says in (("--output=/x", "the studio owns --output"), ("--output /x", "the studio owns --output"),
                          ("--out=/x", "sbatch reads --out as --output"), ("--chdir=/x", "the studio owns --chdir"),
                          ("--job-name=x", "the studio owns --job-name"), ("--nodes=3", "set Nodes"),
                          ("--ntasks-per-core=2", "one task per node"), ("--wait", "would not return"),
                          ("-q high", "write the option's long name"), ("-o x", "the studio owns --output"),
                          ("--x=$(id)", "its value holds '$'"), ("touch", "is not an option")):
        [problem] = sbatch_words([refused])[1]
        assert says in problem, problem
    assert check_options({"sbatch_args": ["--output", "/x"]}) == [
        "studio.slurm.sbatch_args: extra sbatch option '--output /x': the studio owns --output (the studio writes "
        "every node's output to the run's train.log)"]


def test_sbatch_arg_as_readme_writes_it_and_followed_by_its_option(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    assert "[--sbatch-arg=--qos=high]" in readme  # the form README shows
    runs = ["--runs-dir", str(tmp_path / "runs")]
    for given in (["--sbatch-arg=--qos=high"], ["--sbatch-arg", "--qos=high"], ["--sbatch-arg", "--qos high"]):
        code, out, err = cli(capsys, "plan", RECIPE, "--slurm", *given, "--no-forecast", *runs)
        assert code == 0, err
        assert "sbatch --parsable --qos=high slurm.sh" in out
    code, out, err = cli(capsys, "plan", RECIPE, "--slurm", "--sbatch-arg", "--output=/x", "--no-forecast", *runs)
    assert code == 2 and "--sbatch-arg: extra sbatch option '--output=/x': the studio owns --output" in err, err


# A failed 2-node job's node records, as the node supervisors write them (record_node): n2's
# supervisor was killed (no end); n1's torchrun then failed on gloo's "Connection closed by peer".
KILLED = [{"node": "n1", "host": "ip-10-0-0-1", "job_id": "41", "started": 100.0, "ended": 131.2, "exit_code": 1,
           "stopped": False},
          {"node": "n2", "host": "ip-10-0-0-2", "job_id": "41", "started": 100.1}]


def test_the_node_whose_supervisor_died_is_named_not_the_knock_on_error():
    assert first_failed_node(KILLED) == (
        "node n2 (host ip-10-0-0-2) failed first: its supervisor ended without recording its end (it crashed, was "
        "killed, or its node went down) while the other nodes' supervisors went on")
    both_failed = [KILLED[0], {**KILLED[1], "ended": 130.4, "exit_code": 1, "stopped": False}]
    assert first_failed_node(both_failed).startswith("node n2 (host ip-10-0-0-2) failed first: its torchrun exited "
                                                     "with code 1")
    slurm_stopped = [KILLED[0] | {"stopped": True, "exit_code": -15}, KILLED[1] | {"ended": 131.0, "exit_code": 0}]
    assert first_failed_node(slurm_stopped) is None  # nothing failed on its own
    assert first_failed_node([KILLED[1], KILLED[1] | {"node": "n1"}]) is None  # all ended at once: no telling
    assert first_failed_node(KILLED[1:]) is None  # one node: no other to tell it from


def test_node_records_are_kept_per_job_and_a_restarted_step_starts_anew(tmp_path):
    record_node(tmp_path, "41", "n1", started=100.0)
    record_node(tmp_path, "41", "n2", started=100.1)
    record_node(tmp_path, "41", "n1", ended=131.2, exit_code=1, stopped=False)
    record_node(tmp_path, "40", "n2", started=50.0)  # an earlier attempt of the run
    records = node_records(tmp_path, "41")
    assert [(r["node"], "ended" in r) for r in records] == [("n1", True), ("n2", False)]
    assert first_failed_node(records).startswith("node n2")
    record_node(tmp_path, "41", "n1", started=200.0)  # HyperPod's auto-resume starts the step again
    assert "ended" not in json.loads((tmp_path / NODES / "41.n1.json").read_text())
