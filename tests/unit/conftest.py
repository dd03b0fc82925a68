"""Unit-test fixtures."""

import json
import shutil

import pytest

from tunelab import _paths


@pytest.fixture(autouse=True, scope="session")
def _tokenized_datasets_in_a_temporary_cache(tmp_path_factory):
    """Datasets built by unit tests are cached in a temporary folder, not the user's cache.

    ``tunelab.data`` reads ``datasets.config.HF_DATASETS_CACHE`` whenever it builds one.
    """
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("datasets_cache")
    yield
    datasets.config.HF_DATASETS_CACHE = saved


@pytest.fixture(scope="session")
def tiny_long_context(tmp_path_factory):
    """The tiny model with a 131072-token context: a stand-in for the models the shipped
    configs are written for, whose lengths are checked against max_position_embeddings."""
    folder = tmp_path_factory.mktemp("tiny_long_context") / "model"
    shutil.copytree(_paths.assets_dir() / "tiny", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    return folder
