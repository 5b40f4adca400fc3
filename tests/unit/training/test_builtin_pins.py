"""The built-in corpora keep their exact token streams and sha256 (committed results depend on them).

The values were computed with the code as it was before the streaming data pipeline (issue 19) on
this machine's Python 3.11.7 standard library. They only apply to that library: the test checks
an independent fingerprint of the ``.py`` files (relative path + bytes, sorted) and skips on any
other Python. ``stdlib-docs`` reads the prose cache (fresh extraction takes about a minute); the
extraction itself is pinned on a fixed subset of files, computed fresh.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest

from attention_residuals.training import data

FINGERPRINT = "5ee5334843c7268670e92c586d8e4d4fc6500331b016760dd8e8625d5aed1b4a"
PYTHON = (3, 11, 7)
PINS = {
    "stdlib": {
        "sha256": "702c7ef4e93238ed2b642ec754097889d2928c6bc755a6585d96fe69228456f5",
        "train_tokens": 29703636,
        "val_tokens": 1821588,
        "train_sha256": "ecdf29084c19d610c2a71f735876f279d672f0c867e3b64f0dd92bbae09d3de2",
        "val_sha256": "6aca34f783325f110ee48d0e89f9f25c50e46f8ffee3dd0328902d72bf663b3a",
        "files": (1700, 90),
    },
    "stdlib-docs": {
        "sha256": "86d5c73276d7fa3353008579e6f8b428b4afb0be1a6c3113153c1f40b2efb580",
        "train_tokens": 5094561,
        "val_tokens": 272422,
        "train_sha256": "6b1f2838e875269c043843d5dfc8977c53d3c4b80802232f9f3b65377cc4463a",
        "val_sha256": "af3607471609b50811ee534666306dd294383c1503ee6bd077280cb1fd4c39b8",
        "files": (1535, 81),
    },
}
PROSE_SUBSET_SHA = "2c1ecaf2921e7aa9da1773f24d984f528e3adc212eb05447d19678e46168623a"  # every 90th file


def _fingerprint() -> str:
    base, rels = data.stdlib_files()
    h = hashlib.sha256()
    for rel in rels:
        h.update(rel.encode() + b"\0" + (base / rel).read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def pinned_python():
    if sys.version_info[:3] != PYTHON or _fingerprint() != FINGERPRINT:
        pytest.skip("the pins are for the Python 3.11.7 standard library they were computed on")


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(PINS))
def test_builtin_corpus_streams_unchanged(pinned_python, name):
    pin = PINS[name]
    c = data.load_corpus(name, vocab_size=256)
    assert c.sha256 == pin["sha256"]
    assert (len(c.train), len(c.val)) == (pin["train_tokens"], pin["val_tokens"])
    assert c.train.dtype == np.uint8 and c.vocab_size == 256  # no end-of-text id by default
    assert (len(c.train_files), len(c.val_files)) == pin["files"]
    assert _sha(c.train) == pin["train_sha256"] and _sha(c.val) == pin["val_sha256"]


def test_prose_extraction_unchanged(pinned_python):
    base, rels = data.stdlib_files()
    h = hashlib.sha256()
    for rel in rels[::90]:
        h.update(rel.encode() + b"\0" + data.stdlib_prose((base / rel).read_bytes()))
    assert h.hexdigest() == PROSE_SUBSET_SHA
