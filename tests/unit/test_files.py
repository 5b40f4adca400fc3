"""Run files: atomic replacement that keeps the old file when cut short, no symlink following."""

from __future__ import annotations

import json
import os

import pytest

from attention_residuals.files import atomic_write, open_append
from attention_residuals.training.run import write_json


def test_open_append_refuses_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("x")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError):
        open_append(tmp_path / "link")
    assert victim.read_text() == "x"


def test_atomic_write_keeps_the_old_file_when_cut_short(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    write_json(path, {"a": 1})
    mode = path.stat().st_mode & 0o777

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["config.json"]
    atomic_write(path, "{}")
    assert path.stat().st_mode & 0o777 == mode  # as readable as a plain write made it
