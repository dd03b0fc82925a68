"""The files tunelab reads and writes, free of training state.

``hf`` reads Hugging Face safetensors checkpoints; ``integrity`` checksums files and verifies
them against their manifests; ``layout`` names the folders of a run (step checkpoints, exports,
temporary names, the commit marker) and finds the newest complete one; ``mxfp4`` decodes
gpt-oss's MXFP4 expert weights. Models, PEFT adapters, the run folder, checkpointing and the CLI
all read these formats, so they sit below every one of them. ``integrity`` and ``layout`` import
no torch: ``tunelab verify`` starts fast.
"""
