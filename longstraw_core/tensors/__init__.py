"""Tensors and memory with no model: fake tensors and the CUDA emulation for dry runs,
memory accounting, NF4 quantization, pinned arenas, device copies, peft module types."""
