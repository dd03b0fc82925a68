"""Driven by test_export_crash.py: a LoRA export (adapter + merged model), stalled on request.

Usage: reexport_crash_script.py {old,new} OUTPUT_DIR [STALL_POINT]

``old`` and ``new`` export different adapters (and so different merged weights) of the
embedded tiny model. With a stall point the process prints ``STALLED`` there and sleeps, and
the test kills it: ``adapter`` (while the new adapter is written), ``weights`` (while the
merged weights are written), ``swap`` (the export replaced, the old one not yet retired) and
``between_renames`` (no atomic exchange: the old export moved aside, the new one not yet in).
"""

import os
import sys
import time
from pathlib import Path

import torch

import tunelab.checkpoint.consolidate as consolidate
import tunelab.checkpoint.hf_sharded as hf_sharded
import tunelab.peft.peft_io as peft_io
from tunelab._paths import assets_dir
from tunelab.checkpoint.export import export_hf
from tunelab.config.lora import LoRAArgs
from tunelab.peft import get_adapter_params
from tunelab.training import load_model

MODE, OUT = sys.argv[1], Path(sys.argv[2])
STALL = sys.argv[3] if len(sys.argv) > 3 else None
BASE = assets_dir() / "tiny"


def stall() -> None:
    print("STALLED", flush=True)
    time.sleep(300)


def stall_on(module, name: str, *, at_call: int = 1, when=lambda *a, **k: True) -> None:
    original = getattr(module, name)
    calls = []

    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            calls.append(1)
            if len(calls) == at_call:
                stall()
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def main() -> None:
    model = load_model(
        str(BASE), device=torch.device("cpu"), dtype=torch.float32,
        lora=LoRAArgs(rank=4, alpha=8.0, targets=["q_proj", "v_proj"]),
    )  # fmt: skip
    torch.manual_seed(0 if MODE == "old" else 1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.normal_(std=0.02)  # B too: the merged weights differ between old and new
    if STALL == "adapter":
        stall_on(peft_io, "write_bytes", at_call=2)  # the adapter's weights written, not its config
    elif STALL == "weights":
        stall_on(consolidate, "write_chunk", at_call=2)
    elif STALL == "swap":
        stall_on(hf_sharded, "retire_folder")
    elif STALL == "between_renames":
        hf_sharded.exchange_paths = lambda first, second: False
        stall_on(os, "replace", when=lambda src, dst, **_: Path(dst) == OUT)
    export_hf(model, OUT, base_checkpoint_dir=BASE, lora=LoRAArgs(rank=4, alpha=8.0))
    print("WROTE", flush=True)


if __name__ == "__main__":
    main()
