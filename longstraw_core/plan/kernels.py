"""The attention kernels' scratch, sized from their own block budgets.

The budgets are read when called, from the modules that use them:
``attention.kernel_budgets()`` (the pure-torch loop's score blocks, the flash-attn and fused
CPU backward's key chunks) and, for a family's own kernels, the budgets it declares
(``registry.kernel_budget``: GLM-5.2's ``sparse_work_elements``, DSA search and sparse latent
blocks).
"""

from __future__ import annotations

import functools

from longstraw_core.adapters import registry
from longstraw_core.attention import kernel_budgets
from longstraw_core.plan.units import FP32, INT64


def work_elements(device: str) -> int:
    """The sparse latent attention's block budget (``glm52.work_elements``)."""
    return registry.kernel_budget("sparse_work_elements", device)


def flash_backward_scratch(
    kv_heads: int, rows: int, head_dim: int, keys: int, state_bytes: int
) -> int:
    """flash-attn backward per chunk of keys: dK/dV of the chunk (fp32 when they are added
    into dS), the queries' fp32 gradient accumulator."""
    chunk = min(keys, kernel_budgets()["flash_bwd_keys"])
    return 2 * kv_heads * chunk * head_dim * (state_bytes + FP32) + FP32 * rows * head_dim


def fused_backward_scratch(kv_heads: int, rows: int, head_dim: int, keys: int) -> int:
    """PyTorch's fused CPU kernel per chunk of keys: dK/dV (fp32), the queries' gradient."""
    chunk = min(keys, kernel_budgets()["fused_bwd_keys"])
    return 2 * kv_heads * chunk * head_dim * FP32 + FP32 * rows * head_dim


def blocked_scratch(
    kv_heads: int, rows: int, dk: int, dv: int, keys: int, state_bytes: int, backward: bool
) -> int:
    """``attention.torch_backend._segment_forward`` / ``_segment_backward``'s pure-torch loop
    over blocks of keys, as ``attention.blocks.block_length`` sizes them (a block's scores and
    K/V under the ``score_elements`` budget). Forward holds a block's scores, shifted scores
    and probabilities, backward also the probabilities' gradients; from the second block on,
    the previous block's tensors stay bound until the new ones replace them. Blocks of a
    16-bit state are cast to float32 as they are read."""
    if keys <= 0:
        return 0
    per_key = kv_heads * rows + kv_heads * (dk + dv)
    block = min(keys, max(1, kernel_budgets()["score_elements"] // per_key))
    alone, carried = (5, 4) if backward else (3, 2)  # a block's own; the previous one's
    sizes = [FP32 * kv_heads * rows * n for n in _block_sizes(keys, block)]
    scratch = max(
        max(alone * now, carried * before + 2 * now)
        for now, before in zip(sizes, [0, *sizes], strict=False)
    )
    if state_bytes < FP32:  # forward casts keys, then values; backward keeps the keys
        scratch += FP32 * kv_heads * block * ((dk + dv) if backward else max(dk, dv))
    return scratch + 2 * FP32 * kv_heads * rows * max(dk, dv)  # output / dq accumulators


def sparse_attention_scratch(
    d: dict[str, int], tokens: int, batch: int, device: str, state_bytes: int, backward: bool
) -> int:
    """``glm52._SparseLatentAttention``'s scratch, block of queries by block, as the code
    allocates it (checked on fake tensors at GLM-5.2's widths, tests/plan/test_scale_check.py):

    - the gather (``_gather_rows``): the span's and the prefix's rows in the state's dtype and
      their selection, then the selection's float32 copy (``rows``);
    - forward: ``rows`` and two float32 ``[b, H, k]`` score tensors; backward: ``rows``,
      ``d_rows`` and four score tensors, with one more float32 row set at a time (the value
      part's product, then the rows ``_scatter_rows`` selects);
    - from the second block on, the previous block's tensors stay bound while the next
      block gathers.
    """
    topk, heads = d["index_topk"], d["heads"]
    dim, value = d["kv_rank"] + d["rope_dim"], d["kv_rank"]
    step = max(1, work_elements(device) // (batch * topk * 3 * (dim + heads)))
    selected = batch * min(tokens, step) * topk  # gathered rows per block
    rows, scores = FP32 * selected * dim, FP32 * selected * heads
    gather = selected * dim * max(3 * state_bytes, state_bytes + FP32)
    if backward:
        kept = 2 * rows + 4 * scores
        inside = kept + FP32 * selected * max(dim, value)
    else:
        kept = inside = rows + 2 * scores
    if tokens <= step:
        return max(gather, inside)
    return max(inside, kept + gather)


def select_topk_peak(d: dict[str, int], tokens: int, prefix: int, batch: int, device: str) -> int:
    """Peak scratch of ``glm52.select_topk``, replayed block by block as the code runs.

    During one block's index scores, the previous block's concatenated scores (fp32) and
    positions (int64) are still bound, next to this block's scores and two products
    ``[B, T, heads_step, n]`` (the matmul and its scaled relu).
    """
    work = work_elements(device)
    return _select_topk_peak(d["index_topk"], d["index_heads"], tokens, prefix, batch, work)


@functools.lru_cache(maxsize=1 << 16)
def _select_topk_peak(
    topk: int, heads: int, tokens: int, prefix: int, batch: int, work: int
) -> int:
    """``select_topk_peak`` of plain numbers, remembered: the planner's searches (the largest
    chunk that fits, each fix) ask for the same layers' peaks hundreds of thousands of times."""
    rows = batch * tokens
    block = max(topk, work // rows)
    sizes = _block_sizes(prefix, block) + _block_sizes(tokens, block)
    peak, kept, previous = 0, 0, 0
    for n in sizes:
        step = min(heads, max(1, work // (rows * n)))
        scores = FP32 * rows * n
        steps = [step] * (heads // step) + ([heads % step] if heads % step else [])
        products = [FP32 * rows * h * n for h in steps]
        # the matmul and its scaled relu, next to the previous step's relu (still bound)
        inner = max(2 * now + before for now, before in zip(products, [0, *products], strict=False))
        peak = max(peak, previous + scores + inner)
        joined = rows * (kept + n)
        peak = max(peak, (FP32 + INT64) * joined + FP32 * rows * n)
        previous = (FP32 + INT64) * joined
        kept = min(topk, kept + n)
    return peak


def _block_sizes(length: int, block: int) -> list[int]:
    """The sizes of ``length`` rows in blocks of ``block``, with runs of full blocks cut to
    two: a block's scratch depends only on its own size and the previous block's."""
    if length <= 0:
        return []
    full, rest = divmod(length, block)
    return [block] * min(full, 2) + ([rest] if rest else [])
