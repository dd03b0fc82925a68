"""One error line stays readable: long printed values and long paths lose their middle."""

from tunelab.errors import MAX_LINE_CHARS, shorten

RECORD = "LoRASpec(rank={}, alpha=16.0, targets=('q_proj', 'k_proj', 'v_proj'), use_dora=False)"


def test_printed_values_keep_their_start_so_a_differing_rank_still_shows():
    message = (
        f"outputs/run/step_3 was made with another lora: checkpoint has {RECORD.format(8)}, "
        f"this run has {RECORD.format(4)}. Use another output_dir or set "
        "checkpoint.resume_from_checkpoint=false."
    )
    short = shorten(message)
    # The fixed words alone are about 190 characters: "about 200" is what is left.
    assert len(message) > 300 and len(short) < MAX_LINE_CHARS + 20
    assert "checkpoint has LoRASpec(rank=8, alpha=16.0" in short
    assert "this run has LoRASpec(rank=4, alpha=16.0" in short
    assert short.startswith("outputs/run/step_3 was made")
    assert short.endswith("set checkpoint.resume_from_checkpoint=false.")


def test_a_long_path_loses_its_middle_and_keeps_root_and_file():
    folder = "/data/projects/" + "nested/" * 20 + "outputs/run"
    message = f"{folder}/step_152: manifest lists a missing file: adapter_model.safetensors"
    short = shorten(message)
    assert len(message) > MAX_LINE_CHARS >= len(short)
    assert short.startswith("/data/projects/nested/") and "..." in short
    assert "/outputs/run/step_152: manifest lists" in short


def test_a_path_of_64_characters_or_less_stays_whole():
    path = "/tmp/pytest-of-someone/pytest-9/case0/nowhere/Llama-3.2-1B"
    message = (
        f"model folder not found: {path}; download it with `tunelab download x --output-dir {path}` "
        * 2
    )
    assert shorten(message).count(path) == 4


def test_a_very_long_line_keeps_its_start_and_end():
    message = "checkpoint has " + "x" * 900 + " set checkpoint.resume_from_checkpoint=false"
    short = shorten(message)
    assert len(short) == 2 * MAX_LINE_CHARS and " ... " in short
    assert short.startswith("checkpoint has x")
    assert short.endswith("set checkpoint.resume_from_checkpoint=false")


def test_short_lines_and_prose_parentheses_are_kept_each_line_alone():
    assert shorten("tunelab: a short one") == "tunelab: a short one"
    prose = "y" * 190 + " (set skip_malformed: true to skip such rows)"
    assert shorten(prose) == prose
    listing = f"2 problems in the config:\n  - {'z' * 150} {RECORD.format(8)}\n  - short"
    lines = shorten(listing).split("\n")
    assert lines[0] == "2 problems in the config:" and lines[2] == "  - short"
    assert lines[1].endswith(" LoRASpec(rank=8, alpha=16.0,...)")
