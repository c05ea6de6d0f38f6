"""What a run trains, built from its config: the model with LoRA (``build``), sharded
loading, tiny models, bf16 working weights, export, the SFT warm start."""
