"""lm-eval requests/s: tunelab's ``TunelabLM`` against lm-eval's own ``hf`` backend (issue 28).

Run (one process):
    python bench/bench_eval.py                  # the tiny model, the tiny_eval tasks
    python bench/bench_eval.py --repeats 1      # a smoke run

Both answer the same lm-eval requests on the same model folder (the embedded tiny Llama-style
model, fp32 on CPU, one thread): ``TunelabLM`` on tunelab's model, and ``HFLM`` (``lm_eval.models.
huggingface``, transformers' ``AutoModelForCausalLM``) with the same batch size. The requests
are the ones lm-eval builds for the local tasks in assets/tiny_eval (every document, zero-shot):

- ``loglikelihood``, multiple choice: ``tiny_next_number`` (4 one-token choices per question);
- ``loglikelihood``, answers: ``tiny_reverse_words_perplexity`` (a 3-5 word answer each);
- ``generate_until``: ``tiny_reverse_words`` (greedy, at most 16 tokens, stop at a newline).

Figures: requests per second, from the median of ``--repeats`` timed samples after one warm-up
(a sample is ``--sample-seconds`` of back-to-back calls on the task's requests; the two
backends alternate sample by sample, so load bursts hit them alike). Target: tunelab at least
1.5x the ``hf`` backend's requests/s.
"""

import argparse
import logging
import time
import warnings
from pathlib import Path

import torch

from _common import Row, median, parse_bench_args, print_table
from tunelab import _paths

TASKS = (
    ("multiple choice", "next_number.yaml"),
    ("answers", "reverse_words_perplexity.yaml"),
    ("generation", "reverse_words.yaml"),
)
TARGET = 1.5


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample-seconds", type=float, default=0.5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (the tiny model: 1)"
    )
    parser.add_argument("--dir", default=None, help="unused (run_all.py passes a scratch dir)")
    return parse_bench_args(parser, smoke=["--repeats", "1", "--sample-seconds", "0.05"])


def task_requests(path: Path) -> tuple[str, list]:
    """The request type and the requests lm-eval builds for every document of a task file."""
    from tunelab.eval import resolve_tasks

    specs, manager = resolve_tasks([str(path)])
    (task,) = manager.load(specs)["tasks"].values()
    task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(rank=0, world_size=1)
    requests = list(task.instances)
    return requests[0].request_type, requests


def main() -> None:
    """Time both backends on each task's requests and print the table."""
    from lm_eval.models.huggingface import HFLM

    from tunelab.data import load_tokenizer
    from tunelab.eval import TunelabLM
    from tunelab.models import load_pretrained

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    # The tiny model's matrices are too small to share out: a second thread only waits, and on
    # a loaded machine threads that spin for each other slow both backends many times over.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = _paths.assets_dir() / "tiny"
    ours = TunelabLM(
        load_pretrained(folder).eval(), load_tokenizer(folder), batch_size=args.batch_size
    )
    theirs = HFLM(pretrained=str(folder), dtype="float32", batch_size=args.batch_size, device="cpu")
    backends = {"tunelab": ours, "hf": theirs}
    rows, notes = [], []
    for label, name in TASKS:
        kind, requests = task_requests(_paths.assets_dir() / "tiny_eval" / name)
        warm = []
        for lm in backends.values():  # warm-up, and the time of one call
            start = time.perf_counter()
            getattr(lm, kind)(requests)
            warm.append(time.perf_counter() - start)
        # A timed sample is several calls in a row, about --sample-seconds long: one call of
        # the tiny model takes milliseconds, too short to time alone on a loaded machine.
        calls = max(1, round(args.sample_seconds / max(warm)))
        times: dict[str, list[float]] = {backend: [] for backend in backends}
        for _ in range(args.repeats):
            for backend, lm in backends.items():
                start = time.perf_counter()
                for _ in range(calls):
                    getattr(lm, kind)(requests)
                times[backend].append(time.perf_counter() - start)
        rate = {
            backend: calls * len(requests) / median(values) for backend, values in times.items()
        }
        ratio = rate["tunelab"] / rate["hf"]
        rows.append(
            Row(
                f"{kind}, {label} ({name.removesuffix('.yaml')}, {len(requests)} requests)",
                f"{rate['tunelab']:.0f} req/s",
                f"hf {rate['hf']:.0f} req/s",
                f"{ratio:.2f}x",
                f">= {TARGET}x",
                ratio >= TARGET,
            )
        )
    notes.append(
        f"The embedded tiny Llama-style model (3 layers, dim 128, vocab 810), fp32 on CPU, one "
        f"process, {torch.get_num_threads()} thread(s); batch size {args.batch_size} for both; "
        f"requests/s of the median of {args.repeats} samples (each about {args.sample_seconds} s "
        "of back-to-back calls on the task's requests) after a warm-up, the backends "
        "alternating sample by sample."
    )
    print_table("lm-eval requests/s: TunelabLM vs the hf backend (issue 28)", rows, notes)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    args = parse_args()
    main()
