"""Driven by test_export_crash.py: write an HF export, optionally stalling mid-write.

Usage: export_crash_script.py {good,stall} BASE_DIR OUTPUT_DIR
"""

import sys
import time
from pathlib import Path

import tunelab.checkpoint.consolidate as consolidate
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.formats.hf import HFCheckpointReader

MODE, BASE, OUT = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])


def main() -> None:
    reader = HFCheckpointReader(BASE)
    state_dict = {key: reader.get(key) for key in reader.keys()}
    if MODE == "stall":
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
    save_hf_sharded(state_dict, OUT, fqn_to_file=reader.fqn_to_file, source_dir=BASE)
    print("WROTE", flush=True)


if __name__ == "__main__":
    main()
