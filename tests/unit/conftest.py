"""Unit-test fixtures."""

import pytest


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
