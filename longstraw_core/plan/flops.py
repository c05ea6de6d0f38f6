"""Floating-point work of the decoder layers, from their shapes.

Why here: the stage layout balances it (a stage's share of the compute) and the time model
divides it by a GPU's rate, so both read the same counts. Forward FLOPs only (a multiply-add
is two); ``timing`` applies the backward's multiples. Three parts, because they backpropagate
differently:

- ``matmul``: products with the layer's parameters (for a MoE layer only the experts a
  token is routed to, ``top_k`` of them, and the shared expert): ``2 x active parameters``
  per token. Backward computes the input gradient, and the weight gradient when it trains.
- ``mixing``: token mixing, which backpropagates: full attention's ``Q K^T`` and ``P V``
  (``4 x heads x head_dim`` per query-key pair, causal), MLA's attention in the latent space
  (weight absorption: ``2 x heads x (2 kv_rank + rope_dim)`` per pair, over the DSA
  selection of ``index_topk`` keys once the context is longer), Gated DeltaNet's chunked
  recurrence (a fixed cost per token).
- ``indexer``: the DSA indexer's scores of every query against every earlier key
  (``2 x index_heads x index_dim`` per pair); its top-k selection carries no gradient.

The token mixers' counts are their kinds' (``KindPlan.pair_flops``, ``token_flops``,
``mixing_flops``); the matmuls and the head are counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_core.kinds.planning import causal_pairs
from longstraw_core.plan.model import LayerSpec, ModelSpec

__all__ = [
    "Flops",
    "active_params",
    "causal_pairs",
    "expert_params",
    "head_flops",
    "layer_flops",
    "pair_flops",
    "token_flops",
]


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs, split by how they backpropagate (see the module docstring)."""

    matmul: float = 0.0
    mixing: float = 0.0
    indexer: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.mixing + self.indexer

    def __add__(self, other: Flops) -> Flops:
        return Flops(
            self.matmul + other.matmul, self.mixing + other.mixing, self.indexer + other.indexer
        )

    def scaled(self, factor: float) -> Flops:
        return Flops(self.matmul * factor, self.mixing * factor, self.indexer * factor)


def active_params(spec: ModelSpec, layer: LayerSpec) -> int:
    """Parameters one token passes through: a MoE layer's idle experts excluded."""
    if layer.mlp != "moe":
        return layer.params
    m = layer.mlp_dims
    idle = max(m["experts"] - m["top_k"], 0) * 3 * m["expert_dim"] * spec.hidden
    return layer.params - idle


def expert_params(spec: ModelSpec, layer: LayerSpec) -> int:
    """Parameters of one routed expert (gate, up and down projections); 0 for a dense MLP."""
    if layer.mlp != "moe":
        return 0
    return 3 * layer.mlp_dims["expert_dim"] * spec.hidden


def pair_flops(layer: LayerSpec) -> float:
    """Forward FLOPs per query-key pair of the part that grows with the context: full
    attention, or the DSA indexer (MLA's own attention reads ``index_topk`` keys)."""
    return layer.kind.plan.pair_flops(layer)


def token_flops(spec: ModelSpec, layer: LayerSpec) -> float:
    """Forward FLOPs per token that do not grow with a long context: the matmuls, DeltaNet's
    recurrence, MLA's sparse attention over its ``index_topk`` selected keys."""
    return 2.0 * active_params(spec, layer) + layer.kind.plan.token_flops(layer)


def layer_flops(spec: ModelSpec, layer: LayerSpec, tokens: float, prefix: float) -> Flops:
    """Forward FLOPs of one decoder layer over ``tokens`` tokens after ``prefix`` stored
    positions (a prefill of the whole prompt: ``tokens=N, prefix=0``; one branch:
    ``tokens=T, prefix=N``)."""
    matmul = 2.0 * active_params(spec, layer) * tokens
    mixing, indexer = layer.kind.plan.mixing_flops(layer, tokens, prefix)
    return Flops(matmul, mixing, indexer)


def head_flops(spec: ModelSpec, tokens: float) -> Flops:
    """The LM head over ``tokens`` rows (the final norm and ``log_softmax`` are noise)."""
    return Flops(2.0 * spec.vocab * spec.hidden * tokens)
