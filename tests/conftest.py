"""Shared test settings."""

import torch

# Tiny models spend more time synchronising threads than computing; one thread is faster
# and keeps timings steady when the 2-core CI machine is busy.
torch.set_num_threads(1)
