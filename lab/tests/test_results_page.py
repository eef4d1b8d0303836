"""lab/bench/results_page.py: a benchmark rewrites its own section of its machine's page, nothing else."""

import pytest

from lab.bench.results_page import replace_section, write_section


def test_a_section_is_replaced_whole_and_the_others_stay(tmp_path):
    page = write_section("cpu", "perf-sample", "first run", tmp_path)
    assert page.name == "cpu.md"
    write_section("cpu", "soak", "soak run", tmp_path)
    write_section("cpu", "perf-sample", "second run", tmp_path)
    text = page.read_text()
    assert "second run" in text and "first run" not in text and "soak run" in text
    assert text.index("perf-sample") < text.index("soak")  # a rewritten section keeps its place
    assert text.count("<!-- section: perf-sample -->") == 1


def test_section_names_cannot_break_the_markers():
    with pytest.raises(ValueError, match="section name"):
        replace_section("", "two words", "x")
    assert "<!-- end: 8x448 -->" in replace_section("# page\n", "8x448", "body")


def test_pages_from_several_calls_merge_section_by_section(tmp_path):
    from lab.bench.results_page import merge, sections

    a = write_section("cpu", "perf-1024", "call one", tmp_path / "a")
    b = write_section("cpu", "soak", "call two", tmp_path / "b")
    write_section("cpu", "perf-1024", "call three", tmp_path / "c")
    into = tmp_path / "cpu.md"
    into.write_text(replace_section("# page\n", "old", "kept"))
    merge(into, [a, b, tmp_path / "c" / "cpu.md"])
    assert sections(into.read_text()) == {"old": "kept", "perf-1024": "call three", "soak": "call two"}


def test_a_page_that_carries_a_section_unchanged_does_not_undo_another_calls_run(tmp_path):
    from lab.bench.results_page import merge, sections

    into = tmp_path / "cpu.md"
    into.write_text(replace_section(replace_section("# page\n", "encoder", "old"), "mixed", "old"))
    first = tmp_path / "a" / "cpu.md"  # call one wrote the encoder's section; mixed came along as it was
    first.parent.mkdir()
    first.write_text(replace_section(into.read_text(), "encoder", "new"))
    second = tmp_path / "b" / "cpu.md"  # call two, from the same tree, wrote mixed only
    second.parent.mkdir()
    second.write_text(replace_section(into.read_text(), "mixed", "new"))
    merge(into, [first, second])
    assert sections(into.read_text()) == {"encoder": "new", "mixed": "new"}
