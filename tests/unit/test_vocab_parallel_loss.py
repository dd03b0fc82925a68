"""The vocabulary-split chunked log-probs (tensor parallelism) equal the whole-vocabulary ones.

``vocab_parallel_script.py`` (2 processes, gloo) runs ``hidden_target_logps`` with each rank
holding half of the output layer's rows against the whole layer: log-probs, logit sums and the
gradients (hidden states and weight), trainable and frozen output layers, 1 and 3 chunks. No
rank gathers the vocabulary: the split forward and backward run all-reduces only, each of at
most one value per scored position (a gather of the logits would carry vocab / 2 per position).
"""

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import torchrun

SCRIPT = Path(__file__).with_name("vocab_parallel_script.py")
TOLERANCE = 1e-6  # relative to each tensor's largest magnitude (fp32: ~1e-7 measured)


@pytest.mark.slow
def test_split_vocabulary_log_probs_and_gradients_equal_the_whole_ones():
    result = torchrun(SCRIPT, nproc=2)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4, result.stdout
    for row in rows:
        assert row["masked_zero"], row
        assert row["grad_scale"] > 1e-2, row  # not all zero
        assert row["collectives"] == ["all_reduce"], row
        assert 0 < row["largest_collective"] <= row["scored"], row
        for key in ("logps", "sums", "grad_hidden", "grad_weight"):
            if key in row:
                assert row[key] <= TOLERANCE, row
