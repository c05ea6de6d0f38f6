"""Layer kinds: one module per kind of prefix state, each holding the kind's record, branch
record, exact-mode gradient buffer and exact view (``docs/design.md``, "Prefix state per
layer kind").

- ``attention``: full attention (GQA) K/V, ``AttentionKV``;
- ``recurrent``: Gated DeltaNet conv + recurrent state, ``RecurrentState``;
- ``latent``: MLA latent + DSA indexer keys, ``LatentKV``;
- ``base``: the protocols every kind implements and adapters call (``LayerState``,
  ``AttentionReads``, ``RecurrentReads``, ``LatentReads``, ``ExactView``, ``GradBuffer``,
  ``BranchState``), their defaults (``RecordBase``, ``ExactViewBase``) and shared helpers.

``longstraw_core.state`` and ``longstraw_core.exact`` re-export the classes under their
historical names.
"""

from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.kinds.latent import LatentKV
from longstraw_core.kinds.recurrent import RecurrentState

# Every record kind, in ``OffloadPolicy`` field order.
RECORD_KINDS = (AttentionKV, RecurrentState, LatentKV)

__all__ = ["RECORD_KINDS", "AttentionKV", "LatentKV", "RecurrentState"]
