"""Driven by test_export_crash.py: a LoRA export (adapter + merged model), stalled on request.

Usage: reexport_crash_script.py {old,new} OUTPUT_DIR [STALL_POINT]

``old`` and ``new`` export different adapters (and so different merged weights) of the
embedded tiny model. With a stall point the process prints ``STALLED`` there and sleeps, and
the test kills it: ``adapter`` (while the new adapter is written), ``weights`` (while the
merged weights are written), ``swap`` (the export replaced, the old one not yet retired) and
``between_renames`` (no atomic exchange: the old export moved aside, the new one not yet in).
An export without a stall point runs as well in the test's own process (:func:`export`).
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


def export(mode: str, out: Path, stall_point: str | None = None) -> None:
    """The ``old`` or ``new`` LoRA export into ``out``, stalled at ``stall_point`` if given.

    The adapter's values come from their own generator: the caller's random state is left alone.
    """
    model = load_model(
        str(BASE), device=torch.device("cpu"), dtype=torch.float32,
        lora=LoRAArgs(rank=4, alpha=8.0, targets=["q_proj", "v_proj"]),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0 if mode == "old" else 1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            # B too: the merged weights differ between old and new.
            param.normal_(std=0.02, generator=generator)
    if stall_point == "adapter":
        stall_on(peft_io, "write_bytes", at_call=2)  # the adapter's weights written, not its config
    elif stall_point == "weights":
        stall_on(consolidate, "write_chunk", at_call=2)
    elif stall_point == "swap":
        stall_on(hf_sharded, "retire_folder")
    elif stall_point == "between_renames":
        hf_sharded.exchange_paths = lambda first, second: False
        stall_on(os, "replace", when=lambda src, dst, **_: Path(dst) == out)
    export_hf(model, out, base_checkpoint_dir=BASE, lora=LoRAArgs(rank=4, alpha=8.0))


if __name__ == "__main__":
    export(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    print("WROTE", flush=True)
