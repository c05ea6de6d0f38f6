"""Layer kinds: one module per kind of prefix state, each declaring everything about its kind:
its record, branch record, exact-mode gradient buffer and exact view (``docs/design.md``,
"Prefix state per layer kind"), the ``OffloadPolicy`` field that places it, and the memory
planner's formulas for its layers; it registers them last (``registry.register_kind``).

- ``attention``: full attention (GQA) K/V, ``AttentionKV``, ``AttentionPlan``;
- ``window``: sliding-window attention, the last ``W - 1`` positions' K/V, ``WindowKV``,
  ``WindowPlan`` (full attention's formulas for now);
- ``recurrent``: Gated DeltaNet conv + recurrent state, ``RecurrentState``, ``RecurrentPlan``;
- ``latent``: MLA latent + DSA indexer keys, ``LatentKV``, ``LatentPlan``;
- ``registry``: ``LayerKind`` and the lookups (``kind``, ``kinds``, ``offload_fields``) the
  rest of LongStraw uses instead of naming kinds;
- ``planning``: ``KindPlan``, what the planner asks a kind;
- ``checkpoints``: ``ChunkCheckpoints``, the state at each chunk start that the fixed-size
  records (``window``, ``recurrent``) keep for exact mode's sweep;
- ``forwarding``: ``ForwardedReads``, the declared reads of the wrappers a pass hands
  adapters instead of a record (offload's ``StreamedRecord``, checkpointing's
  ``LayerRecord``);
- ``base``: the protocols every kind implements and adapters call (``LayerState``,
  ``AttentionReads``, ``RecurrentReads``, ``LatentReads``, ``ExactView``, ``GradBuffer``,
  ``BranchState``), their defaults (``RecordBase``, ``ExactViewBase``) and shared helpers.

Import the classes from their kind's module. This package imports none of its modules, so
``longstraw_core.offload`` can import ``forwarding`` and ``registry`` while ``base`` imports
``offload``.
"""
