"""Driven by test_export_crash.py: write an HF export, optionally stalling mid-write.

Usage: export_crash_script.py {good,stall} BASE_DIR OUTPUT_DIR

A ``good`` export runs as well in the test's own process (:func:`export`); a stalled one is
killed, so it runs here.
"""

import sys
import time
from pathlib import Path

import tunelab.checkpoint.consolidate as consolidate
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.formats.hf import HFCheckpointReader


def export(mode: str, base: Path, out: Path) -> None:
    """Export ``base``'s weights to ``out`` (``stall``: doubled, stalling after one tensor)."""
    reader = HFCheckpointReader(base)
    state_dict = {key: reader.get(key) for key in reader.keys()}
    if mode == "stall":
        # Different weights, and a writer that stalls after its first tensor: the test kills
        # the process while the new export is half written.
        state_dict = {key: value * 2 for key, value in state_dict.items()}
        write_chunk = consolidate.write_chunk
        calls = []

        def stalling_write_chunk(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                print("STALLED", flush=True)
                time.sleep(120)
            return write_chunk(*args, **kwargs)

        consolidate.write_chunk = stalling_write_chunk
    save_hf_sharded(state_dict, out, fqn_to_file=reader.fqn_to_file, source_dir=base)


if __name__ == "__main__":
    export(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    print("WROTE", flush=True)
