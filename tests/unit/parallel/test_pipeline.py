"""The pipeline layout's traffic: counted per hop, in closed form, and the report's formulas.
(The runtime that sends it: tests/integration/parallel/test_pipelining.py.)"""

import itertools

import pytest
import torch

from attention_residuals.parallel import (
    SCHEMES,
    PipelineLayout,
    aligned_transfers,
    derived_transfers,
    report_transfers,
)


def test_figure3_numbers():
    """P = 4, V = 2, one block per chunk: the report says caching saves 6 block transfers."""
    rep = report_transfers(4, 2, 1)
    assert rep == {"naive": 28, "cached": 22}
    assert aligned_transfers(4, 2, 1, "naive") == 28 + 7  # + b_0 on each of the C - 1 = 7 hops
    assert aligned_transfers(4, 2, 1, "cached") == 22 + 3  # + b_0 on the first P - 1 = 3 hops
    assert aligned_transfers(4, 2, 1, "cached_all") == 22 - 4 + 3  # the receivers' own blocks stay


@pytest.mark.parametrize("P,V,S,Np", list(itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3], [1, 2])))
def test_layout_aligned_matches_report_formulas(P, V, S, Np):
    C = P * V
    layout = PipelineLayout.build(C * Np * S, S, P, V)
    assert layout.aligned_blocks_per_chunk() == Np
    rep = report_transfers(P, V, Np)
    for scheme in SCHEMES:
        count = layout.transfers(scheme)
        assert count == derived_transfers(layout.bounds, S, P, scheme) == aligned_transfers(P, V, Np, scheme)
    assert layout.transfers("naive") == rep["naive"] + (C - 1)
    assert layout.transfers("cached") == rep["cached"] + (P - 1)


def test_layout_general_matches_closed_form():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        P, V, S = (int(torch.randint(1, 5, (1,), generator=g)) for _ in range(3))
        sizes = torch.randint(1, 5, (P * V,), generator=g).tolist()
        layout = PipelineLayout.build(sum(sizes), S, P, V, chunk_layers=sizes)
        for scheme in SCHEMES:
            assert layout.transfers(scheme) == derived_transfers(layout.bounds, S, P, scheme)
        assert layout.transfers("cached_all") <= layout.transfers("cached") <= layout.transfers("naive")


def test_layout_errors():
    with pytest.raises(ValueError, match="chunks need at least"):
        PipelineLayout.build(4, 1, 4, 2)
    with pytest.raises(ValueError, match="chunk_layers"):
        PipelineLayout.build(4, 1, 2, 1, chunk_layers=[1, 2])
    with pytest.raises(ValueError, match="scheme"):
        PipelineLayout.build(4, 1, 2, 1).transfers("fast")
