"""Checkpoints that a stopped run resumes from exactly: weights, optimizer, RNG, data position.

Layout under the run's output directory::

    <output_dir>/step-000010/model/          save_pretrained: full weights, or only the PEFT
                                             adapters of a LoRA model
    <output_dir>/step-000010/optimizer.pt    optimizer.state_dict() (whole tensors)
    <output_dir>/step-000010/scheduler.pt    lr_scheduler.state_dict() (when there is one)
    <output_dir>/step-000010/rng.pt          python, numpy, torch CPU and CUDA generator states
                                             (of rank 0 in a distributed run)
    <output_dir>/step-000010/rng-rank1.pt    ... of rank 1, and so on (distributed runs only)
    <output_dir>/step-000010/trainer_state.json  step, data position, ``extra`` (metrics history)
    <output_dir>/step-000010/manifest.json   written last: every other file of the checkpoint
                                             (recursively) with its size in bytes and sha256
    <output_dir>/latest                      the name of the newest complete checkpoint, for
                                             people and tools; never trusted on its own
    <output_dir>/.tmp-step-000012/           a save in progress
    <output_dir>/incomplete/step-000012-<unix time>/      set aside: a ``step-*`` directory
    <output_dir>/incomplete/tmp-step-000012-<unix time>/  or a ``.tmp-*`` one that a stopped
                                             save left behind
    <output_dir>/superseded-<unix time>/step-000014/      set aside by ``prepare_resume``: a
                                             checkpoint later than the one a run resumed from

Every JSON file is strict JSON (no ``NaN`` or ``Infinity``). ``manifest.json`` is
``{"format_version": 2, "step": N, "files": [{"path", "size", "sha256"}, ...]}``, paths
relative to the checkpoint and ``/``-separated.

A checkpoint is written into ``.tmp-step-NNNNNN``, ``manifest.json`` last (after every file is
hashed and fsynced), and renamed to ``step-NNNNNN`` (``os.replace`` of a directory is atomic
on POSIX); then ``latest`` is replaced the same way. A checkpoint is *complete* when its
manifest parses and every file it lists exists with the listed size (a cheap check, made when
scanning); ``load_checkpoint`` also compares every file's sha256 (``verify=True``). Resuming
from ``"latest"`` or from an output directory means the complete checkpoint with the highest
step there, whatever the ``latest`` file says, so a run stopped at any instant resumes from the
last checkpoint it finished. Incomplete ``step-*`` directories and stale ``.tmp-*`` ones are
skipped when resolving and moved into ``incomplete/`` by the next save (with a warning); nothing
found on disk is deleted except by ``keep_last``, which removes complete checkpoints beyond the
newest K (renamed to ``.deleting-step-*`` first, so a stop mid-way leaves no half checkpoint).
A complete ``step-*`` directory is never overwritten, and a step is not saved while the
directory holds a later complete one (the ``latest`` it would resolve to would be the later
one): a run resumed from an earlier checkpoint first calls ``prepare_resume``, which moves the
later ones into ``superseded-<unix time>/``. A checkpoint of another format (format 1 had no
manifest) is refused wherever it is met, loading, resolving or saving beside it, with one line
naming its format and this one's (``FormatError``): start a new output directory, or resume it
with the LongStraw version that wrote it.

Distributed runs (``torch.distributed`` initialised): every rank calls ``save_checkpoint``,
``load_checkpoint`` and ``prepare_resume``, with the same arguments. A model sharded by FSDP2
(``DTensor`` parameters) is gathered whole onto rank 0's CPU with
``torch.distributed.checkpoint``'s ``get_model_state_dict`` / ``get_optimizer_state_dict``
(``full_state_dict``, ``cpu_offload``; a LoRA model gathers only its trainable adapters), and
every rank's RNG states are collected; rank 0 alone writes, in the layout above, so a checkpoint
of a sharded run is the same files as one of a single process and either resumes the other (the
optimizer state is stored by parameter index, as ``optimizer.state_dict()`` does). Loading, rank
0 checks the files (manifest, sizes, checksums, LoRA or full weights, key names and shapes) while
the others wait, then reads the weights and the optimizer state and ``set_model_state_dict`` /
``set_optimizer_state_dict`` broadcast them (``broadcast_from_rank0``: one whole copy in host
memory, on rank 0); each rank reads its own RNG file, so ``output_dir`` must be on a filesystem
every rank sees. Rank 0 alone moves directories. A failure on rank 0 (a checkpoint that already
exists, a full disk, a corrupt file, weights that do not match) is raised on every rank rather
than leaving the others waiting in a collective. Gathering the whole model on one host is simple
but bounded by its memory; very large full fine-tunes would want ``torch.distributed.checkpoint``'s
sharded format instead.

Import from here; the modules hold one job each:

- ``saving``: ``save_checkpoint`` and the stages of rank 0's write (the failpoints).
- ``kept``: ``StepCheckpoints``, a run's saves, and the last finished step kept in rank 0's
  host memory for a stop signal to write at once (no collective).
- ``restore``: ``load_checkpoint`` and the ``ResumeInfo`` it returns.
- ``resolution``: what a directory holds: complete, incomplete and later checkpoints,
  ``resolve_checkpoint``, ``complete_checkpoints``, ``prepare_resume``, ``keep_last`` pruning.
- ``files``: file and format names, ``trainer_state.json``, the sha256 manifest, atomic and
  fsynced writes.
- ``checks``: rank 0's checks before loading (kind, names, shapes, optimizer groups).
- ``reading``: ``weights_only`` loads, safetensors headers, saved adapter names, tied weights.
- ``model_state`` and ``sharded``: model, optimizer and scheduler state, in one process or
  gathered from and broadcast into FSDP2 shards.
- ``rng``: the random generator states, one file per rank.
- ``ranks``: rank 0 acts, the others wait, rank 0's error raised on every rank.
- ``space``: the bytes a save needs, checked before writing; a full disk as one line.
- ``errors``: ``CheckpointError`` and the wording of its messages.
"""

from longstraw_core.checkpoint.errors import CheckpointError, FormatError
from longstraw_core.checkpoint.files import (
    FORMAT_VERSION,
    INCOMPLETE,
    LATEST,
    MANIFEST,
    TRAINER_STATE,
    checkpoint_name,
)
from longstraw_core.checkpoint.kept import StepCheckpoints
from longstraw_core.checkpoint.resolution import (
    complete_checkpoints,
    prepare_resume,
    resolve_checkpoint,
)
from longstraw_core.checkpoint.restore import ResumeInfo, load_checkpoint
from longstraw_core.checkpoint.saving import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "INCOMPLETE",
    "LATEST",
    "MANIFEST",
    "TRAINER_STATE",
    "CheckpointError",
    "FormatError",
    "ResumeInfo",
    "StepCheckpoints",
    "checkpoint_name",
    "complete_checkpoints",
    "load_checkpoint",
    "prepare_resume",
    "resolve_checkpoint",
    "save_checkpoint",
]
