"""The run's settings as types: the config sections and ``RunConfig`` (``run_config``),
and GRPO's hyper-parameters under TRL's names (``grpo``). Reads nothing outside itself;
``longstraw_core.config`` loads and validates them."""
