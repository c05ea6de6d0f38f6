"""LongStraw core: prefix state, segmented attention, prefill and branch scoring.

import longstraw_core as ls
adapter = ls.adapt(model)
state = adapter.prefill(prompt_ids, chunk_size=4096)
logps = adapter.score(state, response_ids)
"""

from longstraw_core.attention import segmented_attention
from longstraw_core.state import AttentionKV, PrefixState, format_bytes

# NOTE: imported last: the adapters import the modules above.
from model_adapters import adapt, supported_model_types

__all__ = [
    "AttentionKV",
    "PrefixState",
    "adapt",
    "format_bytes",
    "segmented_attention",
    "supported_model_types",
]
