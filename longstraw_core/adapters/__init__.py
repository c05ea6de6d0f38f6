"""The adapter contract: what every model family implements and how the core finds it.

``base.ModelAdapter`` (prefill, score, sweep, replay over a family's layers), its staged
(pipeline) and sharded passes (``staged``, ``parallel``), recompute, the chunked LM head
(``lm_head``), input validation, the ``ModelFamily`` record a family declares (``family``), the
registry that collects them (``registry``) and ``lookup.adapt``. Families live on top, in
``model_adapters/`` (or a package of one's own), and register themselves here.

This package's ``__init__`` imports nothing: the registry is read by low floors (the offload
policy, the config), which must not pull the adapter base in with it. Import the submodules
(``longstraw_core.adapt`` and ``longstraw_core.ModelAdapter`` are the short names).
"""
