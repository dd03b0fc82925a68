"""grpo_distributed: the real ``tunelab run`` of tiny/grpo on 1 and 2 processes.

Each run writes every completion to ``logs/completions.jsonl`` and its metrics to
``logs/metrics.jsonl``; the tests compare those between runs. Runs are module-scoped.
"""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    RECIPE_TIMEOUT_S,
    TUNELAB,
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    run_env,
    torchrun,
    tunelab_run,
    wait_for,
)
from tunelab.lifecycle import STEP_LOGS

pytestmark = pytest.mark.slow

TINY_ASSETS = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"

# A short run that exercises every path: KL to the reference (a reference forward), stored old
# log-probs over two iterations, dynamic sampling, GRPO's sequence_mean.
VARIANTS = (
    "loss.beta=0.04",
    "rollout.num_iterations=2",
    "rollout.dynamic_sampling=true",
    "loss.aggregation=sequence_mean",
    "schedule.max_steps_per_epoch=3",
    "checkpoint.save_every_n_steps=null",
    "rollout.stop_strings=[You are]",
)


def completions(output_dir: Path) -> dict[tuple[int, int, int, int], tuple[str, float]]:
    """``(step, refill round, prompt index, sample) -> (completion, reward)``; a re-run step's
    last entry wins."""
    records = {}
    for line in (output_dir / "logs" / "completions.jsonl").read_text().splitlines():
        r = json.loads(line)
        records[r["step"], r.get("round", 0), r["index"], r["sample"]] = (
            r["completion"],
            r["reward"],
        )
    return records


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "two"
    tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={out}", "schedule.batch_size=2", *VARIANTS
    )
    return out


def test_two_processes_equal_one(two_processes, tmp_path):
    one = tmp_path / "one"
    tunelab_run(
        "grpo_distributed",
        "tiny/grpo",
        f"output_dir={one}",
        "schedule.batch_size=4",
        *VARIANTS,
        nproc=1,
    )
    # The same prompts per step, the same seeds per completion: the same tokens and rewards.
    assert completions(one) == completions(two_processes)
    assert len(completions(one)) == 3 * 4 * 4
    ours, theirs = read_metrics(two_processes), read_metrics(one)
    assert [m["step"] for m in ours] == [1, 2, 3]
    for a, b in zip(ours, theirs, strict=True):
        assert a["reward"] == b["reward"]
        assert a["kept_fraction"] == b["kept_fraction"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-6)
    assert any(m["kl"] > 0 for m in ours[1:])  # the policy moved away from the reference
    # The second pass over step 1's rollouts uses the stored old log-probs: ratios leave 1.
    assert ours[0]["clip_fraction"] > 0
    # Adam divides by the gradient's own scale: sums in another order differ by ~1e-5 after 5 steps.
    assert_same_exports(one, two_processes, atol=1e-4)


SIX_STEPS = ("schedule.max_steps_per_epoch=6", "checkpoint.save_every_n_steps=3")


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run of SIX_STEPS: the reference of the resumed runs."""
    out = tmp_path_factory.mktemp("grpo") / "six_steps"
    tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={out}", "schedule.batch_size=2", *SIX_STEPS
    )
    return out


def test_kill_and_resume_equals_the_uninterrupted_run(six_steps, tmp_path):
    assert_exact_resume(tmp_path, SIX_STEPS, full=six_steps)


def test_sigkill_of_rank_1_after_a_checkpoint_then_resume_logs_each_step_once(six_steps, tmp_path):
    """Issue 38: rank 1 SIGKILLed in a step after step_3 committed; the logs hold later steps.

    The resume starts from step_3 and logs steps 4-6 again: every per-step log (completions,
    metrics) must then hold each step once, as the uninterrupted run's do.
    """
    out = tmp_path / "killed"
    command = [
        TUNELAB, "run", "--nproc_per_node", "2", "grpo_distributed", "--config", "tiny/grpo",
        f"output_dir={out}", "schedule.batch_size=2", *SIX_STEPS,
    ]  # fmt: skip
    # Step 4's completions are written as it starts, after step_3 committed.
    assert sigkill_rank_1(command, out, at_step=4, printed=tmp_path / "killed.out") != 0
    committed = sorted(int(p.parent.name[5:]) for p in out.glob("step_*/tunelab_manifest.json"))
    assert committed == [3]
    assert max(_completion_steps(out)) > 3  # the logs hold steps past the checkpoint
    tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={out}", "schedule.batch_size=2", *SIX_STEPS,
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    assert_step_logs_equal(out, six_steps)
    assert_same_exports(out, six_steps)


def _completion_steps(output_dir: Path) -> set[int]:
    """The steps in ``completions.jsonl`` (a line still being written is skipped)."""
    path = output_dir / "logs" / "completions.jsonl"
    steps = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.add(json.loads(line)["step"])
        except ValueError:
            continue
    return steps


def _workers(output_dir: Path) -> list[int]:
    """The processes whose command line names ``output_dir`` (the launcher and its workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(output_dir).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue  # it ended while we looked
    return pids


def _rank(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), None)


def sigkill_rank_1(command: list[str], out: Path, *, at_step: int, printed: Path) -> int:
    """Launch ``command`` (a 2-process run into ``out``) and SIGKILL its rank 1 once step
    ``at_step``'s completions are logged (written as the step starts); the exit status."""
    with open(printed, "w+") as log:
        launched = subprocess.Popen(
            command, env=run_env(), stdout=log, stderr=log, start_new_session=True
        )
        try:
            wait_for(
                lambda: launched.poll() is not None or at_step in _completion_steps(out),
                RECIPE_TIMEOUT_S,
                f"step {at_step}'s completions",
            )
            rank_1 = [pid for pid in _workers(out) if _rank(pid) == "1"]
            assert launched.poll() is None and len(rank_1) == 1, printed.read_text()
            os.kill(rank_1[0], signal.SIGKILL)
            launched.wait(RECIPE_TIMEOUT_S)
        finally:
            if launched.poll() is None:
                os.killpg(launched.pid, signal.SIGKILL)
                launched.wait()
    return launched.returncode


def assert_step_logs_equal(output_dir: Path, reference: Path) -> None:
    """Every per-step log holds the reference run's records: each step once, in order.

    ``completions.jsonl`` line for line (the same tokens and rewards); the other logs by step
    and keys (their timings differ).
    """
    logs = [name for name in STEP_LOGS if (reference / "logs" / name).exists()]
    assert "completions.jsonl" in logs and "metrics.jsonl" in logs
    for name in logs:
        ours = (output_dir / "logs" / name).read_text().splitlines()
        theirs = (reference / "logs" / name).read_text().splitlines()
        if name == "completions.jsonl":
            assert ours == theirs, name
        keys = [(r["step"], sorted(r)) for r in map(json.loads, ours)]
        assert keys == [(r["step"], sorted(r)) for r in map(json.loads, theirs)], name


# Full fine-tuning with a KL to the base (a frozen copy), a greedy validation set every 2 steps
# and dynamic sampling refilled from extra prompts: neither may draw from what training
# samples, and a resume refills the same.
FULL = (
    "lora=null",
    "optimizer.lr=1e-4",
    "loss.beta=0.04",
    "schedule.max_steps_per_epoch=4",
    "checkpoint.save_every_n_steps=2",
    "rollout.dynamic_sampling=true",
    "rollout.dynamic_sampling_refill_rounds=2",
    "schedule.run_val_every_n_steps=2",
)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, tuple[str, ...]]:
    """The uninterrupted 2-process FULL run (read-only) and its overrides."""
    root = tmp_path_factory.mktemp("grpo_full")
    val = root / "val.jsonl"
    prompts = (Path(TINY_ASSETS) / "grpo_prompts.jsonl").read_text().splitlines()
    val.write_text("\n".join(prompts[-8:]) + "\n")
    val_dataset = (
        "val_dataset={_component_: tunelab.data.prompt_dataset, source: json, "
        f"data_files: {val}, template: instruct}}"
    )
    overrides = (*FULL, val_dataset)
    out = root / "full"
    tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={out}", "schedule.batch_size=2", *overrides
    )
    return out, overrides


def test_full_kill_and_resume_with_validation_and_refills(full_run, tmp_path):
    full, overrides = full_run
    assert_exact_resume(tmp_path, overrides, after_step=2, full=full)
    assert any(key[1] > 0 for key in completions(full))  # refill rounds ran
    metrics = read_metrics(full)
    assert {m["step"] for m in metrics if "val_reward" in m} == {2, 4}
    assert all(0 < m["kept_fraction"] <= 1 for m in metrics if "kept_fraction" in m)
    assert any(m["refill_prompts"] > 0 for m in metrics if "refill_prompts" in m)
    assert not (full / "epoch_0" / "adapter").exists()


def assert_exact_resume(
    tmp_path: Path, overrides: tuple[str, ...], after_step: int = 3, full: Path | None = None
) -> Path:
    """Run; kill after ``after_step``'s checkpoint; resume: the same completions, metrics, exports.

    The killed run's logs hold every step of the full run (a kill leaves the steps after its
    checkpoint logged): the resume trims them, so each per-step log holds every step once.
    ``full``: the uninterrupted run, if already made with ``overrides``.
    """
    if full is None:
        full = tmp_path / "full"
        tunelab_run(
            "grpo_distributed",
            "tiny/grpo",
            f"output_dir={full}",
            "schedule.batch_size=2",
            *overrides,
        )
    resumed = interrupted_copy(full, tmp_path / "resumed", after_step=after_step, keep_logs=True)
    tunelab_run(
        "grpo_distributed",
        "tiny/grpo",
        f"output_dir={resumed}",
        "schedule.batch_size=2",
        *overrides,
        "checkpoint.resume_from_checkpoint=true",
    )
    assert completions(resumed) == completions(full)  # token for token
    assert_step_logs_equal(resumed, full)
    after = [m for m in read_metrics(resumed) if m["step"] > after_step]
    before = [m for m in read_metrics(full) if m["step"] > after_step]
    assert [sorted(m) for m in after] == [sorted(m) for m in before]
    for ours, theirs in zip(after, before, strict=True):
        for key in ("loss", "reward", "kept_fraction", "val_reward"):
            assert ours.get(key) == theirs.get(key), (ours["step"], key)
    assert_same_exports(resumed, full)
    return full


def test_reward_rises_and_not_with_a_vanishing_learning_rate(tmp_path):
    def rewards(lr: str) -> list[float]:
        out = tmp_path / f"lr_{lr}"
        tunelab_run(
            "grpo_distributed", "tiny/grpo", f"output_dir={out}", "schedule.batch_size=2",
            f"optimizer.lr={lr}", "checkpoint.save_every_n_steps=null",
        )  # fmt: skip
        return [m["rewards/regex_reward"] for m in read_metrics(out)]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    # lr must be > 0: 1e-12 moves no completion (Adam steps are about lr in size).
    learned, frozen = rewards("3e-3"), rewards("1e-12")
    assert len(learned) == len(frozen) == 30
    assert mean(learned[-10:]) > mean(learned[:10]) + 0.3
    assert mean(learned[-10:]) > mean(frozen[-10:]) + 0.3
    assert abs(mean(frozen[-10:]) - mean(frozen[:10])) < 0.2


def _assert_kl_to_the_base(out: Path, *, adapter: bool) -> None:
    """The reference is the base (QLoRA: the NF4 base with the adapters disabled; full: a
    frozen copy): the policy itself at step 1, then apart from it."""
    kl = [m["kl"] for m in read_metrics(out) if "loss" in m]
    assert kl[0] == 0.0 and kl[1] > 0
    assert (out / "epoch_0" / "adapter" / "adapter_model.safetensors").is_file() == adapter
    assert (out / "epoch_0" / "model.safetensors").is_file()


def test_qlora_with_a_kl_to_the_base(tmp_path):
    out = tmp_path / "qlora"
    tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={out}", "schedule.batch_size=2",
        "lora.quantize_base=nf4", "loss.beta=0.04", "schedule.max_steps_per_epoch=3",
        "checkpoint.save_every_n_steps=null",
    )  # fmt: skip
    _assert_kl_to_the_base(out, adapter=True)


def test_full_with_a_kl_to_the_base(full_run):
    _assert_kl_to_the_base(full_run[0], adapter=False)


def test_rollouts_gather_the_shards_once_per_phase():
    result = torchrun(Path(__file__).parent / "rollout_gather_script.py")
    reports = [
        json.loads(line.removeprefix("GATHERS "))
        for line in result.stdout.splitlines()
        if line.startswith("GATHERS ")
    ]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        for name in ("lora", "full"):
            r = report[name]
            assert r["equal"], name  # the same tokens either way
            # Gathered per forward, the ranks agree to stop after each token (one all-reduce
            # per decode step); held, a forward is local and each rank runs as many as its
            # own rows need (here 3 more on rank 1), with no all-reduce at all.
            assert r["per_forward_all_reduces"] == r["forwards"] - 1, (name, r)
            assert r["uneven_all_reduces"] == 0, (name, r)
            assert r["uneven_lengths"] == [r["forwards"] + 3 * report["rank"]], (name, r)
            # Held: each group at most once for the whole phase (the root's stays gathered
            # between phases when it holds nothing trainable, as after any no_grad forward).
            assert r["held_blocks"] == r["layers"], (name, r)
            assert r["held"] <= r["groups"], (name, r)
            # Per forward: every decode step re-gathers each block except the last (kept
            # gathered for the backward by shard_model).
            decode_steps = r["forwards"] - 1
            assert r["per_forward_blocks"] == r["layers"] + decode_steps * (r["layers"] - 1)
