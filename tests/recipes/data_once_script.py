"""Driven by test_data_once_per_machine.py under torchrun: who tokenizes a dataset.

Usage: data_once_script.py DATA_FILE BAD_FILE CACHE_DIR OUT_DIR NUM_PROC

Every process that tokenizes (a rank, or a worker process it starts) leaves a marker file
``OUT_DIR/markers/<pid>.json``; every rank writes ``OUT_DIR/rank_<r>.json`` with its pid, a
digest of the items it reads, and the error it got from a file with a malformed row.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

from tunelab._paths import assets_dir
from tunelab.data import chat_dataset, load_tokenizer
from tunelab.data.tokenizer import Tokenizer
from tunelab.distributed import destroy_distributed, init_distributed
from tunelab.errors import TunelabError

DATA, BAD, CACHE, OUT = (Path(arg) for arg in sys.argv[1:5])
NUM_PROC = int(sys.argv[5])
MARKERS = OUT / "markers"


def _counted(method):
    def wrapper(self, *args, **kwargs):
        marker = MARKERS / f"{os.getpid()}.json"
        if not marker.exists():
            identity = {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "local_rank": os.environ.get("LOCAL_RANK"),
            }
            marker.write_text(json.dumps(identity))
        return method(self, *args, **kwargs)

    return wrapper


def main() -> None:
    info = init_distributed("cpu")
    MARKERS.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(assets_dir() / "tiny")
    # Every way a row reaches the tokenizer; forked workers inherit the patched class.
    Tokenizer.encode = _counted(Tokenizer.encode)
    Tokenizer.encode_with_offsets = _counted(Tokenizer.encode_with_offsets)
    dataset = chat_dataset(tokenizer, source=str(DATA), num_proc=NUM_PROC, cache_dir=str(CACHE))
    items = json.dumps([dataset[i] for i in range(len(dataset))])
    error = None
    try:
        chat_dataset(tokenizer, source=str(BAD), cache_dir=str(CACHE))
    except TunelabError as caught:
        error = f"{type(caught).__name__}: {caught}"
    record = {
        "pid": os.getpid(),
        "items": len(dataset),
        "digest": hashlib.sha256(items.encode()).hexdigest(),
        "error": error,
    }
    (OUT / f"rank_{info.rank}.json").write_text(json.dumps(record))
    destroy_distributed()


if __name__ == "__main__":
    main()
