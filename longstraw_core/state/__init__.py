"""The prefix state: what later tokens read of a prompt run once without autograd
(``prefix``), and exact gradients through it (``exact``: ``dS`` and the reverse chunk sweep)."""
