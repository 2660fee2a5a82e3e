"""exactspec's cache directory: where it is, and that its JSON files are never fatal and never half-written."""

from __future__ import annotations

from pathlib import Path

from exactspec.cache_files import CacheDirectory, default_cache_dir, read_json_object, write_json_atomically


def test_the_directory_is_exactspecs_variable_else_xdgs_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "own"
    monkeypatch.delenv("EXACTSPEC_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "exactspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "exactspec"


def test_a_missing_damaged_or_foreign_file_reads_as_empty(tmp_path):
    assert read_json_object(tmp_path / "absent.json") == {}
    (tmp_path / "damaged.json").write_text('{"a": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_json_object(tmp_path / "damaged.json") == {} and read_json_object(tmp_path / "list.json") == {}


def test_a_write_makes_its_directory_and_leaves_one_whole_file(tmp_path):
    file = tmp_path / "deep" / "entry.json"
    write_json_atomically(file, {"a": 1})
    write_json_atomically(file, {"b": 2})
    assert read_json_object(file) == {"b": 2} and [p.name for p in file.parent.iterdir()] == ["entry.json"]


def test_clearing_removes_every_entry_and_counts_them(tmp_path):
    class Entries(CacheDirectory):
        directory = tmp_path / "entries"

    assert Entries().entries() == [] and Entries().clear() == 0
    for name in ("a", "b"):
        write_json_atomically(tmp_path / "entries" / f"{name}.json", {})
    assert Entries().clear() == 2 and Entries().entries() == []
