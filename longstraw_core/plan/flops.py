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
"""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_core.plan.model import LayerSpec, ModelSpec

_DELTA_CHUNK = 64  # the chunk of the gated delta rule's chunked form (fla and torch alike)


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


def causal_pairs(tokens: float, prefix: float, window: float | None = None) -> float:
    """Query-key pairs of ``tokens`` queries after ``prefix`` stored positions, each query
    seeing every earlier position and itself, or at most ``window`` of them."""
    if tokens <= 0:
        return 0.0
    first, last = prefix + 1, prefix + tokens  # keys the first and the last query see
    if window is None or last <= window:
        return (first + last) * tokens / 2
    if first >= window:
        return window * tokens
    return (first + window) * (window - first + 1) / 2 + (last - window) * window


def deltanet_token_flops(dims: dict[str, int]) -> float:
    """Gated DeltaNet's chunked recurrence per token: the state's read, correction and
    update (three ``key_dim x value_dim`` products a head) and the intra-chunk scores and
    values (chunks of 64)."""
    heads, dk, dv = dims["value_heads"], dims["key_dim"], dims["value_dim"]
    conv = 2 * dims["conv_dim"] * dims["kernel"]
    return heads * (6 * dk * dv + 4 * _DELTA_CHUNK * (dk + dv)) + conv


def mla_pair_flops(dims: dict[str, int]) -> float:
    """MLA with weight absorption, per query-key pair: scores over the latent and its rope
    part, values over the latent."""
    return 2 * dims["heads"] * (2 * dims["kv_rank"] + dims["rope_dim"])


def pair_flops(layer: LayerSpec) -> float:
    """Forward FLOPs per query-key pair of the part that grows with the context: full
    attention, or the DSA indexer (MLA's own attention reads ``index_topk`` keys)."""
    d = layer.dims
    if layer.mixer in ("attention", "gated_attention"):
        return 4 * d["heads"] * d["head_dim"]
    if layer.mixer == "mla" and d["indexer"]:
        return 2 * d["index_heads"] * d["index_dim"]
    return 0.0


def token_flops(spec: ModelSpec, layer: LayerSpec) -> float:
    """Forward FLOPs per token that do not grow with a long context: the matmuls, DeltaNet's
    recurrence, MLA's sparse attention over its ``index_topk`` selected keys."""
    flops = 2.0 * active_params(spec, layer)
    if layer.mixer == "deltanet":
        flops += deltanet_token_flops(layer.dims)
    elif layer.mixer == "mla":
        flops += mla_pair_flops(layer.dims) * layer.dims["index_topk"]
    return flops


def layer_flops(spec: ModelSpec, layer: LayerSpec, tokens: float, prefix: float) -> Flops:
    """Forward FLOPs of one decoder layer over ``tokens`` tokens after ``prefix`` stored
    positions (a prefill of the whole prompt: ``tokens=N, prefix=0``; one branch:
    ``tokens=T, prefix=N``)."""
    d = layer.dims
    matmul = 2.0 * active_params(spec, layer) * tokens
    if layer.mixer in ("attention", "gated_attention"):
        return Flops(matmul, pair_flops(layer) * causal_pairs(tokens, prefix))
    if layer.mixer == "deltanet":
        return Flops(matmul, deltanet_token_flops(d) * tokens)
    mixing = mla_pair_flops(d) * causal_pairs(tokens, prefix, d["index_topk"])
    indexer = pair_flops(layer) * causal_pairs(tokens, prefix)
    return Flops(matmul, mixing, indexer)


def head_flops(spec: ModelSpec, tokens: float) -> Flops:
    """The LM head over ``tokens`` rows (the final norm and ``log_softmax`` are noise)."""
    return Flops(2.0 * spec.vocab * spec.hidden * tokens)
