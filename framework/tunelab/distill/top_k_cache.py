"""A precomputed teacher top-k, stored with the training dataset's tokenized cache.

Offline distillation with ``loss.top_k`` needs of the teacher only its ``k`` most likely
tokens at each scored position and its log-probs renormalised over them
(``DistillationLoss.teacher_support``). For a dataset trained over several epochs, or by
several students, these can be computed once: one pass of the teacher over the dataset
(``teacher.precompute_top_k: true``), after which the steps run no teacher forward and, when
neither validation nor on-policy steps need it, the teacher is not even loaded.

Where: ``{tokenized dataset cache folder}/teacher_top_k/{key}/``, so the cache lives and dies
with the tokenized table it indexes (same samples, same tokenizer). ``key`` is a hash of
everything that decides the values: the teacher's weights (XXH3-128 over its ``config.json``
and ``*.safetensors`` files), its dtype, the tokenizer (``Tokenizer.fingerprint``), ``top_k``,
the temperature, and the dataset (its cache folder's name and number of samples).

What: ``manifest.json`` (the same fields, and a size and XXH3-128 digest per file) and one
safetensors file per rank that computed it (``part-RRRRR-of-WWWWW.safetensors``): its
samples' dataset indices ``sample_index [n]``, the row offsets ``offsets [n + 1]``, and per
scored position of those samples (row-major, as the loss selects them) ``index [rows, k]``
(int32 token ids) and ``logps [rows, k]`` (float32). Only JSON and safetensors are read,
never a pickle. Opening checks every field of the manifest against the run's own (a cache
copied from another teacher, dtype, tokenizer, ``top_k``, temperature or dataset is refused in
one line naming the field) and every file against its digest, before a tensor is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from tunelab.errors import ConfigError, DataError
from tunelab.formats.integrity import check_file, record_problem
from tunelab.losses import DistillationLoss
from tunelab.training.loop import to_device
from tunelab.training.reference import rank_share

__all__ = ["TeacherTopKCache", "TopKCacheKey", "TopKCacheSpot"]

CACHE_FORMAT = 1
_MANIFEST = "manifest.json"
_MAX_MANIFEST_BYTES = 16 << 20
_PART = re.compile(r"part-\d{5}-of-\d{5}\.safetensors")
_READ_BYTES = 16 << 20
# What a refusal calls each field of the key.
_FIELD_NAMES = {
    "teacher": "teacher (its weights' checksum)",
    "teacher_dtype": "teacher dtype",
    "tokenizer": "tokenizer",
    "top_k": "loss.top_k",
    "temperature": "loss.temperature",
    "dataset": "dataset",
    "num_samples": "number of samples",
}


def _file_digest(path: Path, hasher: Any) -> None:
    with open(path, "rb") as file:
        while block := file.read(_READ_BYTES):
            hasher.update(block)


def teacher_weights_digest(folder: str | os.PathLike) -> str:
    """XXH3-128 over the names and bytes of a model folder's ``config.json`` and weights.

    Args:
        folder: The teacher's folder.

    Returns:
        The hex digest.

    Raises:
        ConfigError: If the folder holds no ``*.safetensors`` file.
    """
    root = Path(folder).expanduser()
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"teacher.path: no *.safetensors file in {root}")
    hasher = xxhash.xxh3_128()
    for path in [root / "config.json", *weights]:
        hasher.update(path.name.encode() + b"\0")
        _file_digest(path, hasher)
    return hasher.hexdigest()


@dataclass(frozen=True)
class TopKCacheKey:
    """Everything that decides a teacher top-k cache's values (its manifest records each).

    Attributes:
        teacher: The teacher's weights digest (:func:`teacher_weights_digest`).
        teacher_dtype: The dtype the teacher runs in.
        tokenizer: ``Tokenizer.fingerprint``.
        top_k: ``loss.top_k``.
        temperature: ``loss.temperature``.
        dataset: The name of the tokenized dataset's cache folder (its fingerprint).
        num_samples: Samples in the dataset.
    """

    teacher: str
    teacher_dtype: str
    tokenizer: str
    top_k: int
    temperature: float
    dataset: str
    num_samples: int

    def folder_name(self) -> str:
        """A short hash of the key: the cache's folder name."""
        text = json.dumps(asdict(self), sort_keys=True)
        return xxhash.xxh3_128(text.encode()).hexdigest()


@dataclass
class _Part:
    handle: Any
    name: str


class TeacherTopKCache:
    """The teacher's top-k of every scored position of a dataset, read per batch.

    Build with :meth:`open_or_build` (or :meth:`open`); batches find their rows through
    ``pair_index`` (``IndexedPairs``, ``Datasets(index_pairs=True)``).

    Args:
        folder: The cache folder.
        parts: The opened part files.
        locations: ``[num_samples, 3]`` int64: part, first row and end row of each sample.
    """

    def __init__(self, folder: Path, parts: list[_Part], locations: np.ndarray) -> None:
        self.folder, self._parts, self._locations = folder, parts, locations

    @staticmethod
    def locate(
        dataset: Any, tokenizer: Any, loss_fn: DistillationLoss, teacher_path: str, dtype: str
    ) -> TopKCacheSpot:
        """Where ``dataset``'s cache for this teacher and loss lives, and whether it exists.

        Every rank calls it (rank 0 hashes the teacher's weights and looks for the folder,
        and tells the others).

        Raises:
            ConfigError: Without ``loss.top_k``, or for a packed or streamed dataset.
        """
        if loss_fn.top_k is None:
            raise ConfigError(
                "teacher.precompute_top_k: needs loss.top_k (a cache of the whole vocabulary "
                "would be the teacher's logits)"
            )
        if getattr(getattr(dataset, "dataset", dataset), "packed", False):
            raise ConfigError(
                "teacher.precompute_top_k: the dataset is packed; the cache indexes samples, "
                "set packed: false"
            )
        dataset_folder = _dataset_folder(dataset)
        found: list[Any] = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            key = TopKCacheKey(
                teacher=teacher_weights_digest(teacher_path),
                teacher_dtype=str(dtype),
                tokenizer=tokenizer.fingerprint,
                top_k=int(loss_fn.top_k),
                temperature=float(loss_fn.temperature),
                dataset=dataset_folder.name,
                num_samples=len(dataset),
            )
            folder = dataset_folder / "teacher_top_k" / key.folder_name()
            found = [(key, (folder / _MANIFEST).is_file())]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        key, exists = found[0]
        return TopKCacheSpot(dataset_folder / "teacher_top_k" / key.folder_name(), key, exists)

    @classmethod
    def open(cls, folder: Path, key: TopKCacheKey) -> TeacherTopKCache:
        """Open a cache after checking its manifest against ``key`` and its files' digests.

        Raises:
            DataError: One line naming the folder and what is wrong: a field of another
                teacher, dtype, tokenizer, ``top_k``, temperature or dataset; a file that is
                missing or differs from its checksum; a malformed manifest or table.
        """
        manifest = _read_manifest(folder)
        for field, expected in asdict(key).items():
            stored = manifest.get(field)
            if stored != expected:
                raise DataError(
                    f"{folder}: teacher top-k cache of another {_FIELD_NAMES[field]} "
                    f"({stored!r}, this run: {expected!r}); delete the folder to recompute it"
                )
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            raise DataError(f"{folder / _MANIFEST}: no file records")
        parts, located = [], []
        for number, (name, record) in enumerate(sorted(files.items())):
            if not _PART.fullmatch(name) or record_problem(record) is not None:
                raise DataError(f"{folder / _MANIFEST}: malformed record of {name!r}")
            problem = check_file(folder / name, record)
            if problem is not None:
                raise DataError(f"{folder / name}: {problem}; delete the folder to recompute it")
            handle = safe_open(str(folder / name), framework="pt")
            samples = handle.get_tensor("sample_index").numpy()
            offsets = handle.get_tensor("offsets").numpy()
            index, logps = handle.get_slice("index"), handle.get_slice("logps")
            rows = int(offsets[-1]) if len(offsets) else -1
            if (
                len(offsets) != len(samples) + 1
                or offsets[0] != 0
                or (np.diff(offsets) < 0).any()
                or index.get_shape() != [rows, key.top_k]
                or logps.get_shape() != [rows, key.top_k]
                or index.get_dtype() != "I32"
                or logps.get_dtype() != "F32"
            ):
                raise DataError(f"{folder / name}: malformed teacher top-k table")
            parts.append(_Part(handle, name))
            part = np.full(len(samples), number)
            located.append(np.stack([samples, part, offsets[:-1], offsets[1:]], axis=1))
        table = np.concatenate(located)
        order = np.argsort(table[:, 0], kind="stable")
        if not np.array_equal(table[order, 0], np.arange(key.num_samples)):
            raise DataError(
                f"{folder}: the teacher top-k cache does not hold each of the dataset's "
                f"{key.num_samples} samples exactly once; delete the folder to recompute it"
            )
        return cls(folder, parts, table[order, 1:].astype(np.int64))

    @staticmethod
    @torch.no_grad()
    def compute_share(
        teacher: Any,
        loss_fn: DistillationLoss,
        loader: DataLoader,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's share of the teacher's top-k over the whole dataset (a collective).

        Rank ``r`` takes dataset indices ``r, r + world_size, ...`` (every rank runs the same
        number of forwards, as FSDP2 needs; fillers are dropped), collated by the loader's
        ``collate_fn`` in batches of its ``batch_size``.

        Returns:
            ``sample_index [n]``, ``offsets [n + 1]`` (int64), ``index [rows, k]`` (int32)
            and ``logps [rows, k]`` (float32), on the CPU.
        """
        dataset, batch_size = loader.dataset, loader.batch_size or 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        share, num_owned = rank_share(len(dataset), rank, world_size)
        samples, counts, indices, logps = [], [], [], []
        for start in range(0, len(share), batch_size):
            chunk = share[start : start + batch_size]
            batch = to_device(loader.collate_fn([dataset[i] for i in chunk]), device)
            index, values = loss_fn.teacher_support_rows(
                teacher.states(batch), batch["labels"], teacher.output
            )
            scored = (batch["labels"][:, 1:] != loss_fn.ignore_index).sum(-1).tolist()
            kept = min(len(chunk), max(num_owned - start, 0))
            num_rows = sum(scored[:kept])
            samples += chunk[:kept]
            counts += scored[:kept]
            indices.append(index[:num_rows].to(torch.int32).cpu())
            logps.append(values[:num_rows].float().cpu())
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        k = loss_fn.top_k
        return (
            torch.tensor(samples, dtype=torch.int64),
            offsets,
            torch.cat(indices) if indices else torch.zeros(0, k, dtype=torch.int32),
            torch.cat(logps) if logps else torch.zeros(0, k, dtype=torch.float32),
        )

    def rows(
        self, batch: dict[str, torch.Tensor], ignore_index: int = -100
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached ``(index, logps)`` of a batch's scored positions, on its device.

        Raises:
            DataError: If a sample's cached positions are not the batch's scored ones (the
                dataset changed under its cache).
        """
        scored = (batch["labels"][:, 1:] != ignore_index).sum(-1).tolist()
        indices, logps = [], []
        for sample, count in zip(batch["pair_index"].tolist(), scored, strict=True):
            part, start, end = (int(v) for v in self._locations[sample])
            if end - start != count:
                raise DataError(
                    f"{self.folder}: sample {sample} has {end - start} cached positions, the "
                    f"batch scores {count}; delete the folder to recompute it"
                )
            handle = self._parts[part].handle
            indices.append(handle.get_slice("index")[start:end])
            logps.append(handle.get_slice("logps")[start:end])
        device = batch["labels"].device
        return torch.cat(indices).long().to(device), torch.cat(logps).to(device)


@dataclass(frozen=True)
class TopKCacheSpot:
    """A teacher top-k cache's folder and key, and whether rank 0 found it there.

    Attributes:
        folder: ``{dataset cache folder}/teacher_top_k/{key hash}``.
        key: What its values depend on.
        exists: Whether the folder holds a finished cache (the same answer on every rank).
    """

    folder: Path
    key: TopKCacheKey
    exists: bool

    def open_or_build(
        self,
        teacher: Any,
        loss_fn: DistillationLoss,
        loader: DataLoader,
        device: torch.device,
    ) -> TeacherTopKCache:
        """Open the cache, first computing it with ``teacher`` when it does not exist (all ranks).

        Args:
            teacher: The frozen teacher (``tunelab.distill.Teacher``; unused, may be None, when
                the cache exists).
            loss_fn: The distillation loss (its ``top_k`` and temperature).
            loader: The training loader (its dataset and ``collate_fn``).
            device: The teacher's device.
        """
        if not self.exists:
            share = TeacherTopKCache.compute_share(teacher, loss_fn, loader, device)
            _write(self.folder, self.key, share)
        return TeacherTopKCache.open(self.folder, self.key)


def _dataset_folder(dataset: Any) -> Path:
    # The tokenized table's cache folder (the dataset may be wrapped, e.g. IndexedPairs).
    inner = getattr(dataset, "dataset", dataset)
    folder = getattr(inner, "cache_folder", None)
    if folder is None:
        raise ConfigError(
            "teacher.precompute_top_k: needs a dataset tokenized into the dataset cache "
            "(not streamed)"
        )
    return Path(folder)


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / _MANIFEST
    try:
        with open(path, "rb") as file:
            raw = file.read(_MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise DataError(f"{path}: unreadable teacher top-k manifest ({error})") from None
    if len(raw) > _MAX_MANIFEST_BYTES or not isinstance(manifest, dict):
        raise DataError(f"{path}: not a teacher top-k manifest")
    if manifest.get("format") != CACHE_FORMAT:
        raise DataError(
            f"{path}: teacher top-k cache format {manifest.get('format')!r}, this tunelab "
            f"reads {CACHE_FORMAT}; delete the folder to recompute it"
        )
    return manifest


def _record(path: Path) -> dict[str, Any]:
    hasher = xxhash.xxh3_128()
    _file_digest(path, hasher)
    size = path.stat().st_size
    return {"size": size, "ranges": [[0, size, hasher.hexdigest()]]}


def _write(folder: Path, key: TopKCacheKey, share: tuple[torch.Tensor, ...]) -> None:
    """Every rank writes its part into a private folder; rank 0 publishes it whole."""
    began = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    work = folder.parent / f".{folder.name}.{token[0]}.tmp"
    work.mkdir(parents=True, exist_ok=True)
    name = f"part-{rank:05d}-of-{world_size:05d}.safetensors"
    sample_index, offsets, index, logps = share
    tensors = {"sample_index": sample_index, "offsets": offsets, "index": index, "logps": logps}
    save_file({k: v.contiguous() for k, v in tensors.items()}, work / name, {"format": "pt"})
    records = [(name, _record(work / name), int(offsets[-1]))]
    if dist.is_initialized():
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, records[0])
        records = gathered
    status = ["ok"]
    if rank == 0:
        missing = [entry[0] for entry in records if not (work / entry[0]).is_file()]
        if missing:
            status = [
                f"{work}: {', '.join(missing)} missing: the dataset cache folder must be one "
                "every machine shares to precompute the teacher top-k"
            ]
        else:
            manifest = {"format": CACHE_FORMAT, **asdict(key)}
            manifest["files"] = {entry[0]: entry[1] for entry in records}
            text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
            with open(work / _MANIFEST, "w") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            try:
                os.rename(work, folder)
            except OSError:  # another run published the same cache first
                shutil.rmtree(work, ignore_errors=True)
            num_rows = sum(entry[2] for entry in records)
            print(
                f"teacher top-k (k={key.top_k}) of {key.num_samples} samples ({num_rows} "
                f"positions) precomputed in {time.perf_counter() - began:.1f} s: {folder}",
                flush=True,
            )
    if dist.is_initialized():
        dist.broadcast_object_list(status, src=0)
    if status[0] != "ok":
        raise DataError(status[0])
