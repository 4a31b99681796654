"""`sdpipe remove`: a bad list or source fails in one line before any server starts, and the
removal artifact names identifiers and counts only."""

from __future__ import annotations

from flows import cli
from flows.remove import removal_markdown


def test_a_missing_or_empty_list_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "demo").mkdir()
    missing = tmp_path / "nope.txt"
    assert cli.main(["--data-root", str(tmp_path), "remove", "demo", "--list", str(missing)]) == 2
    assert "cannot read it" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    assert cli.main(["--data-root", str(tmp_path), "remove", "demo", "--list", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdpipe: error: removal list") and "no entries" in err
    assert len(err.splitlines()) == 1


def test_a_source_never_built_fails_in_one_line(tmp_path, capsys):
    listed = tmp_path / "list.txt"
    listed.write_text("http://example.com/a.jpg\n")
    assert cli.main(["--data-root", str(tmp_path), "remove", "demo", "--list", str(listed)]) == 2
    assert "nothing built" in capsys.readouterr().err
    assert cli.main(["--data-root", str(tmp_path), "remove", "nosuch", "--list", str(listed)]) == 2


def test_the_artifact_lists_counts_and_files():
    record = {
        "list_sha256": "ab" * 32, "source": "demo", "num_entries": 3, "num_rows": 2,
        "widen": False, "planned": "t0", "done": "t1", "rows_removed": {"metadata": 2},
        "files_rewritten": ["shards/00000.tar"], "phase_sets": ["demo"],
        "not_rewritten": ["runs/demo/tb/events.out.tfevents.1"],
    }  # fmt: skip
    text = removal_markdown(record)
    assert "| metadata | 2 |" in text and "`shards/00000.tar`" in text
    assert "re-linked" in text and "events.out.tfevents" in text
