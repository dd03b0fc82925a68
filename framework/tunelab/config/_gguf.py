"""Whether the installed ``gguf`` package can write a GGUF tensor type (``checkpoint.gguf_quantization``).

Here, below the file formats, so that a config naming a type the package cannot write is refused
when it is validated, before a run trains: ``tunelab.formats.gguf_model`` asks the same.
"""

from __future__ import annotations

import importlib.metadata


def gguf_quantizer_problem(quant: str) -> str | None:
    """Why the installed ``gguf`` package cannot write tensors of type ``quant`` (None: it can).

    ``f32`` and ``f16`` are plain casts; every other type needs the package's own quantizer (a
    class in ``gguf.quants`` named as the type, defining its own ``quantize_blocks``: gguf 0.19's
    ``Q4_K`` and ``Q6_K`` inherit one that raises), never one written here.

    Args:
        quant: A ``--quant`` name (``q8_0``, ``q4_k``, ...): the GGML type's name in lower case.
    """
    if quant in ("f32", "f16"):
        return None
    import gguf  # here: validating a config that exports no GGUF needs no gguf

    quantizer = getattr(gguf.quants, quant.upper(), None)
    if quantizer is None or "quantize_blocks" not in vars(quantizer):
        return (
            f"GGUF quantization {quant!r}: the installed gguf package "
            f"({importlib.metadata.version('gguf')}) has no quantizer for {quant.upper()}; write "
            "q8_0 or q4_0, or f16 and quantize it with llama.cpp's llama-quantize"
        )
    return None
