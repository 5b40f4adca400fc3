"""A run's data: its config's ``data`` options and tokenizer, given to :mod:`.data`.

The tokenizer folder is loaded once with :func:`.tokenizer.load_tokenizer`; its Rust tokenizer
(``backend_tokenizer``) goes to the worker processes as the object itself, so each worker encodes
with the tokenizer's own batch encoder without loading anything. ``attnres data`` (:mod:`.datacmd`)
and ``attnres train`` both come through here, so a corpus prepared by one is the other's cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import TrainConfig
from .data import (
    Corpus,
    DataOptions,
    Encoder,
    builtin_name,
    is_prepared,
    load_corpus,
    needed_vocab,
    read_manifest,
    resolve_data_files,
    resolve_eot,
)
from .data.sources import EXTENSIONS, split_pair
from .tokenizer import load_tokenizer, tokenizer_id

__all__ = ["data_vocab_size", "encoder_for", "load_corpus_for", "source_kind", "tokenizer_encoder"]


def tokenizer_encoder(path: str | os.PathLike, *, trust_remote_code: bool = False) -> Encoder:
    """The tokenizer saved at ``path`` (HF format) as an :class:`Encoder`: its content id, its
    vocabulary and its end-of-text id (``eos_token``). Code from the folder runs only with
    ``trust_remote_code``."""
    tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
    return Encoder.from_tokenizers(tok.backend_tokenizer, tokenizer_id(path), len(tok), tok.eos_token_id)


def encoder_for(tokenizer: str | os.PathLike | None, *, trust_remote_code: bool = False) -> Encoder:
    """Byte tokens, or the tokenizer folder ``tokenizer``."""
    return (
        Encoder() if tokenizer is None else tokenizer_encoder(tokenizer, trust_remote_code=trust_remote_code)
    )


def load_corpus_for(cfg: TrainConfig) -> Corpus:
    """The corpus a run trains on: ``cfg.data`` read with ``cfg``'s data options, in bytes or
    through ``cfg.tokenizer`` (prepared into the token cache the first time, with a progress bar
    when ``cfg.progress``)."""
    return load_corpus(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        val_fraction=cfg.val_fraction,
        cache_dir=cfg.cache_dir,
        encoder=encoder_for(cfg.tokenizer, trust_remote_code=cfg.trust_remote_code),
        options=cfg.data_options(),
        progress=cfg.progress,
    )


def source_kind(data: str | None, options: DataOptions) -> str:
    """``builtin``, ``prepared``, ``tokens`` (pre-tokenized files) or ``text`` (everything else),
    from the names alone (no file is read)."""
    if builtin_name(data) is not None:
        return "builtin"
    path = Path(data).expanduser()
    if is_prepared(path):
        return "prepared"
    if options.format != "auto":
        return "tokens" if options.format == "tokens" else "text"
    if split_pair(path):
        return "tokens"
    if path.is_dir() and not any(path.iterdir()):
        return "text"
    _, rels = resolve_data_files(data)
    return "tokens" if all(EXTENSIONS.get(Path(r).suffix.lower()) == "tokens" for r in rels) else "text"


def data_vocab_size(cfg: TrainConfig) -> int | None:
    """The model vocabulary a run's data needs when ``--vocab-size`` is not given: the
    tokenizer's (with its end-of-text id), a prepared folder's, 257 for byte tokens with an
    end-of-text id; None to keep the default (pre-tokenized files: an error names the size)."""
    options = cfg.data_options()
    kind = source_kind(cfg.data, options)
    if kind == "prepared":
        manifest = read_manifest(Path(cfg.data).expanduser())
        return None if manifest is None else manifest["vocab_size"]
    if kind == "tokens" and cfg.tokenizer is None:
        return None
    encoder = encoder_for(cfg.tokenizer, trust_remote_code=cfg.trust_remote_code)
    return needed_vocab(encoder, resolve_eot(kind, encoder, options, f"--data {cfg.data!r}"))
