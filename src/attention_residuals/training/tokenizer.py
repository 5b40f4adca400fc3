"""Tokenizers beyond raw bytes: byte-level BPE trained with ``tokenizers`` on local text.

``attnres tokenizer train --out DIR`` trains on the training split of the default corpus (the
standard library's ``.py`` files; ``--data PATH`` for a file, folder or glob — the same files and
the same train/validation split as ``attnres train``, so no validation text shapes the merges)
and saves ``DIR`` in the Hugging Face format (``tokenizer.json`` + ``tokenizer_config.json``)::

    tok = AutoTokenizer.from_pretrained(DIR)          # local, no network
    attnres train --tokenizer DIR ...                 # train a model on these tokens

Byte-level means every string round-trips exactly (``decode(encode(s)) == s`` for any Unicode,
the empty string included): text is mapped to its UTF-8 bytes before the merges, so there is no
unknown token. The special token ``<|endoftext|>`` (id 0) ends documents.

:func:`byte_tokenizer` is the same format for the default byte tokens (id = byte value, vocab
256, identical to :func:`attention_residuals.training.data.byte_encode`), so a byte-level model exported
with ``attnres export-hf`` comes with a working ``AutoTokenizer`` too.

Python: :func:`train_bpe`, :func:`load_tokenizer`, :func:`load_encoder` (the hook for
:func:`attention_residuals.training.data.load_corpus`: ``encode``, ``vocab_size``, ``tokenizer_id``).

No code from data: a tokenizer folder is loaded with transformers' ``trust_remote_code=False``,
and one that asks to import Python classes from its own files (an ``auto_map`` in its
``tokenizer_config.json`` or ``config.json``) is refused with a ``ValueError`` saying so, unless
the caller passes ``trust_remote_code=True`` (``--trust-remote-code`` of ``train``, ``eval`` and
``sample``). A run directory's ``config.json`` names its tokenizer folder, so this matters for
folders one did not make.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import data as d

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "EOT",
    "TokenizerHook",
    "byte_tokenizer",
    "corpus_texts",
    "load_encoder",
    "load_tokenized_corpus",
    "load_tokenizer",
    "main",
    "remote_code_of",
    "tokenizer_id",
    "tokenizer_path_of",
    "train_bpe",
]

DEFAULT_VOCAB_SIZE = 4096
EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


def _wrap(tok, **special):
    """A ``tokenizers.Tokenizer`` as a ``transformers`` fast tokenizer (the HF format on save)."""
    from transformers import PreTrainedTokenizerFast  # local: the hf extra

    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **special)


def _byte_level(tok):
    from tokenizers import decoders, pre_tokenizers, processors  # local: the hf extra

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(
    texts: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    min_frequency: int = 2,
    special_tokens: Iterable[str] = (EOT,),
    length: int | None = None,
):
    """Train a byte-level BPE on ``texts``; returns a ``transformers`` fast tokenizer.

    ``vocab_size`` counts everything: the special tokens (first ids), the 256 byte symbols and
    the merges (fewer when the text runs out of pairs seen ``min_frequency`` times). The first
    special token is the tokenizer's ``eos_token``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # local: the hf extra

    specials = list(special_tokens)
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size: must be >= 256 + {len(specials)} special tokens, got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency: expected >= 1, got {min_frequency}")
    tok = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return _wrap(tok, **({"eos_token": specials[0]} if specials else {}))


def byte_tokenizer():
    """The default byte tokens in HF format: id ``b`` is byte ``b`` (vocab 256, no merges)."""
    from tokenizers import Tokenizer, models  # local: the hf extra

    vocab = {char: b for b, char in enumerate(_byte_alphabet())}
    return _wrap(_byte_level(Tokenizer(models.BPE(vocab=vocab, merges=[]))))


def _byte_alphabet() -> list[str]:
    """The printable character ByteLevel maps each byte to (GPT-2's table), indexed by byte."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def remote_code_of(path: str | os.PathLike) -> list[str]:
    """The Python classes the tokenizer folder ``path`` asks transformers to import from its own
    files (the ``auto_map`` entries of its ``tokenizer_config.json`` and ``config.json``)."""
    found: list[str] = []
    for name in ("tokenizer_config.json", "config.json"):
        try:
            config = json.loads((Path(path) / name).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # absent or unreadable: transformers reads no auto_map from it either
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if auto_map:
            values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            for v in values:
                found += [str(x) for x in (v if isinstance(v, list | tuple) else [v]) if x]
            found = found or [f"auto_map of {name}"]
    return found


def load_tokenizer(path: str | os.PathLike, *, trust_remote_code: bool = False):
    """``AutoTokenizer.from_pretrained(path)`` from local files only (never the network) and
    without running code from the folder unless ``trust_remote_code`` (see the module docstring)."""
    from transformers import AutoTokenizer  # local: the hf extra

    path = Path(path)
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"--tokenizer {str(path)!r}: no {TOKENIZER_FILE} in that folder")
    code = remote_code_of(path)
    if code and not trust_remote_code:
        raise ValueError(
            f"--tokenizer {str(path)!r}: the folder asks to run Python code of its own "
            f"({', '.join(code)}); refused — pass --trust-remote-code if you trust that code"
        )
    return AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )


def tokenizer_id(path: str | os.PathLike) -> str:
    """A content id (``bpe-<sha256 of tokenizer.json, 16 hex>``): keys the token cache."""
    blob = (Path(path) / TOKENIZER_FILE).read_bytes()
    return f"bpe-{hashlib.sha256(blob).hexdigest()[:16]}"


@dataclass
class TokenizerHook:
    """What ``attnres train --tokenizer PATH`` needs: pass ``encode``, ``vocab_size`` and
    ``tokenizer_id`` to :func:`attention_residuals.training.data.load_corpus`; ``decode`` for samples."""

    path: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Iterable[int]], str]
    vocab_size: int
    tokenizer_id: str
    eos_token_id: int | None = None


def load_encoder(path: str | os.PathLike, *, trust_remote_code: bool = False) -> TokenizerHook:
    """Load a saved tokenizer as plain ``encode``/``decode`` functions (no special tokens added;
    ``trust_remote_code`` as in :func:`load_tokenizer`)."""
    tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
    backend = tok.backend_tokenizer  # the Rust tokenizer: fast, no per-call Python overhead

    def encode(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    def decode(ids: Iterable[int]) -> str:
        return backend.decode([int(i) for i in ids], skip_special_tokens=False)

    return TokenizerHook(
        path=str(Path(path).resolve()),
        encode=encode,
        decode=decode,
        vocab_size=len(tok),
        tokenizer_id=tokenizer_id(path),
        eos_token_id=tok.eos_token_id,
    )


def load_tokenized_corpus(
    tokenizer: str | os.PathLike,
    data: str | os.PathLike | None = None,
    *,
    vocab_size: int | None = None,
    val_fraction: float | None = None,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
):
    """``(Corpus, TokenizerHook)``: :func:`attention_residuals.training.data.load_corpus` on ``data`` with
    the tokenizer saved at ``tokenizer`` (the glue ``attnres train --tokenizer PATH`` needs).

    ``vocab_size`` is the model's (default: the tokenizer's); it must hold every token id.
    The token cache is keyed by the tokenizer's content (:func:`tokenizer_id`).
    """
    hook = load_encoder(tokenizer, trust_remote_code=trust_remote_code)
    vocab = hook.vocab_size if vocab_size is None else vocab_size
    if vocab < hook.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab} is smaller than the vocabulary of --tokenizer {str(tokenizer)!r} "
            f"({hook.vocab_size}): leave --vocab-size out to take the tokenizer's, or give at least that"
        )
    corpus = d.load_corpus(
        data,
        encode=hook.encode,
        vocab_size=vocab,
        tokenizer_id=hook.tokenizer_id,
        val_fraction=d.DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction,
        cache_dir=cache_dir,
    )
    return corpus, hook


def tokenizer_path_of(run_config: dict) -> Path | None:
    """The tokenizer folder a run was trained with (``train.tokenizer`` in its config), if any."""
    train = run_config.get("train") if isinstance(run_config.get("train"), dict) else {}
    path = train.get("tokenizer") or run_config.get("tokenizer")
    return Path(path) if path else None


def corpus_texts(data: str | None = None, *, val_fraction: float | None = None) -> Iterator[str]:
    """The training split of a corpus as text, one document per file (see module docstring)."""
    frac = d.DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    if data is None or data == d.STDLIB:
        root, rels = d.stdlib_files()
        train_idx, _ = d.split_files(rels, frac)
        for i in train_idx:
            yield (root / rels[i]).read_bytes().decode("utf-8", errors="replace")
        return
    yield from d.train_texts(data, val_fraction=frac)  # the documents attnres train trains on


# --------------------------------------------------------------------------- CLI


def _train_command(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ValueError(
            f"--out {str(out)!r}: not an empty folder (pass --overwrite to write the tokenizer into it)"
        )
    texts = list(corpus_texts(args.data, val_fraction=args.val_fraction))
    if not any(texts):
        raise ValueError(f"--data {args.data!r}: no text to train on")
    tok = train_bpe(
        texts, args.vocab_size, min_frequency=args.min_frequency, special_tokens=args.special_tokens
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    info = {
        "vocab_size": len(tok),
        "requested_vocab_size": args.vocab_size,
        "min_frequency": args.min_frequency,
        "special_tokens": args.special_tokens,
        "data": args.data or "stdlib",
        "val_fraction": args.val_fraction if args.val_fraction is not None else _default_val_fraction(),
        "documents": len(texts),
        "characters": sum(len(t) for t in texts),
        "tokenizer_id": tokenizer_id(out),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out / "attnres_tokenizer.json").write_text(json.dumps(info, indent=1))
    sample = texts[0][:2000] if texts else ""
    n = len(tok.encode(sample, add_special_tokens=False)) if sample else 0
    ratio = f", {len(sample.encode()) / n:.2f} bytes/token on a sample" if n else ""
    print(
        f"wrote {out} (vocab {len(tok)}{ratio}); use it with: attnres train --tokenizer {out}"
        f" (the model takes its vocabulary size, {len(tok)})"
    )
    return 0


def _default_val_fraction() -> float:
    return d.DEFAULT_VAL_FRACTION


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnres tokenizer", description="Byte-level BPE tokenizers (HF format)."
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train a byte-level BPE on local text",
        description="Train a byte-level BPE with `tokenizers` on the training split of a local corpus and save it "
        "in the Hugging Face format (AutoTokenizer.from_pretrained(OUT) loads it).",
    )
    t.add_argument("--out", required=True, help="output folder (tokenizer.json, tokenizer_config.json)")
    t.add_argument(
        "--data", default=None, help="text file, folder or glob (default: the standard library's .py files)"
    )
    t.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help=f"default {DEFAULT_VOCAB_SIZE}")
    t.add_argument(
        "--min-frequency", type=int, default=2, help="merge only pairs seen this often (default 2)"
    )
    t.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="held-out fraction, as in attnres train (default: the data module's)",
    )
    t.add_argument("--special-tokens", nargs="*", default=[EOT], help=f"default: {EOT}")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out (default: refuse, nothing written)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _train_command(args)
    except (OSError, ValueError) as e:
        print(f"attnres tokenizer: error: {e}", file=sys.stderr)
        return 2
