"""Each `tunelab` subcommand, run as a real subprocess."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tunelab.cli import builtin_recipes
from tunelab.cli._discovery import config_recipe_name
from tunelab.config import builtin_configs

TUNELAB = Path(sys.executable).with_name("tunelab")
ENV = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
ENV.pop("TUNELAB_DEBUG", None)

RECIPE = '''
"""A test recipe: each rank writes what it saw."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tunelab.config import Component, RecipeArgs, component, instantiate
from tunelab.lifecycle import recipe_main
from tunelab.errors import DataError


@dataclass(kw_only=True)
class ToyArgs(RecipeArgs):
    output_dir: str
    """Where each rank writes its file."""
    steps: int = 2
    """Number of steps."""
    fail_ranks: list[int] = field(default_factory=list)
    """Ranks that raise a DataError inside main."""
    counter: Component | None = component(required=False)
    """Something to build."""


ARGS = ToyArgs


def main(args: ToyArgs) -> None:
    if int(os.environ["RANK"]) in args.fail_ranks:
        raise DataError(f"row 3 of data.jsonl has no 'output' (rank {os.environ['RANK']})")
    counter = instantiate(args.counter)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    record = {name: os.environ.get(name) for name in names}
    record.update(steps=args.steps, counter=dict(counter or {}))
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    recipe_main(main, ARGS)
'''


def tunelab(*args, cwd=None, env=None, timeout=300):
    return subprocess.run(
        [str(TUNELAB), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env or ENV,
        timeout=timeout,
    )


def one_error_line(result, code=1):
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tunelab: error: ")
    return lines[0]


@pytest.fixture
def project(tmp_path):
    """A recipe script and a config naming it (by a path relative to the config)."""
    (tmp_path / "toy.py").write_text(RECIPE)
    (tmp_path / "toy.yaml").write_text(
        textwrap.dedent(
            f"""\
            recipe: toy.py
            output_dir: {tmp_path / "out"}
            steps: 3
            counter:
              _component_: collections.Counter
              a: 2
            """
        )
    )
    return tmp_path


# --- fake built-in folders, for exact ls / cp behaviour -----------------------------------

FAKE_MAIN = """
import sys
from pathlib import Path
import tunelab._paths as paths
recipes, configs = Path(sys.argv.pop(1)), Path(sys.argv.pop(1))
paths.recipes_dir = lambda: recipes
paths.configs_dir = lambda: configs
from tunelab.cli.main import main
main()
"""


@pytest.fixture
def fake_builtins(tmp_path):
    recipes, configs = tmp_path / "recipes", tmp_path / "configs"
    for name in ("alpha", "beta", "_helpers"):
        (recipes / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (recipes / f"{name}.py").write_text(f"# recipe {name}\n")
    for name, recipe in [
        ("x/one", "alpha"),
        ("x/two", "alpha"),
        ("three", "beta"),
        ("odd", "my.py"),
    ]:
        path = configs / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"recipe: {recipe}\nk: 1\n")

    def run(*args, cwd=None):
        command = [sys.executable, "-c", FAKE_MAIN, str(recipes), str(configs), *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=cwd)

    return run


def test_ls_groups_configs_under_their_recipe(fake_builtins):
    result = fake_builtins("ls")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "RECIPE    CONFIG",
        "alpha     x/one",
        "          x/two",
        "beta      three",
        "(other)   odd",
    ]


def test_ls_lists_every_shipped_recipe_and_config():
    result = tunelab("ls")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    first_words = {row[0] for row in rows if len(row) == 2}
    assert set(builtin_recipes()) <= first_words
    listed_configs = {row[-1] for row in rows}
    for name, path in builtin_configs().items():
        if config_recipe_name(path) in builtin_recipes():
            assert name in listed_configs


def test_cp_recipe_and_config(fake_builtins, tmp_path):
    dest = tmp_path / "work"
    result = fake_builtins("cp", "alpha", dest / "sub" / "my_alpha")
    assert result.returncode == 0, result.stderr
    assert (dest / "sub" / "my_alpha.py").read_text() == "# recipe alpha\n"
    assert fake_builtins("cp", "x/one", dest / "mine").returncode == 0
    assert (dest / "mine.yaml").read_text() == "recipe: alpha\nk: 1\n"
    assert fake_builtins("cp", "x/two", dest / "keep.yml").returncode == 0
    assert (dest / "keep.yml").is_file()
    assert fake_builtins("cp", "three", dest).returncode == 0  # into an existing folder
    assert (dest / "three.yaml").is_file()


def test_cp_refuses_to_overwrite_without_force(fake_builtins, tmp_path):
    dest = tmp_path / "mine.yaml"
    dest.write_text("my edits\n")
    line = one_error_line(fake_builtins("cp", "x/one", dest))
    assert line == f"tunelab: error: {dest} already exists; pass --force to overwrite it"
    assert dest.read_text() == "my edits\n"
    assert fake_builtins("cp", "x/one", dest, "--force").returncode == 0
    assert dest.read_text() == "recipe: alpha\nk: 1\n"


def test_cp_unknown_name(fake_builtins, tmp_path):
    line = one_error_line(fake_builtins("cp", "gamma", tmp_path / "g.py"))
    assert "no built-in recipe or config named 'gamma'" in line
    assert not (tmp_path / "g.py").exists()


def test_cp_unknown_name_suggests_the_closest(fake_builtins, tmp_path):
    line = one_error_line(fake_builtins("cp", "x/onee", tmp_path / "g.yaml"))
    assert (
        line == "tunelab: error: no built-in recipe or config named 'x/onee'; did you mean 'x/one'?"
    )


def test_cp_to_stdout(fake_builtins):
    result = fake_builtins("cp", "x/one", "-")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "recipe: alpha\nk: 1\n"  # The file alone: no "Copied" line.


def test_cp_to_a_device_writes_it_and_adds_no_suffix(fake_builtins):
    assert not Path("/dev/stdout.yaml").exists()
    result = fake_builtins("cp", "x/one", "/dev/stdout")  # stdout is a pipe here
    assert result.returncode == 0, result.stderr
    assert result.stdout == "recipe: alpha\nk: 1\n"
    assert not Path("/dev/stdout.yaml").exists()
    assert fake_builtins("cp", "alpha", "/dev/null").returncode == 0


def test_cp_never_adds_a_suffix_to_an_existing_file(fake_builtins, tmp_path):
    dest = tmp_path / "noext"
    dest.write_text("mine\n")
    line = one_error_line(fake_builtins("cp", "x/one", dest))
    assert line == f"tunelab: error: {dest} already exists; pass --force to overwrite it"
    assert not (tmp_path / "noext.yaml").exists()
    assert fake_builtins("cp", "x/one", dest, "--force").returncode == 0
    assert dest.read_text() == "recipe: alpha\nk: 1\n"


@pytest.mark.skipif(not builtin_configs(), reason="configs/ holds no YAML files yet")
def test_cp_real_builtin_config(tmp_path):
    name, source = next(iter(builtin_configs().items()))
    result = tunelab("cp", name, tmp_path / "copy")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "copy.yaml").read_text() == source.read_text()


# --- validate --------------------------------------------------------------------------------


def test_validate_ok(project):
    result = tunelab("validate", project / "toy.yaml", "steps=5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"OK: {project / 'toy.yaml'}"


def test_validate_reports_did_you_mean(project):
    line = one_error_line(tunelab("validate", project / "toy.yaml", "stpes=5"))
    assert line == "tunelab: error: unknown key 'stpes' in config; did you mean 'steps'?"


def test_validate_reports_type_and_component_problems(project):
    result = tunelab(
        "validate", project / "toy.yaml", "steps=many", "counter._component_=collections.Countr"
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "tunelab: error: 2 problems in the config:",
        "  - key 'steps': expected int, got str 'many'",
        "  - counter._component_: cannot import 'collections.Countr': 'collections' has no "
        "attribute 'Countr'; did you mean 'collections.Counter'?",
    ]


def test_validate_bad_inputs_one_line_each(project, tmp_path):
    (tmp_path / "broken.yaml").write_text("recipe: toy.py\nsteps: [1,\n")
    assert "line 3" in one_error_line(tunelab("validate", tmp_path / "broken.yaml"))
    assert "bad override 'steps'" in one_error_line(
        tunelab("validate", project / "toy.yaml", "steps")
    )
    assert "config file not found" in one_error_line(tunelab("validate", tmp_path / "nope.yaml"))
    (tmp_path / "norecipe.yaml").write_text("steps: 1\n")
    assert "has no 'recipe' key" in one_error_line(tunelab("validate", tmp_path / "norecipe.yaml"))


def test_debug_shows_the_traceback(project):
    result = tunelab("--debug", "validate", project / "toy.yaml", "stpes=5")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    result = tunelab("validate", project / "toy.yaml", "stpes=5", env=dict(ENV, TUNELAB_DEBUG="1"))
    assert "Traceback" in result.stderr


# --- run -------------------------------------------------------------------------------------


def test_run_one_process(project):
    result = tunelab("run", project / "toy.py", "--config", project / "toy.yaml", "steps=7")
    assert result.returncode == 0, result.stderr
    record = json.loads((project / "out" / "rank0.json").read_text())
    assert record["RANK"] == record["LOCAL_RANK"] == "0"
    assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == "1"
    assert record["MASTER_ADDR"] == "127.0.0.1" and int(record["MASTER_PORT"]) > 0
    assert record["steps"] == 7
    assert record["counter"] == {"a": 2}


@pytest.mark.slow
def test_run_two_processes_through_torchrun(project):
    result = tunelab(
        "run",
        "--nproc_per_node",
        "2",
        project / "toy.py",
        "--config",
        project / "toy.yaml",
        "steps=4",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads((project / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["RANK"] for r in records] == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in records} == {"2"}
    assert {r["steps"] for r in records} == {4}


def test_run_failing_recipe_prints_short_lines(project):
    result = tunelab("run", project / "toy.py", "--config", project / "toy.yaml", "fail_ranks=[0]")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    # One line, printed once (by the launcher, from the rank's record).
    assert result.stderr.splitlines() == [
        "tunelab: error: row 3 of data.jsonl has no 'output' (rank 0)",
    ]


MESSAGE = "row 3 of data.jsonl has no 'output' (rank {})"


@pytest.mark.slow
def test_run_error_on_one_nonzero_rank_reaches_the_user(project):
    # Rank 0 prints nothing (it did not fail); the launcher reports rank 1's message.
    result = tunelab(
        "run",
        "--nproc-per-node=2",
        project / "toy.py",
        "--config",
        project / "toy.yaml",
        "fail_ranks=[1]",
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["tunelab: error: " + MESSAGE.format(1)]


def _process_failure(tmp_path, rank: int, exitcode: int, line: str | None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error{rank}.json"
    if line is not None:  # As recipe_main records it (whole seconds, like torchrun's own).
        record = {"message": {"message": line, "extraInfo": {"timestamp": "1700000000"}}}
        error_file.write_text(json.dumps(record))
    failure = ProcessFailure(rank, 1000 + rank, exitcode, str(error_file))
    if line is None:
        failure.timestamp = 1700000000  # The same second: torchrun breaks ties by nothing.
    return failure


@pytest.mark.parametrize("stopped_code", [143, 130, -15])
def test_the_reported_failure_is_the_rank_that_failed_not_one_torchrun_stopped(
    tmp_path, stopped_code
):
    # Rank 1 failed; torchrun then stopped rank 0, whose stop handler exited 128 + SIGTERM
    # (or the signal killed it) in the same second. Seen in CI: the launcher reported rank 0
    # ("<NONE>", exit 143) instead of rank 1's line.
    from tunelab.cli._run import _describe_failure, _first_failure

    failures = {
        0: _process_failure(tmp_path, 0, stopped_code, None),
        1: _process_failure(tmp_path, 1, 1, MESSAGE.format(1)),
    }
    rank, failure = _first_failure(failures)
    assert (rank, failure.exitcode) == (1, 1)
    assert _describe_failure("toy", rank, failure) == MESSAGE.format(1)


def test_a_failure_without_a_record_is_described_by_its_exit():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from tunelab.cli._run import _describe_failure

    failure = ProcessFailure(1, 1001, -9, "/nonexistent/error.json")
    assert _describe_failure("toy", 1, failure) == (
        "recipe toy failed on rank 1 (killed by SIGKILL, signal 9 "
        "(out of memory? the kernel's OOM killer sends it))"
    )
    failure = ProcessFailure(1, 1001, -11, "/nonexistent/error.json")
    assert (
        _describe_failure("toy", 1, failure)
        == "recipe toy failed on rank 1 (killed by SIGSEGV, signal 11)"
    )


@pytest.mark.parametrize("killed_by", [9, 11, 6])
def test_a_worker_killed_by_a_signal_it_does_not_handle_is_the_cause(tmp_path, killed_by):
    # Rank 1 was SIGKILLed (the OOM killer) mid-step; rank 0 then recorded "Connection closed
    # by peer" and was stopped with 143. Seen in issue 23: exit 143 ("stopped, committed")
    # and rank 0's line.
    from tunelab.cli._run import _describe_failure, _exit_status, _first_failure

    failures = {
        0: _process_failure(tmp_path, 0, 143, "rank 0: RuntimeError: Connection closed by peer"),
        1: _process_failure(tmp_path, 1, -killed_by, None),
    }
    rank, failure = _first_failure(failures)
    assert (rank, failure.exitcode) == (1, -killed_by)
    assert _exit_status(failure.exitcode) == 128 + killed_by
    assert "on rank 1 (killed by SIG" in _describe_failure("toy", rank, failure)


def test_a_worker_torchrun_sigkilled_after_the_shutdown_timeout_is_not_the_cause(tmp_path):
    from tunelab.cli._run import SHUTDOWN_TIMEOUT_S, _first_failure

    failures = {
        0: _process_failure(tmp_path, 0, 1, MESSAGE.format(0)),
        1: _process_failure(tmp_path, 1, -9, None),
    }
    failures[1].timestamp += SHUTDOWN_TIMEOUT_S  # hung in a collective until torchrun's SIGKILL
    assert _first_failure(failures)[0] == 0


def test_a_hung_worker_torchrun_sigkilled_after_its_close_wait_is_not_the_cause(tmp_path):
    # After a rank fails, torchrun waits 30 s for the others (not the shutdown timeout) and
    # SIGKILLs the rest: a rank hung in a reward, whose peer's collective timed out. It was
    # reported as "failed on rank 1 (killed by SIGKILL ... out of memory?)".
    from tunelab.cli._run import TORCHRUN_CLOSE_WAIT_S, _exit_status, _first_failure

    failures = {
        0: _process_failure(tmp_path, 0, 1, MESSAGE.format(0)),
        1: _process_failure(tmp_path, 1, -9, None),
    }
    failures[1].timestamp += TORCHRUN_CLOSE_WAIT_S
    rank, failure = _first_failure(failures)
    assert rank == 0 and _exit_status(failure.exitcode) == 1


def _closed_under_it(tmp_path, rank: int):
    """Rank ``rank``'s failure as recipe_main records one a peer's exit caused."""
    from tunelab.lifecycle.collective_timeout import PEER_CLOSED_KEY

    failure = _process_failure(
        tmp_path, rank, 1, f"rank {rank}: RuntimeError: [pair.cc:598] Connection closed by peer"
    )
    record = json.loads(Path(failure.error_file).read_text())
    record[PEER_CLOSED_KEY] = True
    Path(failure.error_file).write_text(json.dumps(record))
    failure.error_file_data = record
    return failure


def test_a_rank_a_peers_exit_failed_is_not_the_cause_even_when_it_recorded_first(tmp_path):
    # Seen in CI (issue 47's SIGTERM test): the trainer (rank 0) refused to resume and
    # exited; the rollout rank's broadcast with it failed ("Connection closed by peer") and
    # the launcher printed that instead of the refusal.
    from tunelab.cli._run import _describe_failure, _first_failure

    failures = {0: _closed_under_it(tmp_path, 0), 1: _process_failure(tmp_path, 1, 1, MESSAGE)}
    failures[1].timestamp += 1  # the cause recorded its line a second later
    rank, failure = _first_failure(failures)
    assert rank == 1 and _describe_failure("toy", rank, failure, failures) == MESSAGE


@pytest.mark.parametrize("ended_by", [-15, 143])
def test_a_rank_that_recorded_its_failure_is_the_cause_though_a_signal_ended_its_exit(
    tmp_path, ended_by
):
    # Rank 0 recorded its line, then torchrun's SIGTERM (sent once rank 1 failed on the
    # connection rank 0's exit closed) ended its exit.
    from tunelab.cli._run import _describe_failure, _first_failure

    failures = {
        0: _process_failure(tmp_path, 0, ended_by, MESSAGE.format(0)),
        1: _process_failure(tmp_path, 1, 1, "rank 1: RuntimeError: Connection closed by peer"),
    }
    rank, failure = _first_failure(failures)
    assert rank == 0 and _describe_failure("toy", rank, failure, failures) == MESSAGE.format(0)


def test_peer_closed_reads_the_transports_words_through_the_chain():
    from tunelab.lifecycle.collective_timeout import peer_closed
    from tunelab.rl.weight_sync import WeightTransferError

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection "
                        "closed by peer [127.0.0.1]:13542")  # fmt: skip
    assert peer_closed(gloo)
    assert peer_closed(
        RuntimeError("NCCL error: remote process exited or there was a network error")
    )
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise ValueError("the broadcast of the config failed") from err
    except ValueError as chained:
        assert peer_closed(chained)
    assert peer_closed(WeightTransferError(
        "weight transfer from trainer rank 0: dead or stalled past 60 s (Connection reset by peer)"
    ))  # fmt: skip
    assert not peer_closed(RuntimeError("Timed out waiting 5000ms for send operation"))
    assert not peer_closed(ValueError("row 3 of data.jsonl has no 'output'"))


def test_a_failure_a_peers_exit_caused_is_recorded_as_such(tmp_path, monkeypatch):
    from tunelab.lifecycle import entry
    from tunelab.lifecycle.collective_timeout import PEER_CLOSED_KEY

    record_file = tmp_path / "error.json"
    monkeypatch.setenv(entry.ERROR_FILE_ENV, str(record_file))
    monkeypatch.setenv("RANK", "1")
    for error, closed in [
        (RuntimeError("[pair.cc:538] Connection closed by peer [127.0.0.1]:13542"), True),
        (RuntimeError("the reward function returned None"), False),
    ]:
        try:
            raise error
        except RuntimeError as err:
            with pytest.raises(SystemExit):
                entry._report_failure(err, None, debug=False)
        record = json.loads(record_file.read_text())
        assert record.get(PEER_CLOSED_KEY, False) is closed
        assert record["message"]["message"].startswith("rank 1: RuntimeError: ")


def _timed_out(tmp_path, rank: int, world_size: int):
    from tunelab.lifecycle.collective_timeout import RECORD_KEY, CollectiveTimeout

    timeout = CollectiveTimeout(
        rank, world_size, "all_gather_object", "write_completions (tunelab/training/grpo.py:251)",
        5.0, f"/out/logs/rank_{rank}.log",
    )  # fmt: skip
    failure = _process_failure(tmp_path, rank, 1, timeout.line())
    record = json.loads(Path(failure.error_file).read_text())
    record[RECORD_KEY] = timeout.to_record()
    Path(failure.error_file).write_text(json.dumps(record))
    failure.error_file_data = record
    return failure


def test_a_collective_timeout_names_the_ranks_that_did_not_arrive(tmp_path):
    # Ranks 0 and 2 waited in the collective and timed out; ranks 1 and 3 never came (hung
    # elsewhere) and torchrun SIGKILLed them 30 s later.
    from tunelab.cli._run import (
        TORCHRUN_CLOSE_WAIT_S,
        _describe_failure,
        _first_failure,
        _recorded_line,
    )

    failures = {rank: _timed_out(tmp_path, rank, 4) for rank in (0, 2)}
    for rank in (1, 3):
        failures[rank] = _process_failure(tmp_path, rank, -9, None)
        failures[rank].timestamp += TORCHRUN_CLOSE_WAIT_S
    rank, failure = _first_failure(failures)
    assert _describe_failure("toy", rank, failure, failures) == (
        "rank 0: collective all_gather_object timed out: write_completions "
        "(tunelab/training/grpo.py:251) waited 5 s (parallelism.collective_timeout_s) for ranks 1 and 3, "
        "which did not arrive (traceback in /out/logs/rank_0.log)"
    )
    # What the rank itself records (no launcher to tell it): with 2 ranks, the other one.
    assert (
        _timed_out(tmp_path, 0, 2)
        .error_file_data["message"]["message"]
        .endswith(
            "waited 5 s (parallelism.collective_timeout_s) for rank 1, which did not arrive "
            "(traceback in /out/logs/rank_0.log)"
        )
    )
    assert "for a rank that did not arrive" in _recorded_line(
        _timed_out(tmp_path, 0, 4).error_file_data
    )


@pytest.mark.slow
def test_run_error_on_every_rank_is_short(project):
    result = tunelab(
        "run",
        "--nproc_per_node",
        "2",
        project / "toy.py",
        "--config",
        project / "toy.yaml",
        "fail_ranks=[0,1]",
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    # One line: the launcher prints the message of the rank that failed first.
    assert lines in (
        ["tunelab: error: " + MESSAGE.format(0)],
        ["tunelab: error: " + MESSAGE.format(1)],
    ), lines


def test_run_validates_before_launching(project):
    line = one_error_line(
        tunelab("run", project / "toy.py", "--config", project / "toy.yaml", "stpes=1")
    )
    assert "did you mean 'steps'" in line
    assert not (project / "out").exists()


def test_torchrun_flag_list_is_torchs():
    from torch.distributed.run import get_args_parser

    from tunelab.cli._run import TORCHRUN_FLAGS

    flags = {
        name
        for action in get_args_parser()._actions
        if action.nargs == 0
        for name in action.option_strings
    }
    assert flags == TORCHRUN_FLAGS


@pytest.mark.parametrize(
    "options",
    [
        ["--nproc_per_node", "2"],
        ["--standalone", "--nproc-per-node=2"],
        ["-t", "3", "--nnodes", "1"],
    ],
)
def test_run_with_torchrun_options_says_a_config_error_before_importing_torch(project, options):
    # The recipe is found without torch's parser, so a typo costs no torch import (seconds).
    code = textwrap.dedent(
        f"""
        import sys
        from tunelab.cli._run import _run_command
        from tunelab.errors import TunelabError
        argv = {[*options, str(project / "toy.py"), "--config", str(project / "toy.yaml")]!r}
        try:
            _run_command([*argv, "stpes=1"], False)
        except TunelabError as error:
            print("torch" in sys.modules, error)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert result.stdout.startswith("False ") and "did you mean 'steps'" in result.stdout, result


def test_run_unknown_recipe_and_config(project):
    line = one_error_line(tunelab("run", "no_such_recipe", "--config", project / "toy.yaml"))
    assert "unknown recipe 'no_such_recipe'" in line
    line = one_error_line(tunelab("run", project / "missing.py", "--config", project / "toy.yaml"))
    assert "recipe file not found" in line
    line = one_error_line(tunelab("run", project / "toy.py", "--config", "no/such_config"))
    assert "unknown config 'no/such_config'" in line


def test_run_usage_errors_exit_2(project):
    result = tunelab("run", project / "toy.py")
    assert result.returncode == 2
    assert "--config" in result.stderr
    assert tunelab().returncode == 2


# --- eval (the short form of `run ... eval`) ---------------------------------------------------


def test_eval_is_run_eval_with_torchrun_options_before_config():
    from tunelab.cli._eval import as_run_arguments

    assert as_run_arguments(["--config", "tiny/eval", "limit=4"]) == [
        "eval", "--config", "tiny/eval", "limit=4",
    ]  # fmt: skip
    assert as_run_arguments(["--nproc_per_node", "2", "--config=tiny/eval", "limit=4"]) == [
        "--nproc_per_node", "2", "eval", "--config=tiny/eval", "limit=4",
    ]  # fmt: skip
    assert as_run_arguments(["--help"]) is None and as_run_arguments([]) is None


def test_eval_help_and_usage_error():
    result = tunelab("eval", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: tunelab eval ")
    assert tunelab("eval").returncode == 2
    assert "eval  " in tunelab("--help").stdout  # listed with the other commands


def test_eval_checks_the_config_against_the_eval_recipe(tmp_path):
    # A setting only the eval recipe has, out of its range: checked before anything starts.
    result = tunelab("eval", "--config", "tiny/eval", f"output_dir={tmp_path}", "limit=0")
    assert one_error_line(result) == "tunelab: error: key 'limit': expected int >= 1 | None, got 0"
    result = tunelab(
        "eval", "--nproc_per_node", "2", "--config", "tiny/eval", "tasks=[no/such/task.yaml]"
    )
    assert one_error_line(result) == (
        "tunelab: error: key 'tasks': task 'no/such/task.yaml': no such task file or folder"
    )


# --- download --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hub_env",
    [
        {"HF_HUB_OFFLINE": "1"},
        {
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_ETAG_TIMEOUT": "1",
            "HF_HUB_DOWNLOAD_TIMEOUT": "1",
        },
    ],
)
def test_download_offline_is_one_clear_line(tmp_path, hub_env):
    env = dict(ENV, HF_HOME=str(tmp_path / "hf_home"), **hub_env)
    env.pop("HF_TOKEN", None)
    result = tunelab(
        "download", "someone/some-model", "--output-dir", tmp_path / "model", env=env, timeout=60
    )
    line = one_error_line(result)
    assert line.startswith(
        "tunelab: error: cannot reach the Hugging Face hub to download someone/some-model: "
    )


def test_tunelab_is_installed():
    assert TUNELAB.is_file() or shutil.which("tunelab")


def test_the_launchers_rendezvous_method_names_are_torchs():
    # `tunelab run` replaces torch's get_method_name (inspect.stack(), 2-3 ms a call) with a
    # frame lookup: the rendezvous event log names the same methods.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name

    from tunelab.cli._run import _calling_method_name

    class Handler:
        def next_rendezvous(self, name):
            return self._record(name)

        def _record(self, name):
            return name()

    for depth in (1, 2, 3, 4):  # 0 would name the functions themselves
        theirs = Handler().next_rendezvous(lambda d=depth: get_method_name(d))
        ours = Handler().next_rendezvous(lambda d=depth: _calling_method_name(d))
        assert ours == theirs
    assert Handler().next_rendezvous(_calling_method_name) == "next_rendezvous"
    assert _calling_method_name(10_000) == get_method_name(10_000) == "no_method_name"
