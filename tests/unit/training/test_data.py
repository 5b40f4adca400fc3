"""Data: the stdlib corpus, --data text files, the token cache, deterministic batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_residuals.training import data
from attention_residuals.training.data import (
    Corpus,
    byte_decode,
    byte_encode,
    eval_batches,
    get_batch,
    load_corpus,
    load_stdlib_corpus,
    resolve_data_files,
    split_files,
    stdlib_files,
    token_dtype,
)


def _write_corpus(root, n=6):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i}.txt").write_text(f"document {i}\n" + "line of text é\n" * (20 + i))
    return root


def test_stdlib_corpus_deterministic_and_split_by_file():
    base, rels = stdlib_files()
    assert rels == sorted(rels) and len(rels) > 100
    assert not any("site-packages" in r or "__pycache__" in r for r in rels)
    assert all(r.endswith(".py") for r in rels)
    c = load_stdlib_corpus()
    assert c.source == "stdlib" and c.vocab_size == 256 and len(c.sha256) == 64
    assert set(c.train_files).isdisjoint(c.val_files)
    assert sorted(c.train_files + c.val_files) == rels
    assert 0.03 < len(c.val_files) / len(rels) < 0.07
    # the tokens are the raw bytes of the files, in sorted order
    first = c.val_files[0]
    head = (base / first).read_bytes()[:64]
    assert bytes(c.val[: len(head)].tolist()) == head
    assert c.train.dtype == np.uint8
    # recomputed from scratch: same split and sha
    tr, va = split_files(rels)
    assert [rels[i] for i in va] == c.val_files


def test_split_files_stable_and_order_independent():
    names = [f"f{i}.txt" for i in range(40)]
    tr, va = split_files(names, 0.05)
    assert len(va) == 2 and sorted(tr + va) == list(range(40))
    rev = list(reversed(names))
    tr2, va2 = split_files(rev, 0.05)
    assert {rev[i] for i in va2} == {names[i] for i in va}
    assert len(split_files(["a", "b"], 0.05)[1]) == 1  # at least one validation file
    with pytest.raises(ValueError):
        split_files(["only"], 0.05)


def test_data_folder_split_by_document_and_cache_reuse(tmp_path):
    root = _write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    c1 = load_corpus(str(root), cache_dir=cache, val_fraction=0.2)
    assert not c1.cached and isinstance(c1.train, np.memmap)
    assert set(c1.train_files).isdisjoint(c1.val_files) and len(c1.val_files) == 1
    assert sorted(c1.train_files + c1.val_files) == [f"doc{i}.txt" for i in range(6)]
    # each file is one document, its bytes then the end-of-text id 256 (vocab 257)
    eot = np.asarray([data.BYTE_EOT], dtype=np.uint16).tobytes()
    expect = b"".join(
        np.frombuffer((root / f).read_bytes(), np.uint8).astype(np.uint16).tobytes() + eot
        for f in c1.train_files
    )
    assert np.asarray(c1.train).tobytes() == expect and c1.vocab_size == 257 and c1.eot_id == 256
    assert c1.documents == (5, 1)
    c2 = load_corpus(str(root), cache_dir=cache, val_fraction=0.2)
    assert c2.cached and c2.sha256 == c1.sha256 and c2.digest() == c1.digest()
    assert np.array_equal(c1.train, c2.train) and np.array_equal(c1.val, c2.val)
    # an edit changes the sha and misses the cache
    (root / "doc0.txt").write_text("changed\n" * 30)
    c3 = load_corpus(str(root), cache_dir=cache, val_fraction=0.2)
    assert not c3.cached and c3.sha256 != c1.sha256
    # raw bytes, as before: --eot off
    raw = load_corpus(str(root), cache_dir=cache, val_fraction=0.2, options=data.DataOptions(eot="off"))
    assert raw.vocab_size == 256 and raw.train.dtype == np.uint8 and raw.eot_id is None


def test_data_single_file_split_at_a_line_and_glob(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(f"line {i}\n" for i in range(200)))
    c = load_corpus(
        str(f), cache_dir=tmp_path / "cache", val_fraction=0.1, options=data.DataOptions(eot="off")
    )
    assert bytes(np.asarray(c.train)) + bytes(np.asarray(c.val)) == f.read_bytes()
    assert bytes(np.asarray(c.val)).startswith(b"line ")  # cut at a line boundary
    assert bytes(np.asarray(c.train)).endswith(b"\n") and c.documents == (1, 1)
    with_eot = load_corpus(str(f), cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert int(with_eot.train[-1]) == int(with_eot.val[-1]) == 256  # each part ends with it
    root = _write_corpus(tmp_path / "g", n=3)
    (root / "skip.md").write_text("not matched")
    _, rels = resolve_data_files(str(root / "*.txt"))
    assert rels == ["doc0.txt", "doc1.txt", "doc2.txt"]


def test_custom_tokenizer_hook(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abc\n" * 100)
    enc = lambda s: [ord(ch) + 200 for ch in s]  # ids up to ~300: needs uint16
    c = load_corpus(str(f), encode=enc, vocab_size=512, tokenizer_id="shift200", cache_dir=tmp_path / "c")
    assert c.train.dtype == np.uint16 and int(c.train[0]) == ord("a") + 200
    assert c.tokenizer == "shift200" and c.eot_id is None  # a plain function has no end-of-text id
    with pytest.raises(ValueError, match="vocab_size"):
        load_corpus(
            str(f), encode=enc, vocab_size=256, tokenizer_id="shift200-small", cache_dir=tmp_path / "c"
        )
    eot = load_corpus(
        str(f),
        encode=enc,
        vocab_size=512,
        tokenizer_id="shift200",
        cache_dir=tmp_path / "c",
        options=data.DataOptions(eot_id=511),
    )
    assert int(eot.train[-1]) == 511 and eot.eot_id == 511
    assert token_dtype(256) == np.uint8 and token_dtype(257) == np.uint16 and token_dtype(70000) == np.uint32


def test_data_errors_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        load_corpus(str(tmp_path / "missing.txt"), cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="--data"):
        load_corpus(str(tmp_path / "*.nothing"), cache_dir=tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="--data.*empty"):
        load_corpus(str(empty), cache_dir=tmp_path)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="--data"):
        load_corpus(str(tmp_path / "emptydir"), cache_dir=tmp_path)
    binary = tmp_path / "blob.dat"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="--data.*not text"):
        load_corpus(str(binary), cache_dir=tmp_path)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 10)
    with pytest.raises(ValueError, match="--data.*not UTF-8"):
        load_corpus(str(latin), cache_dir=tmp_path)


def test_batches_deterministic_and_sharded():
    tokens = np.arange(1000, dtype=np.uint16) % 256
    x1, y1 = get_batch(tokens, 4, 16, seed=3, step=7)
    x2, y2 = get_batch(tokens, 4, 16, seed=3, step=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == torch.long and x1.shape == (4, 16)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    assert not torch.equal(get_batch(tokens, 4, 16, seed=3, step=8)[0], x1)
    assert not torch.equal(get_batch(tokens, 4, 16, seed=4, step=7)[0], x1)
    # the union over data-parallel ranks is the single-process global batch
    full, _ = get_batch(tokens, 8, 16, seed=3, step=7)
    r0, _ = get_batch(tokens, 4, 16, seed=3, step=7, rank=0, world_size=2)
    r1, _ = get_batch(tokens, 4, 16, seed=3, step=7, rank=1, world_size=2)
    assert torch.equal(torch.cat([r0, r1]), full)
    with pytest.raises(ValueError):
        get_batch(tokens[:10], 1, 16, seed=0, step=0)
    vals = torch.stack([x for x, _ in eval_batches(tokens, 3, 2, 8)])
    again = torch.stack([x for x, _ in eval_batches(tokens, 3, 2, 8)])
    assert vals.shape == (3, 2, 8) and torch.equal(vals, again)


def test_corpus_from_text_and_byte_roundtrip():
    c = Corpus.from_text("hello world\n" * 50, val_fraction=0.2)
    assert len(c.val) > 0 and len(c.train) > len(c.val)
    assert byte_decode(byte_encode("héllo")) == "héllo"
    assert byte_decode([104, 105, 256, 104]) == "hi<|endoftext|>h"  # the byte-level end-of-text id
    with pytest.raises(ValueError, match="seq_len"):
        c.check_fits(10_000)


def test_stdlib_prose_keeps_docstrings_and_comments_not_code():
    src = b'''"""Module doc.

>>> 1 + 1
2
"""
# A comment that
# goes on.
x = 1  # noqa
def f():
    """Say hello."""
    return "not prose"
'''
    text = data.stdlib_prose(src).decode()
    assert "Module doc." in text and "Say hello." in text and "A comment that goes on." in text
    assert ">>>" not in text and "not prose" not in text and "noqa" not in text and "x = 1" not in text
    assert data.stdlib_prose(b"def (:\n") == b""  # a file that does not parse has no prose


def test_prose_corpus_split_by_file_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(6):
        (lib / f"m{i}.py").write_text(f'"""Docs of module {i}."""\n# comment {i}\nx = {i}\n')
    (lib / "bare.py").write_text("x = 1\n")  # no prose: left out
    c = data.load_stdlib_corpus(root=lib, prose=True)
    assert c.source == data.STDLIB_DOCS and len(c.train_files) + len(c.val_files) == 6
    assert b"x = " not in bytes(c.train) + bytes(c.val)
    assert list((tmp_path / "cache" / "prose").glob("*.json"))
    data._STDLIB_MEMO.clear()
    again = data.load_stdlib_corpus(root=lib, prose=True)
    assert again.sha256 == c.sha256 and bytes(again.train) == bytes(c.train)
