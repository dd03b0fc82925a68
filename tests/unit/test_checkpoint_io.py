"""Step checkpoint I/O at the disk's speed: each byte read once, verified as it arrives.

A real ``CheckpointClient`` on a one-process gloo group saves a fully fine-tuned model
(weights and AdamW moments) of a few MB; the resume is measured by the kernel's own count of
bytes read (``/proc/self/io``: ``rchar``) and checked against the saved state exactly.
"""

import json

import pytest
import torch

from tunelab.checkpoint._tensor_files import ContentMismatch
from tunelab.formats import integrity
from tunelab.lifecycle.run_folder import CommittedCheckpoint


def _bytes_read() -> int:
    with open("/proc/self/io") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("rchar:"))


@pytest.fixture
def saved(world_of_one, tmp_path):
    """A client with a committed step_1 of a full fine-tune; the state it saved."""
    transformers = pytest.importorskip("transformers")
    from tunelab.checkpoint import CheckpointClient
    from tunelab.training import load_model

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"), device=torch.device("cpu"), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3, 4]])).square().mean().backward()
    optimizer.step()
    client = CheckpointClient(
        tmp_path / "out",
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=tmp_path / "base",
    )
    client.save(1, 0, {"note": "one"}, blocking=True)
    state = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {
            (i, k): v.clone()
            for i, group in enumerate(optimizer.state.values())
            for k, v in group.items()
        },
    }
    yield client, state
    client.close()


def _scramble(client):
    with torch.no_grad():
        for param in client.model.parameters():
            param.normal_()
        for group in client.optimizer.state.values():
            for value in group.values():
                value.add_(1.0)


def _assert_restored(client, state):
    for key, value in client.model.state_dict().items():
        assert torch.equal(value, state["model"][key]), key
    for i, group in enumerate(client.optimizer.state.values()):
        for key, value in group.items():
            assert torch.equal(value, state["optimizer"][(i, key)]), (i, key)


def test_a_resume_reads_each_byte_of_the_checkpoint_once(saved):
    client, state = saved
    step = client.output_dir / "step_1"
    data_bytes = sum(p.stat().st_size for p in step.glob("*.distcp"))
    all_bytes = sum(p.stat().st_size for p in step.iterdir())
    assert data_bytes > 4_000_000  # the tensors dominate: a second read would show
    _scramble(client)
    before = _bytes_read()
    resumed = client.load_latest()
    read = _bytes_read() - before
    assert resumed.step == 1 and resumed.progress == {"note": "one"}
    _assert_restored(client, state)
    # Verified and loaded in one pass: every data byte once, the small files (metadata,
    # trainer state, manifest: read a few times each, a few KB) on top. The verify-then-load
    # of before read the data twice.
    assert data_bytes <= read < data_bytes + 4 * (all_bytes - data_bytes) + 200_000, (
        read,
        data_bytes,
    )


def test_a_flipped_bit_found_while_loading_moves_the_checkpoint_aside(saved):
    client, state = saved
    _scramble(client)
    client.save(2, 0, {"note": "two"}, blocking=True)
    data = client.output_dir / "step_2" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))
    resumed = client.load_latest()
    # The load found it (nothing read the data before the load), fell back to step_1 and
    # restored it exactly: the bytes of step_2 it had copied before the flip are overwritten.
    assert resumed.step == 1
    _assert_restored(client, state)
    assert [p.name.startswith("step_2.corrupt-") for p in client.output_dir.iterdir()].count(True)


def test_ranges_no_load_read_are_verified_after_it(saved):
    client, _ = saved
    step = client.output_dir / "step_1"
    manifest = json.loads((step / integrity.MANIFEST_NAME).read_text())
    checkpoint = CommittedCheckpoint(1, step, manifest)
    client._verify_unread(checkpoint, set())  # intact: nothing to say
    ranges = manifest["files"]["__0_0.distcp"]["ranges"]
    offset, length, _ = ranges[len(ranges) // 2]
    with open(step / "__0_0.distcp", "r+b") as file:
        file.seek(offset + length - 1)
        byte = file.read(1)
        file.seek(offset + length - 1)
        file.write(bytes([byte[0] ^ 1]))
    everything_else = {("__0_0.distcp", start) for start, _, _ in ranges if start != offset}
    client._verify_unread(checkpoint, everything_else | {("__0_0.distcp", offset)})
    with pytest.raises(ContentMismatch, match=rf"bytes {offset}\.\.{offset + length}"):
        client._verify_unread(checkpoint, everything_else)


def test_pruning_runs_after_the_commit_and_a_wait_joins_it(world_of_one, saved):
    client, _ = saved
    client.keep_last_n = 1
    client.save(2, 0, {}, blocking=True)
    assert (client.output_dir / "step_2" / integrity.MANIFEST_NAME).is_file()
    client.wait()
    assert not (client.output_dir / "step_1").exists()


def test_items_larger_than_a_read_piece_are_verified_to_their_last_byte(saved, monkeypatch):
    from tunelab.checkpoint import _tensor_files

    client, state = saved
    # The resume reads a large item in pieces (64 MB); at 48 KB this model's largest items
    # take 11 pieces, the last one short.
    monkeypatch.setattr(_tensor_files, "_READ_PIECE_BYTES", 48 << 10)
    _scramble(client)
    assert client.load_latest().step == 1
    _assert_restored(client, state)

    _scramble(client)
    client.save(2, 0, {"note": "two"}, blocking=True)
    step = client.output_dir / "step_2"
    manifest = json.loads((step / integrity.MANIFEST_NAME).read_text())
    name, offset, length = max(
        ((name, offset, length) for name, record in manifest["files"].items()
         if name.endswith(".distcp") for offset, length, _ in record["ranges"]),
        key=lambda found: found[2],
    )  # fmt: skip
    assert length > 10 * (48 << 10)
    with open(step / name, "r+b") as file:  # a byte of the item's last piece
        file.seek(offset + length - 3)
        byte = file.read(1)
        file.seek(offset + length - 3)
        file.write(bytes([byte[0] ^ 0x01]))
    assert client.load_latest().step == 1  # step_2 failed its checksum and was moved aside
    _assert_restored(client, state)


def _cached(path, length: int) -> bool:
    """Whether the first ``length`` bytes of ``path`` are all in the page cache."""
    return all(_resident(path, length))


def _resident(path, length: int) -> list[bool]:
    """Which pages of the first ``length`` bytes of ``path`` are in the page cache.

    Asked with ``mincore`` on a mapping that is never touched: a read (even ``RWF_NOWAIT``)
    would itself start the kernel's read-ahead.
    """
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = -(-length // mmap.PAGESIZE)
    with open(path, "rb") as file:
        address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            resident = ctypes.create_string_buffer(pages)
            assert libc.mincore(address, length, resident) == 0, os.strerror(ctypes.get_errno())
            return [bool(byte & 1) for byte in resident.raw]
        finally:
            libc.munmap(address, length)


def test_the_resume_asks_the_disk_for_its_own_files_while_it_plans(saved, monkeypatch):
    import os
    import time

    from tunelab.checkpoint import dcp
    from tunelab.checkpoint.dcp import SafeReader

    # Direct reads bypass the page cache: a prefetch would bring the heads from disk twice.
    assert dcp.DIRECT_READS  # the default

    client, _ = saved
    step = client.output_dir / "step_1"
    manifest = json.loads((step / integrity.MANIFEST_NAME).read_text())
    reader = SafeReader(step, manifest["files"])
    reader.read_metadata()
    data_files = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert data_files
    # The world size that saved: this rank reads its own files whole. Another world size
    # reads chunks that only the plan knows: nothing is asked.
    assert reader.files_to_prefetch(0, 1) == data_files
    assert reader.files_to_prefetch(0, 2) == []
    assert reader.prefetch(0, 2) is None
    assert reader.prefetch(0, 1) is None  # direct reads: nothing asked of the page cache
    monkeypatch.setattr(dcp, "DIRECT_READS", False)  # buffered reads: the heads are asked

    head = 64 << 10
    for name in data_files:
        with open(step / name, "rb") as file:
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if any(_cached(step / name, head) for name in data_files):
        pytest.skip("this file system keeps the files in memory (tmpfs?): nothing to prefetch")
    reader.prefetch(0, 1).join()  # the reads are queued; wait for their pages to arrive
    deadline = time.monotonic() + 60
    while not all(_cached(step / name, head) for name in data_files):
        assert time.monotonic() < deadline, "the prefetched heads never reached the page cache"
        time.sleep(0.01)


def _direct_io_taken(folder) -> bool:
    import os

    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except (AttributeError, OSError):
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


def _mixed_tensors() -> list[torch.Tensor]:
    """Items small and large, of several dtypes, whose bytes end off any block boundary."""
    generator = torch.Generator().manual_seed(3)
    sizes = [3, 1000, 700_001, 17, 1_300_003, 64, 1, 40_000]
    tensors = [torch.randn(n, generator=generator) for n in sizes]
    tensors.insert(2, torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=generator))
    tensors.append(torch.randn(33, 7, generator=generator).to(torch.bfloat16))
    return tensors


def test_direct_writes_store_the_buffered_bytes_and_fill_no_page_cache(tmp_path, monkeypatch):
    """The O_DIRECT writer: the same file and digests as buffered writes, around the cache."""
    from tunelab.checkpoint import _tensor_files

    if not _direct_io_taken(tmp_path):
        pytest.skip("this file system does not take O_DIRECT: saves are written buffered")
    # Chunks of 256 KB: items and 2 MB pieces cross many chunk boundaries.
    monkeypatch.setattr(_tensor_files, "DIRECT_CHUNK", 256 << 10)
    tensors = _mixed_tensors()
    direct = _tensor_files.write_tensor_file(tmp_path / "direct", tensors, sync=True)
    buffered = _tensor_files.write_tensor_file(
        tmp_path / "buffered", tensors, sync=True, direct=False
    )
    size = (tmp_path / "direct").stat().st_size
    assert size % _tensor_files.DIRECT_ALIGN  # the padded last chunk was cut to the length
    # The control shows the probe can see cached pages; the direct file has none.
    assert all(_resident(tmp_path / "buffered", size))
    assert not any(_resident(tmp_path / "direct", size))
    assert direct == buffered
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    places, _ = direct
    for tensor, (offset, length) in zip(tensors, places, strict=True):
        stored = (tmp_path / "direct").read_bytes()[offset : offset + length]
        assert stored == bytes(_tensor_files.tensor_bytes(tensor))


def test_a_direct_write_the_kernel_refuses_is_written_again_buffered(tmp_path, monkeypatch):
    """Mid-file EINVAL (an alignment the device does not take): the file starts over."""
    from tunelab.checkpoint import _tensor_files

    if not _direct_io_taken(tmp_path):
        pytest.skip("this file system does not take O_DIRECT: saves are written buffered")
    # Whole 256 KB chunks are accepted; the last one, padded only to 8 bytes, is refused by
    # the kernel (no device here takes direct writes of less than 512 bytes).
    monkeypatch.setattr(_tensor_files, "DIRECT_CHUNK", 256 << 10)
    monkeypatch.setattr(_tensor_files, "DIRECT_ALIGN", 8)
    buffered_calls = []
    real = _tensor_files._write_items
    monkeypatch.setattr(
        _tensor_files, "_write_items", lambda *args: buffered_calls.append(1) or real(*args)
    )
    tensors = _mixed_tensors()
    written = _tensor_files.write_tensor_file(tmp_path / "retried", tensors, sync=True)
    assert buffered_calls == [1]
    monkeypatch.setattr(_tensor_files, "DIRECT_ALIGN", 4096)
    again = _tensor_files.write_tensor_file(tmp_path / "direct", tensors, sync=True)
    assert buffered_calls == [1]  # aligned: direct, no second try
    assert written == again
    assert (tmp_path / "retried").read_bytes() == (tmp_path / "direct").read_bytes()


def test_step_saves_write_around_the_page_cache(saved):
    """A client's saves take the O_DIRECT writer: no data file's page is cached after one."""
    client, _ = saved
    step = client.output_dir / "step_1"
    if not _direct_io_taken(step):
        pytest.skip("this file system does not take O_DIRECT: saves are written buffered")
    data_files = sorted(step.glob("*.distcp"))
    assert data_files
    for path in data_files:
        assert not any(_resident(path, path.stat().st_size)), path.name


def _file_system(path) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it)."""
    import os

    path, best = os.path.realpath(path), ("", "")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            if (path + "/").startswith(point.rstrip("/") + "/") and len(point) > len(best[0]):
                best = (point, kind)
    return best[1]


def test_a_data_file_has_its_blocks_reserved_before_its_first_write(tmp_path):
    """``preallocate``: one request for the whole length, so writers in parallel threads do
    not interleave their files' extents (what a resume then reads in one stream)."""
    import os

    from tunelab.checkpoint._safetensors_layout import preallocate

    fd = os.open(tmp_path / "data", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        preallocate(fd, 8 << 20)
        status = os.fstat(fd)
    finally:
        os.close(fd)
    if status.st_size == 0 and _file_system(tmp_path) not in {"ext4", "xfs", "btrfs", "tmpfs"}:
        pytest.skip("this file system does not take fallocate: the hint is a no-op")
    assert status.st_size == 8 << 20
    assert status.st_blocks * 512 >= 8 << 20  # reserved, not a sparse hole


def _wants_for(tensors, record, chosen, *, into: bool, got: dict):
    """Wants for the ``chosen`` items of a file written from ``tensors`` (bytes into ``got``)."""
    from tunelab.checkpoint._tensor_files import Want, tensor_bytes

    wants = []
    position = 0
    for number, (start, length, digest) in enumerate(record["ranges"]):
        size = tensors[number].numel() * tensors[number].element_size()
        skip = length - size
        position = start + length
        if number not in chosen:
            continue
        target = tensor_bytes(torch.empty_like(tensors[number])) if into else None
        wants.append(Want(start, length, digest, skip, target,
                          lambda data, number=number: got.__setitem__(number, bytes(data))))  # fmt: skip
    assert position == record["size"]
    return wants


@pytest.mark.parametrize("into", [True, False])
def test_direct_reads_deliver_every_wanted_item_verified(tmp_path, monkeypatch, into):
    """Whole files and sparse picks (gaps under and over a stream's gap), windows of 256 KB."""
    from tunelab.checkpoint import _tensor_files

    if not _direct_io_taken(tmp_path):
        pytest.skip("this file system does not take O_DIRECT: resumes read buffered")
    monkeypatch.setattr(_tensor_files, "_DIRECT_READ_BYTES", 256 << 10)
    tensors = _mixed_tensors()
    _, record = _tensor_files.write_tensor_file(tmp_path / "data", tensors, sync=True)
    size = record["size"]
    # All; then every other item (gaps of a few bytes to 2.8 MB: over _DIRECT_GAP_BYTES).
    for chosen in (set(range(len(tensors))), set(range(0, len(tensors), 2)), {len(tensors) - 1}):
        got: dict[int, bytes] = {}
        wants = _wants_for(tensors, record, chosen, into=into, got=got)
        _tensor_files.read_wanted(tmp_path / "data", size, wants, direct=True)
        assert sorted(got) == sorted(chosen)
        for number in chosen:
            assert got[number] == bytes(_tensor_files.tensor_bytes(tensors[number])), number
    assert not any(_resident(tmp_path / "data", size))  # read around the page cache

    # A flipped byte in the last piece of the largest item is found on the way.
    largest = max(range(len(tensors)), key=lambda number: tensors[number].numel())
    start, length, _ = record["ranges"][largest]
    with open(tmp_path / "data", "r+b") as file:
        file.seek(start + length - 5)
        byte = file.read(1)
        file.seek(start + length - 5)
        file.write(bytes([byte[0] ^ 0x04]))
    got = {}
    wants = _wants_for(tensors, record, set(range(len(tensors))), into=into, got=got)
    with pytest.raises(ContentMismatch, match=rf"bytes {start}\.\.{start + length}"):
        _tensor_files.read_wanted(tmp_path / "data", size, wants, direct=True)
    assert largest not in got


def test_a_direct_read_the_kernel_refuses_is_read_again_buffered(tmp_path, monkeypatch):
    from tunelab.checkpoint import _tensor_files

    if not _direct_io_taken(tmp_path):
        pytest.skip("this file system does not take O_DIRECT: resumes read buffered")
    tensors = _mixed_tensors()
    _, record = _tensor_files.write_tensor_file(tmp_path / "data", tensors, sync=True)
    # Windows aligned to 8 bytes only: the kernel refuses the first read of less than a block.
    monkeypatch.setattr(_tensor_files, "DIRECT_ALIGN", 8)
    buffered_reads = []
    real = _tensor_files._read_one
    monkeypatch.setattr(
        _tensor_files, "_read_one", lambda *args: buffered_reads.append(1) or real(*args)
    )
    got: dict[int, bytes] = {}
    wants = _wants_for(tensors, record, set(range(1, len(tensors))), into=True, got=got)
    _tensor_files.read_wanted(tmp_path / "data", record["size"], wants, direct=True)
    assert len(buffered_reads) == len(wants)
    for number in range(1, len(tensors)):
        assert got[number] == bytes(_tensor_files.tensor_bytes(tensors[number])), number
