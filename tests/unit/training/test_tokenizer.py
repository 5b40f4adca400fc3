"""Byte-level BPE tokenizers in HF format: training, round trips, the byte tokenizer, corpus glue."""

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from transformers import AutoTokenizer  # noqa: E402

from attention_residuals import cli  # noqa: E402
from attention_residuals.training.data import byte_decode, byte_encode  # noqa: E402
from attention_residuals.training.tokenizer import (  # noqa: E402
    EOT,
    byte_tokenizer,
    corpus_texts,
    load_encoder,
    load_tokenized_corpus,
    tokenizer_id,
    train_bpe,
)

WORDS = [
    "value",
    "count",
    "name",
    "index",
    "total",
    "result",
    "buffer",
    "item",
    "key",
    "size",
    "text",
    "node",
]
CODE = "".join(
    f"def {WORDS[i % 12]}_{WORDS[i * 5 % 12]}_{i}({WORDS[i * 7 % 12]}):\n"
    f"    return {WORDS[i * 7 % 12]} * {i} + len('héllo {WORDS[i % 5]}')\n\n"
    for i in range(200)
)

SAMPLES = [
    "",
    " ",
    "def f(x):\n    return x\n",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "héllo wörld — ünïcödé",
    "日本語のテキスト, 中文, 한국어",
    "emoji 🎉👩‍👩‍👧 and a combining e\u0301",
    "\x00\x01 control \x7f bytes",
    "never seen in training: ξψζ ∮ ∯",
    EOT + "after the end-of-text token",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tok = train_bpe([CODE], vocab_size=400, min_frequency=2)
    tok.save_pretrained(path)
    return path


def test_training_learns_merges_and_saves_hf_format(saved):
    assert (saved / "tokenizer.json").is_file() and (saved / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(saved)
    assert 300 < len(tok) <= 400 and tok.eos_token == EOT and tok.convert_tokens_to_ids(EOT) == 0
    line = CODE.splitlines()[0]
    assert len(tok.encode(line, add_special_tokens=False)) < len(line.encode()) / 2  # merges compress


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(saved, text):
    tok = AutoTokenizer.from_pretrained(saved)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)
    hook = load_encoder(saved)
    assert hook.encode(text) == ids and hook.decode(ids) == text


def test_empty_string_and_batch(saved):
    tok = AutoTokenizer.from_pretrained(saved)
    assert tok.encode("", add_special_tokens=False) == []
    assert tok.decode([]) == ""
    batch = tok(SAMPLES[2:5])["input_ids"]
    assert [tok.decode(ids) for ids in batch] == SAMPLES[2:5]


def test_byte_tokenizer_is_our_byte_encoding(tmp_path):
    tok = byte_tokenizer()
    assert len(tok) == 256
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    every_char = "".join(chr(i) for i in range(1, 0x800)) + "🎉"
    for text in SAMPLES + [every_char]:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == byte_encode(text)
        assert loaded.decode(ids) == text == byte_decode(ids)


def test_train_arguments_are_checked():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], vocab_size=200)
    with pytest.raises(ValueError, match="min_frequency"):
        train_bpe(["abc"], vocab_size=300, min_frequency=0)


def test_cli_trains_on_the_training_split(tmp_path, capsys):
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(20):
        (data / f"f{i:02d}.py").write_text(CODE[i * 200 : (i + 1) * 200 + 400])
    out = tmp_path / "tok"
    rc = cli.main(["tokenizer", "train", "--data", str(data), "--out", str(out), "--vocab-size", "320"])
    assert rc == 0 and "attnres train --tokenizer" in capsys.readouterr().out
    info = json.loads((out / "attnres_tokenizer.json").read_text())
    assert info["vocab_size"] == 320 and info["tokenizer_id"] == tokenizer_id(out)
    assert info["documents"] == len(list(corpus_texts(str(data)))) < 20  # validation files held out
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode(CODE[:300], add_special_tokens=False)) == CODE[:300]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert cli.main(["tokenizer", "train", "--data", str(data), "--out", str(out)]) == 2  # not empty: refused
    assert "not an empty folder" in capsys.readouterr().err
    assert before == {p.name: p.stat().st_mtime_ns for p in out.iterdir()}  # nothing written
    assert (
        cli.main(["tokenizer", "train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "new")])
        == 2
    )
    assert "nope" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_tokenized_corpus_feeds_training(tmp_path, saved):
    """The glue for ``attnres train --tokenizer``: a corpus of BPE ids that decodes to the text, and a
    GPT trained on it exports to HF with that tokenizer."""
    from attention_residuals.training import make_config, train

    text_file = tmp_path / "code.py"
    text_file.write_text(CODE)
    corpus, hook = load_tokenized_corpus(saved, str(text_file), cache_dir=tmp_path / "cache")
    assert corpus.vocab_size == hook.vocab_size == len(AutoTokenizer.from_pretrained(saved))
    assert corpus.tokenizer == tokenizer_id(saved)
    decoded = hook.decode(corpus.train.tolist()) + hook.decode(corpus.val.tolist())
    assert decoded == CODE
    with pytest.raises(ValueError, match="vocab-size"):
        load_tokenized_corpus(
            saved, str(text_file), vocab_size=hook.vocab_size - 1, cache_dir=tmp_path / "cache"
        )
    cfg = make_config(
        vocab_size=corpus.vocab_size,
        n_layer=1,
        n_head=2,
        d_model=16,
        seq_len=16,
        residual="block",
        batch_size=2,
        steps=2,
        warmup=1,
        eval_interval=2,
        eval_batches=1,
        log_interval=1,
        progress=False,
        out=str(tmp_path / "run"),
        tokenizer=str(saved),
    )
    summary = train(cfg, corpus=corpus)
    assert summary["done"]
    # the run records its tokenizer (train.tokenizer), and export-hf ships it
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["data"]["tokenizer"] == hook.tokenizer_id and record["train"]["tokenizer"] == str(saved)
    from attention_residuals.integrations.hf import export_hf

    export_hf(tmp_path / "run", tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.encode(CODE[:100], add_special_tokens=False) == hook.encode(CODE[:100])


def test_train_command_takes_tokenizer(tmp_path, saved, capsys):
    """``attnres train --tokenizer PATH`` trains on BPE ids (the model's vocabulary size is the
    tokenizer's unless given) and records the tokenizer in the run; ``attnres eval`` reads the
    corpus with it, so its loss is the run's own validation loss."""
    text_file = tmp_path / "code.py"
    text_file.write_text(CODE)
    vocab = len(AutoTokenizer.from_pretrained(saved))
    args = [
        "train",
        "--tokenizer",
        str(saved),
        "--data",
        str(text_file),
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--d-model",
        "16",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--eval-interval",
        "2",
        "--eval-batches",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert cli.main(args) == 0
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["train"]["tokenizer"] == str(saved) and record["data"]["tokenizer"] == tokenizer_id(saved)
    assert record["model"]["vocab_size"] == vocab > 256
    capsys.readouterr()
    assert cli.main(["eval", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]) == 0
    result = json.loads(capsys.readouterr().out)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert result["tokenizer"] == tokenizer_id(saved) and "bits_per_byte" not in result
    assert result["corpus_matches_run"] and result["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)


# --------------------------------------------------------------------------- no code from data

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import PreTrainedTokenizerFast\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"


def _plant_code(folder, marker):
    """Make ``folder`` a tokenizer that asks transformers to import a class from its own evil.py."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    cfg_path.write_text(json.dumps(cfg))
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))


def test_a_tokenizer_folder_with_code_is_refused_everywhere(tmp_path, saved, capsys):
    import shutil

    from attention_residuals.training import make_config, train
    from attention_residuals.training.tokenizer import load_tokenizer

    marker = tmp_path / "code-ran"
    clean = tmp_path / "clean"
    shutil.copytree(saved, clean)
    data = tmp_path / "c.txt"
    data.write_text(CODE)
    run = tmp_path / "run"
    cfg = make_config(
        tokenizer=str(clean), vocab_size=len(load_tokenizer(clean)), data=str(data), cache_dir=str(tmp_path / "cache"),
        n_layer=1, n_head=2, d_model=16, seq_len=16, batch_size=2, steps=2, warmup=1, eval_interval=2,
        eval_batches=1, progress=False, out=str(run),
    )  # fmt: skip
    train(cfg)
    _plant_code(clean, marker)  # the run's own tokenizer folder gets code (tokenizer.json unchanged)
    with pytest.raises(
        ValueError, match=r"asks to run Python code of its own \(evil.EvilTokenizer.*--trust-remote-code"
    ):
        load_tokenizer(clean)
    with pytest.raises(ValueError, match="trust-remote-code"):
        load_encoder(clean)
    with pytest.raises(ValueError, match="trust-remote-code"):
        load_tokenized_corpus(clean, data, cache_dir=tmp_path / "cache")
    for argv in (
        [
            "train",
            "--tokenizer",
            str(clean),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "new"),
            "--steps",
            "1",
        ],
        ["eval", str(run), "--cache-dir", str(tmp_path / "cache")],
        ["sample", str(run), "--max-new-tokens", "2"],
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--trust-remote-code" in err and "Traceback" not in err, err
    assert not marker.exists() and not (tmp_path / "new").exists()


def test_trust_remote_code_reaches_transformers_only_when_asked(tmp_path, saved, monkeypatch):
    import transformers

    from attention_residuals.training.tokenizer import load_tokenizer, remote_code_of

    seen = []

    def fake(path, **kw):
        seen.append(kw)
        return "tokenizer"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    assert load_tokenizer(saved) == "tokenizer" and seen[-1]["trust_remote_code"] is False
    assert remote_code_of(saved) == []
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(saved, planted)
    _plant_code(planted, tmp_path / "marker")
    assert remote_code_of(planted) == ["evil.EvilTokenizer", "evil.EvilTokenizer"]
    assert load_tokenizer(planted, trust_remote_code=True) == "tokenizer"
    assert seen[-1] == {"local_files_only": True, "trust_remote_code": True}
