"""CPU offload of the prefix state: where each layer type's state lives, and the stream that
brings offloaded layers to the compute device one layer at a time.

At millions of tokens the state outgrows the accelerator (every full-attention layer's K/V
grows with the prompt). ``OffloadPolicy`` keeps chosen layer types in CPU memory (pinned when
the model runs on CUDA): prefill copies each chunk's state out as soon as it is computed, and every
pass that reads the state (branch replay, exact mode's sweep, rollout) goes through
``stream_layers``, which hands the adapter each offloaded layer as a short-lived device copy.

- **Forward.** At most ``resident_layers`` offloaded layers are on the device at once: the
  layer computing and the next ones in flight. On CUDA the copies run on a side stream that
  first waits for the compute stream (so a copy reads what prefill has already written); the
  compute stream waits on the copy's event before it reads it, and the copy is marked as used
  by the compute stream (``record_stream``) so the allocator cannot hand its memory out while
  kernels still read it. A layer's copy is dropped before the next one beyond the budget is
  fetched.
- **Backward.** Autograd would keep every layer's copy alive in the graph until backward,
  pinning the whole state on the device. Saved-tensor hooks replace a saved copy (or any view
  of one) by a handle, and backward fetches it again when a node needs it: layers stream back
  in reverse order, with the previous layer prefetched while the budget allows.
- **Exact mode.** ``dS`` of an offloaded layer is created beside its state (in CPU memory).
  The attention kernels and gradient sinks add each block's gradient straight into it (they
  move the block to the sink's device), so no state-sized buffer ever appears on the device.
  The D2H traffic is one state's worth per branch, inherent to keeping ``dS`` off the device;
  on CUDA each block's copy is synchronous (correct; not yet overlapped with compute).

Without CUDA the same code runs with both sides in CPU memory: the "device" copy is a real
copy, so the residency accounting (``Residency``) means the same thing and tests can check it.

NOTE: what has been run. Everything on CPU. The CUDA path (pinned memory, side stream, events,
``record_stream``, asynchronous copies into pinned memory at prefill) has NOT been run: it was
written from the PyTorch stream semantics without a GPU.
Import from here; the modules hold one job each:

- ``policy``: ``OffloadPolicy`` (where each layer type lives) and ``home_options``.
- ``stream``: ``stream_layers``, ``LayerStream`` (forward window, saved-tensor hooks,
  backward refetch and prefetch); ``StreamedRecord`` (an offloaded record during one
  layer) is the kinds' (``kinds.forwarding``).
- ``transfer``: the copies to the device (side stream, events, ``copy_rows``).
- ``residency``: ``Residency``, the accounting of copies on the device.
- ``pinned``: exactly sized pinned arenas for the records' CPU homes (``empty_buffers``),
  instead of the caching host allocator's power-of-two blocks.
"""

from longstraw_core.kinds.forwarding import StreamedRecord
from longstraw_core.offload.policy import (
    PLACEMENTS,
    OffloadPolicy,
    home_options,
    placement_fields,
)
from longstraw_core.offload.residency import Residency
from longstraw_core.offload.stream import LayerStream, stream_layers
from longstraw_core.tensors.device_copy import copy_rows

__all__ = [
    "PLACEMENTS",
    "LayerStream",
    "OffloadPolicy",
    "Residency",
    "StreamedRecord",
    "copy_rows",
    "home_options",
    "placement_fields",
    "stream_layers",
]
