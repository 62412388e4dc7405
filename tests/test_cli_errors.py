"""The command line against a user's mistakes: every command, a table of bad arguments, each
refused with exit code 2 and a message on stderr that says what to change, never a traceback,
and nothing launched. The CLI is called in this process (main(argv)), which is what
`launch.py` does; only the read-only runs folder needs a process of its own.

    .venv/bin/python -m pytest -q tests/test_cli_errors.py
"""

import os
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cli.main import main
from conftest import RECIPES, run_folders
from studio_core.data.builtin import ensure_tiny_model
from studio_core.export.export import OUTPUT_INFO
from studio_core.machine.hardware import CPU_CORES_ENV, studio_cpus
from studio_core.rundir import events, folder
from studio_core.recipe.spec import RunSpec

ROOT = Path(__file__).resolve().parent.parent
RUN = "20250101-000000-finished-run-abc123"  # a finished run with a saved model and no checkpoint

# (command line, with {r} the tiny recipe, {d} the runs folder, {t} a folder of test files,
#  {run} the finished run; exit code; what stderr must say)
CASES = [
    # serve: refused on its arguments, before the app starts
    ("serve --port 99999 --runs-dir {d}", 2, "use a whole number from 1 to 65535"),
    ("serve --port 0 --runs-dir {d}", 2, "use a whole number from 1 to 65535"),
    ("serve --port abc --runs-dir {d}", 2, "use a whole number from 1 to 65535"),
    ("serve --host 0.0.0.0 --runs-dir {d}", 2, "Add --auth user:password"),
    ("serve --auth nocolon --runs-dir {d}", 2, "write each login as user:password"),
    ("serve --auth-file {t}/missing.txt --runs-dir {d}", 2, "one user:password per line"),
    ("serve --auth-file {t}/adir --runs-dir {d}", 2, "cannot read it (Is a directory)"),
    ("serve --auth-file {t}/latin1.yaml --runs-dir {d}", 2, "cannot read it (not UTF-8 text)"),
    ("serve --host 0.0.0.0 --auth-file {t}/empty --runs-dir {d}", 2, "holds no login"),
    ("serve --runs-dir {t}/afile", 2, "give --runs-dir (or $STUDIO_RUNS_DIR) a folder you can write to"),
    ("--bogus", 2, "unrecognized arguments: --bogus"),
    ("trian {r}", 2, "did you mean train?"),
    ("{r}", 2, "to train this recipe: launch.py train"),
    # train: nothing is launched
    ("train --runs-dir {d}", 2, "give a recipe"),
    ("train --resume NOPE --runs-dir {d} --backend cpu", 2, "`launch.py runs` lists the runs"),
    ("train --resume {run} --from-checkpoint 5 --runs-dir {d} --backend cpu", 2, "saved no checkpoint"),
    ("train --resume {run} {r} --runs-dir {d}", 2, "the run's own settings: leave out the recipe"),
    ("train --resume {run} --nproc 2 --backend cpu --runs-dir {d}", 2, "the run's own settings: leave out --nproc"),
    ("train {r} --from-checkpoint 5 --runs-dir {d} --backend cpu", 2, "--from-checkpoint goes with --resume"),
    ("train {r} --from-checkpoint abc --runs-dir {d}", 2, "invalid int value: 'abc'"),
    ("train {r} --resume --runs-dir {d}", 2, "expected one argument"),
    ("train {r} --set max_steps=[ --runs-dir {d} --backend cpu", 2, """quote it to pass text: --set 'max_steps="["'"""),
    ("train {r} --set 'run_name={{oops' --runs-dir {d} --backend cpu", 2, "close its brackets"),
    ("train {r} --set noequals --runs-dir {d} --backend cpu", 2, "write it as key=value"),
    ("train {t}/nope.yaml --runs-dir {d} --backend cpu", 2, "give the path of a .yaml file"),
    ("train {t}/adir --runs-dir {d} --backend cpu", 2, "adir is a folder, give a YAML file"),
    ("train {t}/latin1.yaml --runs-dir {d} --backend cpu", 2, "is not UTF-8 text (byte 20 is 0xe9): save it as UTF-8"),
    ("train {t}/list.yaml --runs-dir {d} --backend cpu", 2, "a recipe must be a YAML mapping"),
    ("train {r} --runs-dir {t}/afile --backend cpu", 2, "afile is not a folder: give --runs-dir"),
    ("train {r} --runs-dir {t}/afile/runs --backend cpu", 2, "afile, which is not a folder: give --runs-dir"),
    ("train {r} --runs-dir /dev/null --backend cpu", 2, "/dev/null is not a folder: give --runs-dir"),
    # plan: the layout, the instance, Slurm, the scripts it writes
    ("plan {r} --nproc 0 --backend cpu --no-forecast --runs-dir {d}", 2, "use a whole number"),
    ("plan {r} --nproc -1 --backend cpu --no-forecast --runs-dir {d}", 2, "use a whole number"),
    ("plan {r} --nproc abc --backend cpu --no-forecast --runs-dir {d}", 2, "use a whole number"),
    ("plan {r} --tp 0 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2, "use a whole number"),
    ("plan {r} --fsdp x --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2, "use a whole number"),
    ("plan {r} --cores 5-2 --backend cpu --no-forecast --runs-dir {d}", 2, "reversed range: write 2-5"),
    ("plan {r} --cores x --backend cpu --no-forecast --runs-dir {d}", 2, "write e.g. 0-3, 0,1 or 0-1,2-3"),
    ("plan {r} --cores \"0'1\" --backend cpu --no-forecast --runs-dir {d}", 2, "write e.g. 0-3, 0,1 or 0-1,2-3"),
    ("plan {r} --cores '' --backend cpu --no-forecast --runs-dir {d}", 2, "no cores given"),
    ("plan {r} --cores 4096 --backend cpu --no-forecast --runs-dir {d}", 2, "there is no core 4096"),
    ("plan {r} --nproc 3 --tp 2 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2, "change one of them"),
    ("plan {r} --nproc 4 --cores 1-4 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2, "use 0-3"),
    ("plan {r} --nproc 8 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2, "use at most 4"),
    ("plan {r} --instance trn2.3xlarge --lnc 3 --runs-dir {d}", 2, "invalid choice: 3 (choose from 1, 2)"),
    ("plan {r} --instance trn9 --runs-dir {d}", 2, "invalid choice: 'trn9'"),
    ("plan {r} --backend cuda --runs-dir {d}", 2, "invalid choice: 'cuda'"),
    ("plan --runs-dir {d}", 2, "the following arguments are required: recipe"),
    ("plan {r} --nodes 2 --backend cpu --no-forecast --runs-dir {d}", 2, "--nodes: a run on several machines goes to a cluster: add --slurm or --ray ADDRESS"),
    ("plan {r} --partition p --backend cpu --no-forecast --runs-dir {d}", 2, "add --slurm"),
    ("plan {r} --slurm --nodes -1 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2, "1 or more"),
    ("plan {r} --slurm-script {t}/job.sh --nodes 0 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2,
     "--nodes: '0': use a whole number of 1 or more"),
    ("plan {r} --slurm --set studio.slurm=3 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2,
     "studio.slurm: must be a mapping"),
    ("plan {r} --slurm --partition p --set studio.slurm=3 --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2,
     "studio.slurm: must be a mapping"),
    ("plan {r} --export-script {t}/nodir/run.sh --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2,
     "does not exist: make it first (mkdir -p"),
    ("plan {r} --export-script {t}/adir --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2,
     "is a folder: give a file name"),
    ("plan {r} --slurm-script {t}/afile/job.sh --instance trn2.3xlarge --no-forecast --runs-dir {d}", 2,
     "afile is not a folder: write the file elsewhere"),
    ("plan {r} --set studio.trainer=nope --backend cpu --no-forecast --runs-dir {d}", 2, "choose sft"),
    ("plan {r} --set studio.run_on=mars --backend cpu --no-forecast --runs-dir {d}", 2, "choose local, slurm"),
    ("plan {r} --set learning_rate=abc --backend cpu --no-forecast --runs-dir {d}", 2, "expected float"),
    ("plan {r} --set studio=3 --backend cpu --no-forecast --runs-dir {d}", 2, "studio: must be a mapping"),
    ("plan {r} --set studio.bogus=1 --backend cpu --no-forecast --runs-dir {d}", 2, "the studio block takes"),
    ("plan {r} --runs-dir {t}/afile --backend cpu --no-forecast", 2, "is not a folder: give --runs-dir"),
    # runs, stop
    ("runs --runs-dir {t}/afile", 2, "is not a folder: give --runs-dir"),
    ("runs --bogus", 2, "unrecognized arguments: --bogus"),
    ("stop --runs-dir {d}", 2, "the following arguments are required: run_id"),
    ("stop NOPE --runs-dir {d}", 2, "`launch.py runs` lists the runs"),
    ("stop ../NOPE --runs-dir {d}", 2, "`launch.py runs` lists the runs"),
    ("stop {run} --save --runs-dir {d}", 2, "there is nothing to stop"),
    ("stop {run} --runs-dir {t}/afile/runs", 2, "which is not a folder: give --runs-dir"),
    # cache
    ("cache --backend tpu", 2, "invalid choice: 'tpu'"),
    ("cache --backend cpu --clear --runs-dir {t}/afile", 2, "is not a folder: give --runs-dir"),
    # chat: refused before a model is loaded
    ("chat --prompt hi --runs-dir {d}", 2, "the following arguments are required: target"),
    ("chat NOPE --prompt hi --backend cpu --runs-dir {d}", 2, "neither a run"),
    ("chat {run} --temperature abc --runs-dir {d}", 2, "invalid float value: 'abc'"),
    ("chat NOPE --temperature -1 --prompt hi --backend cpu --runs-dir {d}", 2, "use 0 (greedy, the default) or more"),
    ("chat NOPE --top-p 1.5 --prompt hi --backend cpu --runs-dir {d}", 2, "above 0, at most 1"),
    ("chat NOPE --max-new-tokens 0 --prompt hi --backend cpu --runs-dir {d}", 2, "use a whole number from 1 to"),
    ("chat builtin:tiny-qwen3 --cores 4096 --prompt hi --backend cpu --runs-dir {d}", 2, "give one core of this"),
    ("chat builtin:tiny-qwen3 --cores 0-1 --prompt hi --backend cpu --runs-dir {d}", 2, "give one core of this"),
    ("chat builtin:tiny-qwen3 --cores x --prompt hi --backend cpu --runs-dir {d}", 2, "write e.g. 0-3"),
    ("chat builtin:tiny-qwen3 --prompt hi --backend cpu --runs-dir /dev/null", 2, "is not a folder: give --runs-dir"),
    # export: refused before the export starts
    ("export {run} --runs-dir {d}", 2, "the following arguments are required: --out"),
    ("export --out {t}/out --runs-dir {d}", 2, "the following arguments are required: run_id"),
    ("export NOPE --out {t}/out --runs-dir {d}", 2, "`launch.py runs` lists the runs"),
    ("export {run} --out {t}/afile --runs-dir {d}", 2, "afile is not a folder: give a new (or empty) folder"),
    ("export {run} --out {t}/afile/out --runs-dir {d}", 2, "which is not a folder: give a new (or empty) folder"),
    ("export {run} --out {t}/out --push 'bad id!' --runs-dir {d}", 2, "write it as your-name/model-name"),
    ("export {run} --out {t}/out --push model --runs-dir {d}", 2, "write it as your-name/model or an-org/model"),
    ("export {run} --out {t}/out --public --runs-dir {d}", 2, "--public: these go with --push REPO_ID"),
    ("export {run} --out {t}/out --update --runs-dir {d}", 2, "--update: these go with --push REPO_ID"),
    # eval: refused before the evaluation process starts
    ("eval {run} --metrics bleu --runs-dir {d}", 2, "metric bleu: unknown; choose from exact_match"),
    ("eval {run} --data {t}/prompts.jsonl --metrics exact_match,rouge_l --runs-dir {d}", 2,
     "exact_match, rouge_l compare with a reference answer, and the evaluation set has none"),
    ("eval {run} --split test --runs-dir {d}", 2, "a file has one split, train; leave the split out"),
    ("eval {run} --data builtin:qa --split validation --runs-dir {d}", 2, "a file has one split, train"),
    ("eval {run} --limit 0 --runs-dir {d}", 2, "limit 0: evaluate at least 1 row"),
    ("eval {run} --max-new-tokens 0 --runs-dir {d}", 2, "max_new_tokens 0: use 1 to 512"),
    ("eval builtin:tiny-qwen3 --runs-dir {d}", 2, "is not a run: name an evaluation set (--data FILE or Hub id)"),
    ("eval {run} --data {t}/nope.jsonl --runs-dir {d}", 2, "nope.jsonl not found"),
    ("eval {run} --metrics mean_reward --runs-dir {d}", 2, "only GRPO and RLOO runs do"),
    ("eval {run} --data builtin:qa --metrics preference_accuracy --runs-dir {d}", 2, "has no such pairs"),
    ("eval {run} --data {t}/empty.jsonl --runs-dir {d}", 2, "empty.jsonl is empty"),
    ("eval {run} --column-map answer --runs-dir {d}", 2, "write it as old=new"),
    ("eval NOPE --runs-dir {d}", 2, "neither a run in"),
    # an evaluation set during training
    ("train {r} --set studio.eval_fraction=1.5 --runs-dir {d}", 2, "must be a number between 0 and 1"),
    ("train {r} --set studio.eval_fraction=0 --runs-dir {d}", 2, "must be a number between 0 and 1"),
    ("train {r} --set studio.eval_fraction=0.95 --runs-dir {d}", 2, "of 12 rows holds out all 12 and leaves none"),
    ("train {r} --set eval_strategy=steps --runs-dir {d}", 2, "a file has one split, train: hold out part of it"),
    ("train {r} --set studio.eval_dataset={t}/nope.jsonl --runs-dir {d}", 2, "studio.eval_dataset: "),
    ("train {r} --set studio.eval_fraction=0.1 --set studio.eval_dataset=builtin:qa --runs-dir {d}", 2,
     "choose one evaluation set"),
    # what TRL, Transformers or PEFT would refuse after loading, and recipes that say nothing (issue 29)
    ("plan {t}/empty --backend cpu --no-forecast --runs-dir {d}", 2, "empty is empty: write at least the trainer"),
    ("plan /dev/null --backend cpu --no-forecast --runs-dir {d}", 2, "/dev/null is not a regular file"),
    ("plan {r} --set report_to=garbage --backend cpu --no-forecast --runs-dir {d}", 2,
     "report_to: 'garbage': Transformers (its report_to trackers) refuses it"),
    ("train {r} --set logging_steps=0 --backend cpu --runs-dir {d}", 2, "logging_steps: 0: TRL's SFTConfig refuses"),
    ("train {r} --set learning_rate=1e999 --backend cpu --runs-dir {d}", 2, "learning_rate: inf is not a finite"),
    ("train {r} --set run_name=hf_AbCdEfGhIjKlMnOpQrStUv --backend cpu --runs-dir {d}", 2,
     "run_name: a secret does not belong in a recipe"),
    # doctor
    ("doctor --runs-dir {t}/afile", 2, "is not a folder: give --runs-dir"),
    ("doctor --bogus", 2, "unrecognized arguments: --bogus"),
    # a run given as a path, export's --out (issue 29, runs)
    ("export {run} --out '' --runs-dir {d}", 2, "--out is empty: give a folder"),
    ("export {d}/{run} --out {d}/{run}/eval --runs-dir {d}", 2, "the export would be deleted with the run"),
    ("stop {t}/adir --runs-dir {d}", 2, "nor the path of a run folder in the runs folder"),
    ("train --resume {d}/{run} --backend cpu --runs-dir {d}", 2, "saved no checkpoint"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """The placeholders of CASES: a runs folder with one finished run (its saved model the built-in
    one's files), and files a user gets wrong."""
    t = tmp_path_factory.mktemp("cli-errors")
    (t / "afile").write_text("a file, not a folder\n")
    (t / "adir").mkdir()
    (t / "empty").write_text("")
    (t / "latin1.yaml").write_bytes("model_name_or_path: \u00e9t\u00e9\n".encode("latin-1"))  # not UTF-8
    (t / "list.yaml").write_text("- max_steps: 5\n- learning_rate: 1.0e-4\n")
    (t / "prompts.jsonl").write_text('{"prompt": "What colour is the studio mascot?"}\n')  # no answer to compare
    (t / "empty.jsonl").write_text("")
    run_dir = t / "runs" / RUN
    shutil.copytree(ensure_tiny_model(), run_dir / folder.OUTPUT)
    RunSpec.load(RECIPES / "tiny-sft.yaml").save(run_dir / folder.SPEC)
    events.append(run_dir / folder.EVENTS, events.status("finished", exit_code=0))
    folder.write_json(run_dir / folder.OUTPUT / OUTPUT_INFO, {"kind": "full", "trainer": "sft", "base_model":
                                                              "builtin:tiny-qwen3", "task": "text-generation"})
    return {"r": str(RECIPES / "tiny-sft.yaml"), "d": str(t / "runs"), "t": str(t), "run": RUN}


@pytest.fixture
def no_app(monkeypatch):
    """`serve` fails here if it ever gets as far as building the web app."""
    def started(*args, **kwargs):
        raise AssertionError("the web app was started")

    stub = types.ModuleType("app.main")
    stub.build_app, stub.queued, stub.launch_settings = started, started, started
    monkeypatch.setitem(sys.modules, "app.main", stub)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) as launch.py runs it: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as refused:  # argparse's refusals
        code = refused.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, out: str, err: str, expected_code: int, says: str) -> None:
    assert "Traceback" not in out + err, out + err
    assert code == expected_code, f"exit code {code!r}; stderr: {err}"
    assert says in err, f"stderr does not say {says!r}:\n{err}"


@pytest.mark.fast
@pytest.mark.parametrize("line, code, says", CASES, ids=[line.split(" --runs-dir")[0] for line, _, _ in CASES])
def test_a_bad_command_line_says_what_to_change(line, code, says, places, no_app, capsys):
    before = sorted(os.listdir(places["d"]))
    refused(*cli(shlex.split(line.format(**places)), capsys), code, says)
    assert sorted(os.listdir(places["d"])) == before, "something was made in the runs folder"
    assert not (Path(places["d"]) / RUN / "eval").exists(), "an evaluation was saved"


@pytest.mark.fast
@pytest.mark.parametrize("value, says", [("abc", "write e.g. 0-3"), ("0-", "write e.g. 0-3"),
                                         ("99999", "name some of those, or unset it")])
def test_a_bad_studio_cpu_cores_is_a_message(value, says, places, monkeypatch, capsys):
    monkeypatch.setenv(CPU_CORES_ENV, value)
    code, out, err = cli(["plan", places["r"], "--backend", "cpu", "--no-forecast", "--runs-dir", places["d"]], capsys)
    refused(code, out, err, 2, says)
    assert f"{CPU_CORES_ENV}={value!r}" in err


@pytest.mark.fast
def test_more_processes_than_cores_says_how_many_cores_there_are(places, capsys):
    cores = len(studio_cpus())
    code, out, err = cli(["plan", places["r"], "--nproc", str(cores + 1), "--backend", "cpu", "--no-forecast",
                          "--runs-dir", places["d"]], capsys)
    refused(code, out, err, 2, f"at most {cores}")
    assert f"has {cores}" in err, err
    assert "held" not in err and "wait for" not in err, f"no core is held, so waiting helps nothing:\n{err}"


@pytest.mark.fast
def test_a_lease_folder_that_cannot_be_made_says_what_to_set(places, monkeypatch, capsys):
    monkeypatch.setenv("STUDIO_LEASES_DIR", "/proc/no-such-folder")  # not even root can make it
    code, out, err = cli(["train", places["r"], "--backend", "cpu", "--runs-dir", places["d"]], capsys)
    refused(code, out, err, 2, "set STUDIO_LEASES_DIR to a folder you can write to")


def test_a_read_only_runs_folder_is_named_before_anything_runs(tmp_path):
    """A folder nobody may write to. Root writes anyway, so as root the command runs without the
    capability that lets it (setpriv drops CAP_DAC_OVERRIDE): then the folder's mode holds."""
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir(mode=0o555)
    runs_dir.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("as root a folder's mode does not stop writes, and setpriv (util-linux) is not here")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    done = subprocess.run([*prefix, sys.executable, "launch.py", "train", str(RECIPES / "tiny-sft.yaml"),
                           "--backend", "cpu", "--runs-dir", str(runs_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    refused(done.returncode, done.stdout, done.stderr, 2,
            f"runs folder {runs_dir}: cannot write to it (Permission denied): give --runs-dir")
    assert run_folders(runs_dir) == []


def test_output_cut_short_by_the_reader_is_no_traceback(tmp_path):
    """`launch.py runs | head`: the reader goes away before the listing is written."""
    listing = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "runs", "--runs-dir", str(tmp_path)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    listing.stdout.close()  # before it has printed anything: it imports for a second first
    err = listing.stderr.read()
    assert listing.wait(timeout=60) == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err
