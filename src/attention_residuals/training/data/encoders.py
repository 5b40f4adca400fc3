"""Tokenizers as the data pipeline uses them: a batch encoder that worker processes can rebuild.

An :class:`Encoder` names a tokenizer (its id keys the token cache), its vocabulary, its
end-of-text id, and a picklable ``factory`` that builds the batch encoder — ``list[str]`` to one
id sequence per string — in each worker process. Byte tokens need nothing; a ``tokenizers``
tokenizer travels to the workers as the object itself (it pickles to its JSON), so the workers
import neither ``transformers`` nor this project's tokenizer loading; a plain ``encode`` function
is wrapped, and runs in the main process when it does not pickle (a lambda, a closure).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import BYTE_EOT, BYTE_TOKENIZER, callable_id

__all__ = ["BatchEncode", "Encoder", "encode_bytes", "tokenizers_batch"]

BatchEncode = Callable[[list[str]], list[Sequence[int] | np.ndarray]]


def encode_bytes(texts: list[str]) -> list[np.ndarray]:
    """Byte tokens of each text: its UTF-8 bytes."""
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


def _bytes_factory() -> BatchEncode:
    return encode_bytes


def tokenizers_batch(backend) -> BatchEncode:
    """The batch encoder of a ``tokenizers.Tokenizer`` (Rust; no special tokens added, so the
    ids are the text's own; ``encode_batch_fast`` skips the offsets where it exists)."""
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

    def batch(texts: list[str]) -> list[Sequence[int]]:
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    return batch


class _PerText:
    """``encode`` applied to each text of a batch."""

    def __init__(self, encode: Callable[[str], Sequence[int]]) -> None:
        self.encode = encode

    def __call__(self, texts: list[str]) -> list[Sequence[int]]:
        return [self.encode(t) for t in texts]


def _constant(batch: BatchEncode) -> BatchEncode:
    return batch


@dataclass(frozen=True)
class Encoder:
    """A tokenizer for the pipeline (see the module docstring). ``vocab_size`` bounds its ids;
    ``eot_id`` is its end-of-text id (None: it has none; byte tokens reserve 256)."""

    id: str = BYTE_TOKENIZER
    vocab_size: int = 256
    eot_id: int | None = None
    factory: Callable[[], BatchEncode] = _bytes_factory

    @property
    def is_bytes(self) -> bool:
        return self.factory is _bytes_factory

    @property
    def default_eot(self) -> int | None:
        """The id put after each document unless ``--eot-id`` says otherwise."""
        if self.eot_id is not None:
            return self.eot_id
        return BYTE_EOT if self.is_bytes else None

    def picklable(self) -> bool:
        """Whether worker processes can rebuild it (else it runs in the main process)."""
        try:
            pickle.dumps(self.factory)
        except (pickle.PicklingError, TypeError, AttributeError):
            return False
        return True

    @classmethod
    def from_callable(
        cls, encode: Callable[[str], Sequence[int]], vocab_size: int, tokenizer_id: str | None = None
    ) -> Encoder:
        """A plain ``encode(text) -> ids`` (no end-of-text id unless ``--eot-id``)."""
        return cls(
            id=tokenizer_id or callable_id(encode),
            vocab_size=vocab_size,
            factory=functools.partial(_constant, _PerText(encode)),
        )

    @classmethod
    def from_tokenizers(cls, backend, tokenizer_id: str, vocab_size: int, eot_id: int | None) -> Encoder:
        """A ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``)."""
        return cls(
            id=tokenizer_id,
            vocab_size=vocab_size,
            eot_id=eot_id,
            factory=functools.partial(tokenizers_batch, backend),
        )
