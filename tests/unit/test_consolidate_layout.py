"""Hand-checked byte layout of safetensors files (no process group, no I/O)."""

import json
import struct

import pytest
import torch

from tunelab.checkpoint._safetensors_layout import (
    TensorSpec,
    assign_files,
    build_file_layout,
    contiguous_runs,
)
from tunelab.errors import CheckpointError


def test_layout_orders_by_element_size_and_aligns():
    specs = [
        TensorSpec("a", torch.float32, (2, 3)),  # 24 bytes
        TensorSpec("b", torch.bfloat16, (3,)),  # 6 bytes
        TensorSpec("c", torch.int64, (2,)),  # 16 bytes
        TensorSpec("d", torch.bool, (5,)),  # 5 bytes
        TensorSpec("e", torch.float32, ()),  # 4 bytes, scalar
    ]
    layout = build_file_layout("x.safetensors", specs)
    (header_len,) = struct.unpack("<Q", layout.header[:8])
    assert header_len % 8 == 0 and len(layout.header) == 8 + header_len
    header = json.loads(layout.header[8:])
    assert header["__metadata__"] == {"format": "pt"}
    # 8-byte first, then the 4-byte tensors by name, then 2-byte, then 1-byte: no gaps.
    assert header["c"] == {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [16, 40]}
    assert header["e"] == {"dtype": "F32", "shape": [], "data_offsets": [40, 44]}
    assert header["b"] == {"dtype": "BF16", "shape": [3], "data_offsets": [44, 50]}
    assert header["d"] == {"dtype": "BOOL", "shape": [5], "data_offsets": [50, 55]}
    data_start = 8 + header_len
    assert layout.tensor_offsets == {
        "c": data_start,
        "a": data_start + 16,
        "e": data_start + 40,
        "b": data_start + 44,
        "d": data_start + 50,
    }
    assert layout.total_size == data_start + 55


def test_layout_rejects_unsupported_dtype():
    with pytest.raises(CheckpointError, match="'z'.*complex64"):
        build_file_layout("x.safetensors", [TensorSpec("z", torch.complex64, (2,))])


def test_runs_of_row_shard_are_one_range():
    starts, length = contiguous_runs((5, 3), (3, 0), (2, 3))
    assert list(starts) == [9] and length == 6


def test_runs_of_column_shard_are_one_per_row():
    starts, length = contiguous_runs((4, 6), (0, 2), (4, 3))
    assert list(starts) == [2, 8, 14, 20] and length == 3


def test_runs_of_middle_dim_shard():
    # shape (2, 3, 4), rows 1..2 of dim 1: runs of 2*4 elements at 1*4 and 12 + 1*4.
    starts, length = contiguous_runs((2, 3, 4), (0, 1, 0), (2, 2, 4))
    assert list(starts) == [4, 16] and length == 8


def test_runs_of_scalar_and_empty_chunk():
    starts, length = contiguous_runs((), (), ())
    assert list(starts) == [0] and length == 1
    starts, length = contiguous_runs((1, 4), (1, 0), (0, 4))
    assert list(starts) == [] and length == 0


def _specs(*sizes):
    return [TensorSpec(f"t{i}", torch.uint8, (size,)) for i, size in enumerate(sizes)]


def test_greedy_assignment_splits_by_size_in_key_order():
    files = assign_files(_specs(40, 40, 40, 150, 10), None, 100)
    names = {name: [s.name for s in group] for name, group in files.items()}
    assert names == {
        "model-00001-of-00004.safetensors": ["t0", "t1"],
        "model-00002-of-00004.safetensors": ["t2"],
        "model-00003-of-00004.safetensors": ["t3"],
        "model-00004-of-00004.safetensors": ["t4"],
    }


def test_greedy_assignment_single_file_is_model_safetensors():
    files = assign_files(_specs(40, 40), None, 100)
    assert list(files) == ["model.safetensors"]


def test_mapping_assignment_keeps_names_and_skips_unused_files():
    mapping = {
        "t0": "model-00002-of-00003.safetensors",
        "t1": "model-00001-of-00003.safetensors",
        "unused": "model-00003-of-00003.safetensors",
    }
    files = assign_files(_specs(4, 4), mapping, 1)
    assert {name: [s.name for s in group] for name, group in files.items()} == {
        "model-00001-of-00003.safetensors": ["t1"],
        "model-00002-of-00003.safetensors": ["t0"],
    }


def test_mapping_assignment_errors_name_the_key():
    with pytest.raises(CheckpointError, match="'t1'"):
        assign_files(_specs(4, 4), {"t0": "a.safetensors"}, 1)
    with pytest.raises(CheckpointError, match="'t0'.*'../a.safetensors'"):
        assign_files(_specs(4), {"t0": "../a.safetensors"}, 1)
