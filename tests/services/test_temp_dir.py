"""Without a writable temporary directory (a read-only root filesystem, nothing mounted at /tmp),
`kvserve up` died in a traceback and `kvserve model` said the checkpoint could not load (torch's
caches go there): both now say what is missing, in one line."""

from __future__ import annotations

import tempfile

import pytest

from kvserve.services.plumbing.temp_dir import require_temp_dir


def test_no_writable_temporary_directory_is_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", None)   # gettempdir() looks again, in the places below
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path / "absent")])
    with pytest.raises(SystemExit, match=r"^kvserve model: no writable temporary directory: set TMPDIR"):
        require_temp_dir("kvserve model")


def test_a_writable_one_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path)])
    assert require_temp_dir("kvserve up") == str(tmp_path)
