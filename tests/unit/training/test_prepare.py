"""The data pipeline: formats, end-of-text tokens, the split by document, shards, resume, integrity."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from attention_residuals.extras import MissingExtraError
from attention_residuals.training import data
from attention_residuals.training.data import DataOptions, Encoder, load_corpus, prepare_source
from attention_residuals.training.data.sources import cut_in

DOCS = [
    f"# document {i}\n"
    + "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # é ü ∑\n" for j in range(3 + 2 * i))
    for i in range(12)
]
SMALL = {"shard_bytes": 600, "piece_bytes": 256, "batch_bytes": 512}  # many shards, pieces, batches


def write_text(root, docs=DOCS):
    root.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return root


def write_jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def prep(spec, tmp_path, encoder=None, **kw):
    kw.setdefault("cache_dir", tmp_path / "cache")
    corpus, manifest, stats = prepare_source(str(spec), encoder or Encoder(), **kw)
    return corpus, manifest, stats


def docs_of(tokens, eot):
    """The documents of a stream that ends each one with ``eot``."""
    arr = np.asarray(tokens)
    ends = np.flatnonzero(arr == eot).tolist()
    return [arr[a + 1 if k else 0 : b] for k, (a, b) in enumerate(zip([-1, *ends], ends))]


def test_eot_after_every_document(tmp_path):
    c, manifest, _ = prep(write_text(tmp_path / "t"), tmp_path, val_fraction=0.2)
    eots = int((np.asarray(c.train) == 256).sum() + (np.asarray(c.val) == 256).sum())
    assert eots == len(DOCS) == sum(c.documents) and c.documents == (10, 2)  # round(12 * 0.2) = 2
    assert manifest["eot_id"] == 256 and manifest["vocab_size"] == 257 and manifest["dtype"] == "uint16"
    decoded = sorted(bytes(d.astype(np.uint8)).decode() for d in docs_of(c.train, 256) + docs_of(c.val, 256))
    assert decoded == sorted(DOCS)  # every document whole, none lost or merged
    j, _, _ = prep(write_jsonl(tmp_path / "d.jsonl"), tmp_path, val_fraction=0.2)
    assert int((np.asarray(j.train) == 256).sum()) + int((np.asarray(j.val) == 256).sum()) == len(DOCS)


def test_every_format_gives_the_same_streams(tmp_path):
    text, _, _ = prep(write_text(tmp_path / "t"), tmp_path)
    forms = {"jsonl": write_jsonl(tmp_path / "d.jsonl")}
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=5)  # three row groups
    forms["parquet"] = tmp_path / "d.parquet"
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "ds"))
    forms["datasets"] = tmp_path / "ds"
    import csv

    with open(tmp_path / "d.csv", "w", newline="") as f:  # CSV through the datasets builder
        csv.writer(f).writerows([["text"], *([d] for d in DOCS)])
    nano = tmp_path / "nano"  # nanoGPT's layout: train.bin and val.bin, uint16, beside other files
    nano.mkdir()
    np.asarray(text.train, dtype=np.uint16).tofile(nano / "train.bin")
    np.asarray(text.val, dtype=np.uint16).tofile(nano / "val.bin")
    (nano / "meta.pkl").write_bytes(b"\x80\x04N.")
    forms["tokens"] = nano
    options = {"csv": DataOptions(format="datasets")}
    for name, spec in [*forms.items(), ("csv", tmp_path / "d.csv")]:
        other, manifest, _ = prep(spec, tmp_path, sizes=SMALL, options=options.get(name))
        assert manifest["data_format"] == ("datasets" if name == "csv" else name)
        assert np.array_equal(other.train, text.train) and np.array_equal(other.val, text.val), name
        assert other.digest() == text.digest()


def test_workers_and_small_shards_give_the_same_cache(tmp_path):
    root = write_text(tmp_path / "t")
    one, _, _ = prep(root, tmp_path, out=tmp_path / "one")
    many, manifest, stats = prep(root, tmp_path, out=tmp_path / "many", workers=2, sizes=SMALL)
    assert stats.workers == 2 and stats.shards > 4 and stats.peak_rss_worker > 0
    assert many.digest() == one.digest() and np.array_equal(many.train, one.train)


def test_interrupted_prepare_reruns_only_the_rest(tmp_path):
    root = write_text(tmp_path / "t")
    done = []

    def stop_after_two(record):
        done.append(record["index"])
        if len(done) == 2:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prep(root, tmp_path, out=out, sizes=SMALL, on_shard=stop_after_two)
    finished = len(list((out / "work").glob("shard-*.json")))
    assert not (out / "manifest.json").exists() and finished == 2
    again, manifest, stats = prep(root, tmp_path, out=out, sizes=SMALL)
    assert stats.reused == 2 and stats.shards > 2 and not (out / "work").exists()
    clean, clean_manifest, _ = prep(root, tmp_path, out=tmp_path / "clean", sizes=SMALL)
    assert (out / "train.bin").read_bytes() == (tmp_path / "clean" / "train.bin").read_bytes()
    assert (out / "val.bin").read_bytes() == (tmp_path / "clean" / "val.bin").read_bytes()
    assert manifest["tokens_sha256"] == clean_manifest["tokens_sha256"]
    _, _, rerun = prep(root, tmp_path, out=out, sizes=SMALL)
    assert rerun.cached  # a finished folder: verified and reused


def _corrupt(path):
    """Change one byte in place: same size."""
    blob = bytearray(path.read_bytes())
    blob[3] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_corrupted_cache_is_rebuilt_and_a_corrupted_folder_refused(tmp_path, capsys):
    root = write_text(tmp_path / "t")
    first = load_corpus(str(root), cache_dir=tmp_path / "cache")
    good = np.asarray(first.train).copy()
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    _corrupt(entry / "train.bin")
    again = load_corpus(str(root), cache_dir=tmp_path / "cache")
    assert "block 0" in capsys.readouterr().err and not again.cached
    assert np.array_equal(again.train, good)  # rebuilt, not trained on the damaged bytes
    out = tmp_path / "prepared"
    prep(root, tmp_path, out=out)
    _corrupt(out / "val.bin")
    with pytest.raises(data.CorruptCacheError, match="val.bin: block 0"):
        load_corpus(str(out))  # a prepared folder has no source to rebuild from: refused
    (out / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="has 0 bytes"):
        data.verify(out, data.read_manifest(out))


def test_split_by_document_is_by_content(tmp_path):
    c, manifest, _ = prep(write_text(tmp_path / "a"), tmp_path, val_fraction=0.25)
    # the same documents under other names and in another order: the same validation documents
    renamed = list(reversed(DOCS))
    d, _, _ = prep(write_text(tmp_path / "b", renamed), tmp_path, val_fraction=0.25)
    val = {bytes(x.astype(np.uint8)) for x in docs_of(c.val, 256)}
    assert val == {bytes(x.astype(np.uint8)) for x in docs_of(d.val, 256)} and len(val) == 3
    assert manifest["split"] == {"method": "document", "val_fraction": 0.25}
    assert sorted(c.val_files) == sorted(manifest["val"]["files"]) and len(c.train_files) == 9


def test_long_documents_are_cut_without_changing_bpe_tokens(tmp_path):
    pytest.importorskip("tokenizers")
    from attention_residuals.training.prepare import tokenizer_encoder
    from attention_residuals.training.tokenizer import EOT, load_encoder, train_bpe

    long_doc = "".join(DOCS) * 6  # ~25 KB: ~100 pieces of 256 bytes
    train_bpe(DOCS, vocab_size=320).save_pretrained(tmp_path / "tok")
    hook = load_encoder(tmp_path / "tok")
    root = write_text(tmp_path / "t", [long_doc, DOCS[0], DOCS[1]])
    c, manifest, _ = prep(root, tmp_path, encoder=tokenizer_encoder(tmp_path / "tok"), sizes=SMALL)
    assert manifest["eot_id"] == hook.eos_token_id == 0 and hook.decode([0]) == EOT
    docs = docs_of(c.train, 0) + docs_of(c.val, 0)
    assert sum(len(d) for d in docs) + len(docs) == len(c.train) + len(c.val)
    want = hook.encode(long_doc)
    assert any(d.tolist() == want for d in docs)  # the pieces' tokens are the whole document's
    assert sorted(hook.decode(d.tolist()) for d in docs) == sorted([long_doc, DOCS[0], DOCS[1]])


def test_cut_points():
    assert cut_in(b"ab\ncd\nef", 4) == 3  # after the newline between printable characters
    assert cut_in(b"ab  \n  cd ef", 6) == 9  # no clean newline: before the single space
    text = "ééééé".encode()  # no newline, no space: a character boundary
    assert cut_in(text, 5) % 2 == 0


def test_records_errors_name_the_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, the record at byte 17 is not JSON"):
        prep(bad, tmp_path)
    bad.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"no field 'text' \(body\); pass --text-field"):
        prep(bad, tmp_path)
    bad.write_text('{"text": 3}\n{"text": "x"}\n')
    with pytest.raises(ValueError, match="field 'text' is int, not a string"):
        prep(bad, tmp_path)
    with pytest.raises(ValueError, match="text_field"):
        DataOptions(text_field="").validate()


def test_one_record_cannot_be_split(tmp_path):
    one = write_jsonl(tmp_path / "one.jsonl", DOCS[:1])
    with pytest.raises(ValueError, match="needs at least 2 documents, got 1"):
        prep(one, tmp_path)


def test_parquet_column_checked(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: body\); pass --text-field"):
        prep(tmp_path / "d.parquet", tmp_path)
    c, _, _ = prep(tmp_path / "d.parquet", tmp_path, options=DataOptions(text_field="body"))
    assert sum(c.documents) == len(DOCS)


def test_datasetdict_keeps_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS[:9]}),
            "validation": datasets.Dataset.from_dict({"text": DOCS[9:]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    c, manifest, _ = prep(tmp_path / "dd", tmp_path)
    assert manifest["split"]["method"] == "given" and c.documents == (9, 3)
    assert [bytes(d.astype(np.uint8)).decode() for d in docs_of(c.val, 256)] == DOCS[9:]


def test_pretokenized_files(tmp_path):
    stream = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), 256) for d in DOCS]).astype(
        np.uint16
    )
    stream.tofile(tmp_path / "all.bin")
    with pytest.raises(ValueError, match="--eot-id"):
        prep(tmp_path / "all.bin", tmp_path)
    c, manifest, _ = prep(tmp_path / "all.bin", tmp_path, options=DataOptions(eot_id=256), sizes=SMALL)
    assert (
        c.tokenizer == data.PRETOKENIZED and manifest["vocab_size"] == 257 and sum(c.documents) == len(DOCS)
    )
    assert sorted(
        bytes(d.astype(np.uint8)).decode() for d in docs_of(c.train, 256) + docs_of(c.val, 256)
    ) == sorted(DOCS)
    np.save(tmp_path / "all.npy", stream.astype(np.int32))  # a .npy of signed ints: the same tokens
    n, _, _ = prep(tmp_path / "all.npy", tmp_path, options=DataOptions(eot_id=256), sizes=SMALL)
    assert np.array_equal(np.asarray(n.train, np.int64), np.asarray(c.train, np.int64))
    with pytest.raises(ValueError, match="give --vocab-size 257 or more"):
        prep(tmp_path / "all.bin", tmp_path, options=DataOptions(eot_id=256), vocab_size=256)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        prep(tmp_path / "odd.bin", tmp_path, options=DataOptions(eot_id=0))


def test_vocabulary_holds_the_end_of_text_id(tmp_path):
    root = write_text(tmp_path / "t")
    with pytest.raises(ValueError, match=r"vocab_size 256 is too small, the tokens need 257.*--eot off"):
        load_corpus(str(root), vocab_size=256, cache_dir=tmp_path / "cache")
    assert load_corpus(str(root), vocab_size=300, cache_dir=tmp_path / "cache").vocab_size == 300
    with pytest.raises(ValueError, match="eot: expected one of auto, on, off"):
        DataOptions(eot="yes").validate()


def test_builtin_corpus_end_of_text_is_opt_in():
    plain = load_corpus("stdlib-docs")
    assert plain.eot_id is None and not (np.asarray(plain.train) == 256).any()
    c = load_corpus("stdlib-docs", options=DataOptions(eot="on"))
    assert c.vocab_size == 257 and c.eot_id == 256
    assert int((np.asarray(c.train) == 256).sum()) == len(c.train_files) == c.documents[0]
    assert len(c.train) == len(plain.train) + len(c.train_files)


def test_prepared_folder_is_bound_to_its_tokenizer(tmp_path):
    root = write_text(tmp_path / "t")
    prep(root, tmp_path, out=tmp_path / "p")
    other = Encoder.from_callable(lambda s: [ord(ch) % 300 for ch in s], 300, "mod300")
    with pytest.raises(ValueError, match="prepared with tokenizer 'bytes', this run uses 'mod300'"):
        load_corpus(str(tmp_path / "p"), encoder=other)
    assert load_corpus(str(tmp_path / "p")).cached
    with pytest.raises(ValueError, match="holds another prepared corpus"):
        prep(root, tmp_path, out=tmp_path / "p", val_fraction=0.3)


def test_tokenizer_training_sees_the_training_documents(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from attention_residuals.training.tokenizer import corpus_texts

    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "home-cache"))
    root = write_text(tmp_path / "t")
    c = load_corpus(str(root), cache_dir=tmp_path / "cache", val_fraction=0.2)
    texts = list(corpus_texts(str(root), val_fraction=0.2))
    val = [(root / f).read_text() for f in c.val_files]
    assert sorted(texts + val) == sorted(DOCS) and not set(texts) & set(val)
    assert not (tmp_path / "home-cache").exists()  # read from the source: no cache written
    records = list(data.train_texts(str(write_jsonl(tmp_path / "d.jsonl")), val_fraction=0.2))
    assert sorted(records) == sorted(texts)  # the same documents from another format


def test_missing_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(MissingExtraError, match=r'pip install "attention-residuals\[data\]"'):
        prep(tmp_path / "d.parquet", tmp_path)
