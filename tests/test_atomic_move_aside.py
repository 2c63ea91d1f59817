"""move_aside: a replaced directory gets a name of its own, even twice in one second."""

import datetime as dt

import pytest

from titan_audit import atomic


class _FrozenClock(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return dt.datetime(2026, 12, 2, 16, 9, 8, tzinfo=tz)


@pytest.fixture
def frozen(monkeypatch):
    monkeypatch.setattr(atomic.dt, "datetime", _FrozenClock)


def _run(path, text):
    path.mkdir()
    (path / "manifest.json").write_text(text)


def test_two_replacements_in_one_second_keep_both_old_runs(tmp_path, frozen):
    run = tmp_path / "r"
    _run(run, "first")
    first = atomic.move_aside(run)
    _run(run, "second")
    second = atomic.move_aside(run)
    assert first.name == "r.replaced-20261202T160908Z"
    assert second.name == "r.replaced-20261202T160908Z-2"
    assert (first / "manifest.json").read_text() == "first"
    assert (second / "manifest.json").read_text() == "second"
    assert not run.exists()


@pytest.mark.control
def test_an_existing_empty_directory_under_the_name_is_not_taken_over(tmp_path, frozen):
    """The negative control: a plain rename would silently land on an empty directory of that name."""
    squatter = tmp_path / "r.replaced-20261202T160908Z"
    squatter.mkdir()
    run = tmp_path / "r"
    _run(run, "old")
    aside = atomic.move_aside(run)
    assert aside.name.endswith("-2") and squatter.is_dir() and not any(squatter.iterdir())
    assert (aside / "manifest.json").read_text() == "old"


def test_a_failed_rename_leaves_no_claim_behind(tmp_path, frozen):
    with pytest.raises(FileNotFoundError):
        atomic.move_aside(tmp_path / "missing")
    assert list(tmp_path.iterdir()) == []
