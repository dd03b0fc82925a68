"""The embedded tiny default: a small Llama-style model, its tokenizer and toy datasets.

The files live in ``tiny/`` next to this module and are produced by
``python -m tunelab.assets.build_tiny`` (see docs/data.md).
"""
