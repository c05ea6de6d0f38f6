"""Layer kinds: one module per kind of prefix state, each holding the kind's record, branch
record, exact-mode gradient buffer and exact view (``docs/design.md``, "Prefix state per
layer kind").

- ``attention``: full attention (GQA) K/V, ``AttentionKV``;
- ``recurrent``: Gated DeltaNet conv + recurrent state, ``RecurrentState``;
- ``latent``: MLA latent + DSA indexer keys, ``LatentKV``;
- ``forwarding``: ``ForwardedReads``, the declared reads of the wrappers a pass hands
  adapters instead of a record (offload's ``StreamedRecord``, checkpointing's
  ``LayerRecord``);
- ``base``: the protocols every kind implements and adapters call (``LayerState``,
  ``AttentionReads``, ``RecurrentReads``, ``LatentReads``, ``ExactView``, ``GradBuffer``,
  ``BranchState``), their defaults (``RecordBase``, ``ExactViewBase``) and shared helpers.

``longstraw_core.state`` and ``longstraw_core.exact`` re-export the classes under their
historical names. This
package imports none of its modules, so ``longstraw_core.offload`` can import
``forwarding`` while ``base`` imports ``offload``.
"""
