"""GLM-5.x (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``): MLA + DSA indexer + MoE.

Each layer keeps only its compressed latent: the normalised ``c_kv`` and the roped shared key
``k_pe`` per position (``LatentKV``), plus the DSA indexer's keys on layers that run their
own indexer. The latent is never expanded into per-head keys and values (``docs/design.md``,
"Prefix state per layer kind"):

- **Weight absorption.** ``kv_b_proj`` maps the latent to per-head ``k_nope`` and ``v``. The
  key half is folded into the query (``q_nope W_uk``) and the value half into the output
  (``(P c_kv) W_uv``), so attention runs in latent space over single-"head" keys
  ``[c_kv, k_pe]`` and values ``c_kv``, for the prefix and the span alike.
- **DSA.** A "full" layer's indexer scores every earlier position (prefix and span) per query,
  streaming the keys in blocks and keeping a running top-k; "shared" layers reuse the previous
  full layer's selection. The attention then gathers only the selected latent rows per query
  block. When ``index_topk`` covers every visible position, the selection is everything and
  attention is dense causal: it goes through ``segmented_attention``. The indexer runs under
  ``no_grad``, as in transformers (its projections are frozen).
- **Exact mode.** The record's exact view (``longstraw_core.state.exact.LatentKVExactView``) gives
  a gradient buffer for the latent; both attention paths add the gradient of their prefix
  reads into it (``segmented_attention``'s ``prefix_grads``, or ``index_add_`` of the gathered
  rows in the sparse backward), never building a prefix-sized temporary. The indexer keys
  need none: nothing differentiable flows through the selection.
- **Decoding.** ``B`` branches run at once, each appending its latent and index keys to its
  own ``BranchLatent``; every function here takes a leading batch axis, the prefix latent
  and indexer keys stay shared (the batch is folded into the query axis against them).
- Everything else is the model's own modules (norms, projections, RoPE functions, router,
  experts, shared experts), so LoRA and checkpoints keep working.

The family lives in this package, one job per module: ``family`` (its declaration: LoRA
targets, tiny configs, the preset, and the block budget the planner reads), ``absorb``
(weight absorption and the MLA projections), ``dsa`` (the indexer and its streamed top-k),
``mla`` (latent attention, dense and sparse, and the sparse path's backward) and ``adapter``
(the layer, registered with ``@register_adapter``).
"""

from model_adapters.glm52.absorb import absorbed_weights, effective_weight, mla_projections
from model_adapters.glm52.adapter import GlmMoeDsaAdapter
from model_adapters.glm52.dsa import indexer_projections, select_topk
from model_adapters.glm52.family import FAMILY, work_elements
from model_adapters.glm52.mla import latent_attention

__all__ = [
    "FAMILY",
    "GlmMoeDsaAdapter",
    "absorbed_weights",
    "effective_weight",
    "indexer_projections",
    "latent_attention",
    "mla_projections",
    "select_topk",
    "work_elements",
]
