"""llama.cpp's ``convert_hf_to_gguf.py``, fetched once and run as a user would, for bench_gguf.

The converter is not in the ``gguf`` package; it ships in llama.cpp's repository and, with it,
in the source distribution of ``llama-cpp-python`` on PyPI (``vendor/llama.cpp/``). The first
run downloads that sdist with pip (the installed ``llama_cpp`` version), keeps the script, its
``conversion/`` package, its sibling ``gguf-py/`` and the licence under
``~/.cache/tunelab-bench/llama.cpp-<version>/`` (``$XDG_CACHE_HOME`` if set), and installs the
converter's own requirement ``sentencepiece`` there (``pip install --target``) when the
environment lacks it. Nothing is committed to the repository.

One change to the converter's run, printed by the bench: its check of the BPE pre-tokenizer
(the hash of a test string's token ids, matched against the vocabularies of published models)
cannot know the bench's random tokenizer, so the launcher answers it with the name tunelab's
export wrote (``tokenizer.ggml.pre``). The tensors are converted by the converter's own code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

_DEFAULT_VERSION = "0.3.36"
_KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
# Runs the converter in this interpreter with its own gguf-py first on the path (as the script
# does itself), answers the pre-tokenizer check, and reports the seconds and CPU seconds of the
# conversion proper (after the imports) to a JSON file.
_LAUNCHER = """
import json, os, runpy, sys, time
script, pre, report = sys.argv[1], sys.argv[2], sys.argv[3]
root = os.path.dirname(script)
sys.path[:0] = [root, os.path.join(root, "gguf-py")]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [script] + sys.argv[4:]
start, cpu = time.perf_counter(), time.process_time()
runpy.run_path(script, run_name="__main__")
out = sys.argv[sys.argv.index("--outfile") + 1]
fd = os.open(out, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
with open(report, "w") as handle:
    json.dump({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}, handle)
"""


@dataclass(frozen=True)
class Converter:
    """A prepared converter: the script and the extra module folder its run needs."""

    script: Path
    python_path: str
    version: str


@dataclass(frozen=True)
class Conversion:
    """One timed run of the converter."""

    seconds: float
    """Wall time of the whole process (interpreter start and imports included)."""
    cpu: float
    """CPU seconds of the whole process (user + system)."""
    convert_seconds: float
    """Wall time of the conversion proper, after the imports (with the output's fsync)."""
    convert_cpu: float
    """CPU seconds of the conversion proper."""


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/tunelab-bench`` (default ``~/.cache/tunelab-bench``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tunelab-bench"


def _version() -> str:
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return _DEFAULT_VERSION


def _pip(*args: str) -> str | None:
    """Run pip in this interpreter; None, or the last line of its output on failure."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode == 0:
        return None
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"pip exited {done.returncode}"


def _extract(archive: Path, target: Path) -> None:
    """Unpack the converter's files from the sdist into ``target`` (prefix stripped)."""
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/vendor/llama.cpp/", 1)
            if (
                len(parts) == 2
                and parts[1].startswith(_KEPT)
                and (member.isfile() or member.isdir())
            ):
                member.name = parts[1]
                members.append(member)
        tar.extractall(target, members=members, filter="data")


def prepare(download: bool) -> Converter | str:
    """The cached converter, fetching it first when ``download``; else why it cannot run.

    Returns:
        The converter, or a one-line reason (``"not run: ..."`` is the caller's to print).
    """
    version = _version()
    home = cache_root() / f"llama.cpp-{version}"
    script = home / "convert_hf_to_gguf.py"
    deps = home / "deps"
    if not script.is_file():
        if not download:
            return f"llama.cpp's converter is not cached in {home} (run once without --smoke)"
        home.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=home.parent) as scratch:
            problem = _pip("download", f"llama-cpp-python=={version}", "--no-deps",
                           "--no-binary", ":all:", "-d", scratch)  # fmt: skip
            if problem is not None:
                return f"pip download llama-cpp-python=={version} (sdist) failed: {problem}"
            archives = list(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
            if not archives:
                return f"pip download llama-cpp-python=={version} gave no source archive"
            staging = Path(scratch) / "converter"
            _extract(archives[0], staging)
            if not (staging / "convert_hf_to_gguf.py").is_file():
                return f"llama-cpp-python {version}'s sdist holds no vendor/llama.cpp/convert_hf_to_gguf.py"
            shutil.rmtree(home, ignore_errors=True)
            os.replace(staging, home)
    if importlib.util.find_spec("sentencepiece") is None and not (deps / "sentencepiece").is_dir():
        if not download:
            return f"convert_hf_to_gguf.py needs sentencepiece, not installed nor in {deps}"
        problem = _pip("install", "--quiet", "--target", str(deps), "sentencepiece>=0.1.98,<0.3.0")
        if problem is not None:
            return f"convert_hf_to_gguf.py needs sentencepiece; pip install failed: {problem}"
    missing = [name for name in ("transformers", "yaml") if importlib.util.find_spec(name) is None]
    if missing:
        return f"convert_hf_to_gguf.py needs {', '.join(missing)}, not installed"
    return Converter(script, str(deps), version)


def convert(converter: Converter, model: Path, out: Path, pre_tokenizer: str) -> Conversion | str:
    """Run the converter on ``model`` to an f16 ``out``, timed; or the reason it failed."""
    report = out.with_suffix(".time.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [converter.python_path, *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
    command = [sys.executable, "-c", _LAUNCHER, str(converter.script), pre_tokenizer, str(report),
               str(model), "--outtype", "f16", "--outfile", str(out)]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not report.is_file():
        lines = (done.stdout + done.stderr).strip().splitlines()
        return f"convert_hf_to_gguf.py exited {done.returncode}: {lines[-1] if lines else ''}"
    inner = json.loads(report.read_text())
    report.unlink()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Conversion(seconds, cpu, inner["seconds"], inner["cpu"])
