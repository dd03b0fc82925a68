"""Streaming datasets: the materialised path's samples, world-size-free batches, exact resume."""

import json
import shutil
from collections import Counter
from itertools import islice

import pytest

from tunelab import _paths
from tunelab.data import instruct_dataset, load_tokenizer
from tunelab.data.stream_loader import StreamLoader, StreamPosition
from tunelab.errors import ConfigError, DataError

TINY = _paths.assets_dir() / "tiny"
NUM_SHARDS, ROWS_PER_SHARD = 12, 15


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TINY), max_seq_len=64)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The first 180 rows of the tiny SFT data as 12 JSONL shards of 15 rows."""
    folder = tmp_path_factory.mktemp("shards")
    rows = (TINY / "sft.jsonl").read_text().splitlines()
    for shard in range(NUM_SHARDS):
        lines = rows[shard * ROWS_PER_SHARD : (shard + 1) * ROWS_PER_SHARD]
        (folder / f"part-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def parquet_shards(tmp_path_factory, shards):
    """The same rows as 12 Parquet shards (read through ``datasets`` streaming)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("parquet")
    for path in sorted(shards.iterdir()):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), folder / (path.stem + ".parquet"))
    return folder


def stream(tokenizer, shards, **kwargs):
    settings = {"template": "instruct", "max_seq_len": 64, "streaming": True, **kwargs}
    return instruct_dataset(tokenizer, source=str(shards), **settings)


def global_steps(dataset, world_size, global_batch, num_steps, state=None):
    """Each step's items in global order (rank r's item i at r + i * W) and the final state."""
    micro_batch = global_batch // world_size
    positions = [
        StreamPosition(num_sources=len(dataset.sources), num_replicas=world_size, seed=5)
        for _ in range(world_size)
    ]
    if state is not None:
        for position in positions:
            position.load_state_dict(json.loads(json.dumps(state)))
    loaders = [
        iter(StreamLoader(dataset, p, batch_size=micro_batch, collate_fn=list, rank=rank))
        for rank, p in enumerate(positions)
    ]
    steps = []
    for _ in range(num_steps):
        per_rank = [next(loader) for loader in loaders]
        step = [per_rank[i % world_size][i // world_size] for i in range(global_batch)]
        steps.append([item["tokens"] for item in step])
        for position in positions:
            position.advance(micro_batch)
    states = [position.state_dict() for position in positions]
    assert all(s == states[0] for s in states)
    return steps, states[0]


def test_in_order_stream_gives_the_materialised_samples(tokenizer, shards, tmp_path):
    # shuffle_buffer_size 1 reads in order: the same row function makes the same samples.
    streamed = stream(tokenizer, shards, shuffle_buffer_size=1)
    files = sorted(str(f) for f in shards.iterdir())
    materialised = instruct_dataset(
        tokenizer, source="json", data_files=files, template="instruct", max_seq_len=64,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    items = [item for item, _ in streamed.items(0, 5, {k: 0 for k in LOCATION})]
    assert len(items) == len(materialised) == NUM_SHARDS * ROWS_PER_SHARD
    assert items == [materialised[i] for i in range(len(materialised))]


def test_parquet_shards_stream_the_same_samples(tokenizer, shards, parquet_shards):
    location = dict.fromkeys(LOCATION, 0)
    from_json = [item for item, _ in stream(tokenizer, shards).items(0, 5, location)]
    from_parquet = [item for item, _ in stream(tokenizer, parquet_shards).items(0, 5, location)]
    assert from_parquet == from_json and len(from_json) == NUM_SHARDS * ROWS_PER_SHARD


LOCATION = ("window", "source", "row", "taken", "sample")
# 3 of window 3's 7 rows read (the resumed 2-rank case).
RESUMED_AT = {"window": 3, "source": 1, "row": 6, "taken": 3, "sample": 0}


@pytest.mark.parametrize("packed", [False, True])
def test_global_batches_do_not_depend_on_the_world_size(tokenizer, shards, packed):
    dataset = stream(tokenizer, shards, shuffle_buffer_size=7, packed=packed)
    single, state = global_steps(dataset, 1, 8, 4)
    for world_size in (2, 4):
        assert global_steps(dataset, world_size, 8, 4) == (single, state)
    # The shuffle moved rows, within windows of 7 rows that span shards.
    in_order, _ = global_steps(
        stream(tokenizer, shards, packed=packed, shuffle_buffer_size=1), 1, 8, 4
    )
    assert single != in_order


@pytest.mark.parametrize(
    ("packed", "files"), [(False, "jsonl"), (True, "jsonl"), (True, "parquet")]
)
def test_resume_from_a_saved_position_continues_the_stream(
    tokenizer, shards, parquet_shards, packed, files
):
    folder = shards if files == "jsonl" else parquet_shards
    dataset = stream(tokenizer, folder, shuffle_buffer_size=7, packed=packed)
    uninterrupted, _ = global_steps(dataset, 2, 8, 7)
    first, state = global_steps(dataset, 2, 8, 4)
    # A state in the middle of a window and of a pack: the resume must rebuild both.
    assert state["stream"]["taken"] > 0
    resumed, _ = global_steps(dataset, 4, 8, 3, state=state)
    assert first + resumed == uninterrupted


def test_packs_fill_the_sequence(tokenizer, shards):
    dataset = stream(tokenizer, shards, packed=True)
    packs = [item for item, _ in islice(dataset.items(0, 5, dict.fromkeys(LOCATION, 0)), 5)]
    assert all(len(pack["tokens"]) == 64 for pack in packs)
    assert all(max(pack["document_ids"]) >= 2 for pack in packs)


def test_a_stream_that_ends_before_the_epoch_is_a_clear_error(tokenizer, shards):
    dataset = stream(tokenizer, shards)
    with pytest.raises(DataError, match="max_steps_per_epoch"):
        global_steps(dataset, 2, 64, 3)


def test_shuffle_buffer_without_streaming_is_a_clear_error(tokenizer, shards, tmp_path):
    with pytest.raises(ConfigError, match="shuffle_buffer_size"):
        instruct_dataset(
            tokenizer, source=str(shards / "part-000.jsonl"), template="instruct",
            shuffle_buffer_size=8, cache_dir=str(tmp_path),
        )  # fmt: skip


def test_malformed_row_names_the_file_and_line(tokenizer, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"instruction": "x", "output": "y"}\n{"instruction": 3\n')
    dataset = instruct_dataset(
        tokenizer, source=str(tmp_path), template="instruct", streaming=True,
        allow_unknown_tokens=True,
    )  # fmt: skip
    with pytest.raises(DataError, match=r"a\.jsonl:2: row 1"):
        list(dataset.items(0, 0, dict.fromkeys(LOCATION, 0)))


def test_a_checkpoint_resumes_only_with_the_data_path_that_saved_it(tokenizer, shards):
    from tunelab.data import StatefulDistributedSampler

    position = StreamPosition(num_sources=NUM_SHARDS, num_replicas=1, seed=0)
    sampler = StatefulDistributedSampler(10, num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="saved by a streaming run"):
        sampler.load_state_dict(position.state_dict())
    with pytest.raises(ConfigError, match="saved by a run without streaming"):
        position.load_state_dict(sampler.state_dict())
    changed = {**position.state_dict(), "num_sources": NUM_SHARDS + 1}
    with pytest.raises(ConfigError, match="was it changed"):
        position.load_state_dict(changed)


def test_mixing_a_stream_is_a_clear_error(tokenizer, shards):
    from tunelab.data import mix_dataset

    with pytest.raises(ConfigError, match=r"datasets\[0\]\.streaming: a stream cannot be mixed"):
        mix_dataset(
            tokenizer, datasets=[stream(tokenizer, shards), stream(tokenizer, shards)],
            weights=[1, 1],
        )  # fmt: skip


def _stream_pass(rank, folder, result_dir, counts=False, window=7, location=None):
    """One of 2 gloo ranks: stream ``folder`` from ``location`` (default: the start) to the
    end; write the items, or the error.

    With ``counts``, write what the rank decoded during the pass instead.
    """
    import dataclasses

    tokenizer = load_tokenizer(str(TINY), max_seq_len=64)
    try:  # the first windows are read when the dataset is built (check_tokens_fit)
        dataset = stream(tokenizer, folder, shuffle_buffer_size=window, allow_unknown_tokens=counts)
        start = location or dict.fromkeys(LOCATION, 0)
        outcome = [item["tokens"] for item, _ in dataset.items(0, 5, start)]
        if counts:
            outcome = dataclasses.asdict(dataset.decoded)
    except DataError as error:
        outcome = str(error)
    (result_dir / f"rank{rank}.json").write_text(json.dumps(outcome))


def _two_rank_jobs(rank, init_file, jobs):
    """One of 2 gloo ranks running ``jobs`` ((function, keyword arguments) pairs) in order."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for job, kwargs in jobs:
            job(rank, **kwargs)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, shards, parquet_row_groups):
    """Every 2-rank case of this module in one spawn of 2 real gloo ranks (one import each).

    Returns each case's result folder by name; :func:`rank_results` reads it.
    """
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("two_ranks")
    broken = root / "broken_data"
    shutil.copytree(shards, broken)
    lines = (broken / "part-003.jsonl").read_text().splitlines()
    lines[4] = '{"instruction": "x", "output": ""}'
    (broken / "part-003.jsonl").write_text("\n".join(lines) + "\n")
    cases = {
        "json_counts": (_stream_pass, {"folder": shards, "counts": True}),
        "row_groups": (_stream_pass, {"folder": parquet_row_groups, "counts": True, "window": 30}),
        "gather": (_stream_pass, {"folder": shards}),
        "resumed": (_stream_pass, {"folder": shards, "location": RESUMED_AT}),
        "coverage": (_coverage_pass, {"folder": shards}),
        # Last: the error stops this case on both ranks, after which nothing else runs.
        "malformed": (_stream_pass, {"folder": broken}),
    }
    jobs = []
    for name, (job, kwargs) in cases.items():
        (root / name).mkdir()
        jobs.append((job, {**kwargs, "result_dir": root / name}))
    mp.spawn(_two_rank_jobs, args=(str(root / "init"), jobs), nprocs=2, join=True)
    return {name: root / name for name in cases}


def rank_results(folder, prefix="rank"):
    return [json.loads((folder / f"{prefix}{rank}.json").read_text()) for rank in range(2)]


def test_each_rank_json_decodes_only_its_share_of_the_lines(shards, two_ranks):
    # Rank r decodes the r-th half of each window's rows: together every row once.
    lines = [
        line for path in sorted(shards.iterdir()) for line in path.read_bytes().splitlines(True)
    ]
    total_bytes = sum(len(line) for line in lines)
    decoded = rank_results(two_ranks["json_counts"])
    # 25 windows of 7 rows (3 + 4) and one of 5 (2 + 3).
    assert [d["rows"] for d in decoded] == [77, 103]
    assert sum(d["json_bytes"] for d in decoded) == total_bytes
    assert all(d["json_bytes"] <= 0.6 * total_bytes for d in decoded)


@pytest.fixture(scope="module")
def parquet_row_groups(tmp_path_factory, shards):
    """The 180 rows as 3 Parquet files of 60 rows, in row groups of 5 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("row_groups")
    rows = [
        json.loads(line)
        for path in sorted(shards.iterdir())
        for line in path.read_text().splitlines()
    ]
    for part in range(3):
        table = pa.Table.from_pylist(rows[part * 60 : (part + 1) * 60])
        pq.write_table(table, folder / f"part-{part}.parquet", row_group_size=5)
    return folder


def test_each_rank_reads_only_the_parquet_row_groups_of_its_share(
    tokenizer, shards, parquet_row_groups, two_ranks
):
    # Windows of 30 rows: each rank's run of 15 rows is 3 of the window's 6 row groups, and
    # those are all it reads. The stream is the one the JSON Lines give.
    decoded = rank_results(two_ranks["row_groups"])
    assert [d["rows"] for d in decoded] == [90, 90]
    assert [d["table_rows"] for d in decoded] == [90, 90]
    location = dict.fromkeys(LOCATION, 0)
    from_json = stream(tokenizer, shards, shuffle_buffer_size=30).items(0, 5, location)
    from_groups = stream(tokenizer, parquet_row_groups, shuffle_buffer_size=30).items(
        0, 5, location
    )
    assert [item for item, _ in from_groups] == [item for item, _ in from_json]


def test_ranks_share_the_tokenizing_and_gather_the_same_stream(tokenizer, shards, two_ranks):
    single = [item["tokens"] for item, _ in stream(tokenizer, shards, shuffle_buffer_size=7).items(
        0, 5, dict.fromkeys(LOCATION, 0)
    )]  # fmt: skip
    assert rank_results(two_ranks["gather"]) == [single, single]


def test_ranks_resumed_mid_window_share_its_unread_rows(tokenizer, shards, two_ranks):
    # 3 of window 3's 7 rows are read: the ranks split the other 4 and gather the stream.
    dataset = stream(tokenizer, shards, shuffle_buffer_size=7, num_proc=0)
    single = [item["tokens"] for item, _ in dataset.items(0, 5, dict(RESUMED_AT))]
    assert rank_results(two_ranks["resumed"]) == [single, single]


def test_a_malformed_row_tokenized_by_one_rank_stops_both(two_ranks):
    # Row 4 of part-003.jsonl has an empty output (the fixture writes it).
    outcomes = rank_results(two_ranks["malformed"])
    assert outcomes[0] == outcomes[1]
    assert isinstance(outcomes[0], str) and "part-003.jsonl:5: row 4" in outcomes[0]


def test_preview_shows_the_first_items_of_a_stream(shards):
    import io

    from tunelab.cli import _data

    overrides = [f"dataset.source={shards}", "dataset.data_files=null", "dataset.streaming=true",
                 "schedule.max_steps_per_epoch=4"]  # fmt: skip
    out = io.StringIO()
    _data.preview("tiny/lora", overrides, 3, as_json=True, out=out)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    tokenizer = load_tokenizer(str(TINY), max_seq_len=128)
    expected = stream(tokenizer, shards, max_seq_len=128).items(0, 0, dict.fromkeys(LOCATION, 0))
    assert [r["input_ids"] for r in records] == [i["tokens"] for i, _ in islice(expected, 3)]
    text = io.StringIO()
    _data.preview("tiny/lora", overrides, 1, as_json=False, out=text)
    assert text.getvalue().startswith(f"tiny/lora: a stream of {NUM_SHARDS} files (items")


def test_each_epoch_restarts_the_files_with_its_own_shuffle(tokenizer, shards):
    dataset = stream(tokenizer, shards, shuffle_buffer_size=7)
    window = [i["tokens"] for i, _ in islice(stream(tokenizer, shards, shuffle_buffer_size=1).items(
        0, 5, dict.fromkeys(LOCATION, 0)), 7)]  # fmt: skip
    position = StreamPosition(num_sources=NUM_SHARDS, num_replicas=1, seed=5)
    loader = StreamLoader(dataset, position, batch_size=7, collate_fn=list, rank=0)
    first = [item["tokens"] for item in next(iter(loader))]
    position.advance(7)
    position.set_epoch(1)
    assert position.consumed == 0 and position.location == dict.fromkeys(LOCATION, 0)
    second = [item["tokens"] for item in next(iter(loader))]
    assert sorted(first) == sorted(second) == sorted(window)
    assert first != second != window


def test_settings_check_refuses_a_stream_without_steps_or_a_streamed_validation(shards, tmp_path):
    from tunelab.cli._check import check_config

    stream_settings = [f"output_dir={tmp_path / 'out'}", f"dataset.source={shards}",
                       "dataset.data_files=null", "dataset.streaming=true"]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        check_config("tiny/lora", [*stream_settings, "val_dataset.streaming=true"])
    message = str(info.value)
    assert "key 'schedule.max_steps_per_epoch': dataset.streaming: true needs it" in message
    assert "key 'val_dataset.streaming': validation data cannot stream" in message
    check_config("tiny/lora", [*stream_settings, "schedule.max_steps_per_epoch=4"])  # valid


@pytest.mark.parametrize("num_proc", [1, 2])
def test_worker_processes_read_ahead_the_same_stream(tokenizer, shards, num_proc):
    import os

    location = {"window": 3, "source": 1, "row": 6, "taken": 4, "sample": 0}  # mid-window
    here = stream(tokenizer, shards, shuffle_buffer_size=7, packed=True, num_proc=0)
    workers = stream(tokenizer, shards, shuffle_buffer_size=7, packed=True, num_proc=num_proc)
    assert list(workers.items(1, 5, location)) == list(here.items(1, 5, location))
    pids = {part.pid for part in workers.parts(1, 5, location, num_proc)}
    assert os.getpid() not in pids and len(pids) == num_proc
    assert {part.pid for part in here.parts(1, 5, location, 0)} == {os.getpid()}


def test_arrow_shards_stream_the_same_samples(tokenizer, shards, tmp_path):
    import pyarrow as pa

    for path in sorted(shards.iterdir()):  # IPC streams, the format of datasets' cache files
        table = pa.Table.from_pylist([json.loads(line) for line in path.read_text().splitlines()])
        with pa.OSFile(str(tmp_path / (path.stem + ".arrow")), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=4)
    # Windows of 7 rows start inside files, so rows are read from an offset.
    location = dict.fromkeys(LOCATION, 0)
    from_json = stream(tokenizer, shards, shuffle_buffer_size=7).items(0, 5, location)
    from_arrow = stream(tokenizer, tmp_path, shuffle_buffer_size=7).items(0, 5, location)
    assert [item for item, _ in from_arrow] == [item for item, _ in from_json]


def test_parquet_conversations_stream_as_the_materialised_path_reads_them(tmp_path):
    # Nested rows (lists of message structs) converted by pyarrow, row groups of 7 rows, read
    # from inside a group: the samples the materialised path (datasets' Parquet loader) makes.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tunelab.data import chat_dataset

    rows = [json.loads(line) for line in (TINY / "chat.jsonl").read_text().splitlines()[:60]]
    files = []
    for part in range(3):
        files.append(str(tmp_path / f"chat-{part}.parquet"))
        pq.write_table(
            pa.Table.from_pylist(rows[part * 20 : (part + 1) * 20]), files[-1], row_group_size=7
        )
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    settings = dict(source="parquet", data_files=files, template="auto", max_seq_len=256)
    materialised = chat_dataset(tokenizer, **settings, cache_dir=str(tmp_path / "cache"))
    streamed = chat_dataset(tokenizer, **settings, streaming=True, shuffle_buffer_size=1)
    whole = list(streamed.items(0, 0, dict.fromkeys(LOCATION, 0)))
    assert [item for item, _ in whole] == [materialised[i] for i in range(len(materialised))]
    # Resumed at row 10 of the first file (inside its second row group).
    location = {"window": 10, "source": 0, "row": 10, "taken": 0, "sample": 0}
    after = next(k for k, (_, where) in enumerate(whole) if where == location) + 1
    resumed = [item for item, _ in streamed.items(0, 0, location)]
    assert resumed == [item for item, _ in whole[after:]] and len(resumed) >= 50


def _rows_of_the_files(tokenizer, shards, tmp_path) -> Counter:
    """Every row's tokens, counted, read the materialised way (no streaming code)."""
    files = sorted(str(f) for f in shards.iterdir())
    materialised = instruct_dataset(
        tokenizer, source="json", data_files=files, template="instruct", max_seq_len=64,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    return Counter(tuple(materialised[i]["tokens"]) for i in range(len(materialised)))


def _epochs_through_loaders(dataset, world_size, global_batch, num_epochs, rank=None):
    """Each epoch's items (tokens) as the ranks' loaders give them over a whole epoch.

    ``rank`` None simulates every rank here (items in global order); a rank number gives only
    that rank's items (a real process group of ``world_size``). The position is saved and
    restored at each epoch boundary, as a run resumed from its epoch-end checkpoint does.
    """
    micro_batch = global_batch // world_size
    num_steps = NUM_SHARDS * ROWS_PER_SHARD // global_batch
    ranks = range(world_size) if rank is None else [rank]
    positions = {
        r: StreamPosition(num_sources=len(dataset.sources), num_replicas=world_size, seed=5)
        for r in ranks
    }
    epochs = []
    for epoch in range(num_epochs):
        loaders = {}
        for r, position in positions.items():
            position.set_epoch(epoch)
            loader = StreamLoader(
                dataset, position, batch_size=micro_batch, collate_fn=list, rank=r
            )
            loaders[r] = iter(loader)
        items = []
        for _ in range(num_steps):
            per_rank = {r: next(loader) for r, loader in loaders.items()}
            items += [per_rank[r][i]["tokens"] for i in range(micro_batch) for r in ranks]
            for position in positions.values():
                position.advance(micro_batch)
        epochs.append(items)
        for r, position in positions.items():  # the epoch-end checkpoint, restored
            state = json.loads(json.dumps(position.state_dict()))
            positions[r] = StreamPosition(
                num_sources=len(dataset.sources), num_replicas=world_size, seed=5
            )
            positions[r].load_state_dict(state)
    return epochs


def _assert_every_row_once_per_epoch(epochs: list[list], rows: Counter) -> None:
    for epoch, items in enumerate(epochs):
        seen = Counter(tuple(tokens) for tokens in items)
        assert len(items) == sum(rows.values()), epoch
        missing, repeated = rows - seen, seen - rows
        assert not missing and not repeated, (epoch, len(missing), len(repeated))
    # Each epoch has its own shuffle (windows permuted with the epoch's seed).
    assert all(a != b for a, b in zip(epochs, epochs[1:]))


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_row_once_per_epoch_over_every_window_and_epoch(
    tokenizer, shards, tmp_path, world_size
):
    """All 26 shuffle windows of 7 rows (the last one of 5), steps of 12 items that straddle
    windows, three epochs with a saved and restored position at each boundary."""
    rows = _rows_of_the_files(tokenizer, shards, tmp_path)
    assert sum(rows.values()) == NUM_SHARDS * ROWS_PER_SHARD
    dataset = stream(tokenizer, shards, shuffle_buffer_size=7)
    epochs = _epochs_through_loaders(dataset, world_size, 12, 3)
    _assert_every_row_once_per_epoch(epochs, rows)
    # Every window is shuffled within itself, the last ones too, not only the first.
    (in_order,) = _epochs_through_loaders(
        stream(tokenizer, shards, shuffle_buffer_size=1), 1, 12, 1
    )
    windows = [slice(start, start + 7) for start in range(0, len(in_order), 7)]
    for items in epochs:
        for window in windows:
            assert sorted(items[window]) == sorted(in_order[window]), window
        assert sum(items[window] != in_order[window] for window in windows) > len(windows) // 2
        assert items[windows[-1]] != in_order[windows[-1]]


def _coverage_pass(rank, folder, result_dir):
    """One of 2 gloo ranks: its items of 2 whole epochs through its own StreamLoader."""
    tokenizer = load_tokenizer(str(TINY), max_seq_len=64)
    dataset = stream(tokenizer, folder, shuffle_buffer_size=7)
    epochs = _epochs_through_loaders(dataset, 2, 12, 2, rank=rank)
    (result_dir / f"coverage{rank}.json").write_text(json.dumps(epochs))


def test_two_ranks_together_train_every_row_once_per_epoch(tokenizer, shards, two_ranks, tmp_path):
    """Two real gloo ranks (each tokenizes its share of a window and gathers the rest):
    their micro-batches together hold every row exactly once in each of two epochs."""
    per_rank = rank_results(two_ranks["coverage"], prefix="coverage")
    # Global order: step k's micro-batch item i of rank r is global item 2 * (6k + i) + r.
    epochs = [
        [tokens for pair in zip(*(ranks[e] for ranks in per_rank), strict=True) for tokens in pair]
        for e in range(2)
    ]
    rows = _rows_of_the_files(tokenizer, shards, tmp_path)
    _assert_every_row_once_per_epoch(epochs, rows)
    # The ranks split each step's items: neither trains the other's.
    for epoch in range(2):
        assert not {tuple(t) for t in per_rank[0][epoch]} & {tuple(t) for t in per_rank[1][epoch]}
    single = _epochs_through_loaders(stream(tokenizer, shards, shuffle_buffer_size=7), 2, 12, 2)
    assert epochs == single
