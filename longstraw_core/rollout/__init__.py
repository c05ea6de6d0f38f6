"""Sampling a group of responses from the prefix state: batched decode (``decode``),
agent turns with ragged decode (``agent_turns``), the sampled group and sampling options."""
