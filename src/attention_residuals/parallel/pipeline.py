"""The pipeline layout of Block AttnRes (and of the rules it covers) and its cross-stage traffic,
counted and in closed form.

The runtime that trains with it is :mod:`.pipelining` (torch.distributed.pipelining); this module
is the arithmetic both it and ``attnres bench dist`` use.

Layout (the report's section 4.1): the ``L`` sublayers are cut into ``C = P * V`` contiguous
chunks; chunk ``c`` runs on physical rank ``c % P`` as its virtual stage ``c // P``
(interleaved assignment). Chunk 0 also computes the embedding ``b_0``; chunk ``C - 1`` the final
readout, norm, LM head and loss.

What travels. Block AttnRes has no single hidden state: a layer's input is depth attention over
the completed blocks ``[b_0, b_1, ...]`` plus the open partial sum. So the state handed from
chunk ``c - 1`` to chunk ``c`` is those blocks plus the partial (when the boundary falls inside
a block). Three schemes decide which of them go on the wire at each hop:

``naive``       every hop sends every completed block and the partial.
``cached``      the report's scheme: a rank keeps the blocks it **received** (and ``b_0`` on rank
                0, which it computes as chunk 0's input) for its later virtual stages, so a hop
                sends only the blocks the receiver has not received before, plus the partial.
``cached_all``  also keeps the blocks a rank **computed** itself (they are in its memory for the
                backward pass anyway), so a later-stage hop skips those too.

The sender knows what the receiver holds from the static layout alone (no handshake).
Backward sends, on every hop, the gradients of exactly the tensors that hop sent forward, so
backward traffic equals forward traffic. :mod:`.pipelining` runs ``naive`` and ``cached``;
``cached_all`` is counted here only (caching blocks a rank computed would need their gradient
folded back into the stage that computed them).

Traffic per token in units of ``d`` elements (:func:`derived_transfers`), with
``e_j`` = sublayers in the first ``j`` chunks and ``S`` the block size::

    naive       sum_{j=1}^{C-1} (1 + ceil(e_j / S))
    cached      sum_{j=1}^{P-1} (1 + ceil(e_j / S)) + sum_{j=P}^{C-1} (ceil(e_j / S) - floor(e_{j-P} / S))
    cached_all  sum_{j=1}^{P-1} (1 + ceil(e_j / S)) + sum_{j=P}^{C-1} (ceil(e_j / S) - floor(e_{j-P+1} / S))

(the ``1`` is ``b_0``; ``ceil`` counts the partial). When every chunk holds ``N_p`` whole blocks
(``e_j = j N_p S``) these are the report's formulas plus ``b_0``::

    naive       C(C-1)/2 N_p + (C-1)
    cached      P(P-1)/2 N_p + (V-1) P^2 N_p + (P-1)
    cached_all  P(P-1)/2 N_p + (V-1) P(P-1) N_p + (P-1)

(:func:`report_transfers` gives the report's two formulas).

Other rules. Full AttnRes (and input-independent mixing) keeps every sublayer output ``v_j`` as a
source: its layout is Block's with ``S = 1`` (each output a block, never a partial), cache
included. PreNorm and mHC-lite hand their one state across each hop (``hidden``): ``C - 1`` states
per token (PreNorm's ``h``: ``d`` elements; mHC's ``m`` streams: ``m d``), nothing to cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "PIPELINE_HIDDEN",
    "PIPELINE_STATE",
    "SCHEMES",
    "PipelineLayout",
    "aligned_transfers",
    "derived_transfers",
    "report_transfers",
]

SCHEMES = ("naive", "cached", "cached_all")

#: the rules a pipeline carries: the ``ResidualState`` field their state crosses a hop in (a list
#: of sources, or one tensor). SWA drops sources out of its window and DenseFormer carries a mix
#: beside its sources: neither is pipelined.
PIPELINE_STATE = {"block": "blocks", "full": "values", "mixing": "values", "prenorm": "h", "mhc": "streams"}
#: the rules whose state is one tensor (a hidden state), not a list of sources
PIPELINE_HIDDEN = ("prenorm", "mhc")


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")


@dataclass(frozen=True)
class PipelineLayout:
    """Which sublayers each chunk runs and which blocks each hop carries.

    ``bounds[c] : bounds[c + 1]`` are the sublayers of chunk ``c``; chunk ``c`` lives on rank
    ``c % stages`` as virtual stage ``c // stages``. ``hidden``: the state is one tensor (PreNorm),
    whatever ``block_size`` says.
    """

    n_layers: int
    block_size: int
    stages: int
    virtual: int
    bounds: tuple[int, ...]
    hidden: bool = False

    @classmethod
    def build(
        cls,
        n_layers: int,
        block_size: int,
        stages: int,
        virtual: int = 1,
        chunk_layers: list[int] | None = None,
        hidden: bool = False,
    ) -> PipelineLayout:
        """Even split (the first ``L mod C`` chunks get one more sublayer) or ``chunk_layers``."""
        for name, value in (
            ("n_layers", n_layers),
            ("block_size", block_size),
            ("stages", stages),
            ("virtual", virtual),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        C = stages * virtual
        if chunk_layers is None:
            if n_layers < C:
                raise ValueError(
                    f"stages * virtual = {C} chunks need at least {C} sublayers, the model has L={n_layers}"
                )
            base, extra = divmod(n_layers, C)
            chunk_layers = [base + (1 if c < extra else 0) for c in range(C)]
        if len(chunk_layers) != C or any(n < 1 for n in chunk_layers) or sum(chunk_layers) != n_layers:
            raise ValueError(
                f"chunk_layers: expected {C} positive sizes summing to L={n_layers}, got {chunk_layers}"
            )
        bounds = [0]
        for n in chunk_layers:
            bounds.append(bounds[-1] + n)
        return cls(n_layers, block_size, stages, virtual, tuple(bounds), hidden)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, chunk: int) -> int:
        return chunk % self.stages

    def chunks_of(self, rank: int) -> list[int]:
        return [rank + v * self.stages for v in range(self.virtual)]

    def layers(self, chunk: int) -> range:
        return range(self.bounds[chunk], self.bounds[chunk + 1])

    def state_after(self, j: int) -> tuple[int, bool]:
        """``(completed blocks including b_0, partial open?)`` once the first ``j`` chunks ran
        (``(1, False)`` for a hidden state: the one tensor)."""
        if self.hidden:
            return 1, False
        e = self.bounds[j]
        return 1 + e // self.block_size, e % self.block_size != 0

    def known_before(self, chunk: int, scheme: str) -> int:
        """How many leading blocks ``b_0 ...`` the rank of ``chunk`` holds before receiving its input."""
        _check_scheme(scheme)
        if scheme == "naive" or chunk < self.stages or self.hidden:
            return 0
        prev = chunk - self.stages  # the same rank's previous virtual stage
        return self.state_after(prev if scheme == "cached" else prev + 1)[0]

    def hop(self, chunk: int, scheme: str) -> tuple[int, int, bool]:
        """Hop into ``chunk`` (``1 <= chunk < C``): ``(first block sent, blocks in the state, partial sent?)``;
        blocks ``first .. n - 1`` travel."""
        if not 1 <= chunk < self.chunks:
            raise ValueError(f"chunk: hops go into chunks 1..{self.chunks - 1}, got {chunk}")
        n, partial = self.state_after(chunk)
        return self.known_before(chunk, scheme), n, partial

    def tensors_sent(self, chunk: int, scheme: str) -> int:
        first, n, partial = self.hop(chunk, scheme)
        return n - first + int(partial)

    def transfers(self, scheme: str) -> int:
        """``[*, d]`` tensors sent per token over all hops of one forward pass."""
        return sum(self.tensors_sent(c, scheme) for c in range(1, self.chunks))

    def aligned_blocks_per_chunk(self) -> int | None:
        """``N_p`` when every chunk holds the same whole number of blocks (the report's setting)."""
        sizes = {self.bounds[c + 1] - self.bounds[c] for c in range(self.chunks)}
        if len(sizes) != 1:
            return None
        size = sizes.pop()
        return size // self.block_size if size % self.block_size == 0 else None


def derived_transfers(bounds: list[int] | tuple[int, ...], block_size: int, stages: int, scheme: str) -> int:
    """Closed form of the tensors per token sent in one forward pass (see the module docstring)."""
    _check_scheme(scheme)
    S, P = block_size, stages
    C = len(bounds) - 1
    e = list(bounds)
    total = 0
    for j in range(1, C):
        if scheme == "naive" or j < P:
            total += 1 + math.ceil(e[j] / S)
        elif scheme == "cached":
            total += math.ceil(e[j] / S) - e[j - P] // S
        else:
            total += math.ceil(e[j] / S) - e[j - P + 1] // S
    return total


def aligned_transfers(stages: int, virtual: int, blocks_per_chunk: int, scheme: str) -> int:
    """The closed forms when every chunk holds ``N_p`` whole blocks: the report's formulas plus ``b_0``."""
    _check_scheme(scheme)
    P, V, Np = stages, virtual, blocks_per_chunk
    C = P * V
    if scheme == "naive":
        return C * (C - 1) // 2 * Np + (C - 1)
    if scheme == "cached":
        return P * (P - 1) // 2 * Np + (V - 1) * P * P * Np + (P - 1)
    return P * (P - 1) // 2 * Np + (V - 1) * P * (P - 1) * Np + (P - 1)


def report_transfers(stages: int, virtual: int, blocks_per_chunk: float) -> dict[str, float]:
    """The report's per-token counts (units of ``d``): ``C(C-1)/2 N_p`` and ``P(P-1)/2 N_p + (V-1) P^2 N_p``."""
    P, V, Np = stages, virtual, blocks_per_chunk
    C = P * V
    return {"naive": C * (C - 1) / 2 * Np, "cached": P * (P - 1) / 2 * Np + (V - 1) * P * P * Np}
