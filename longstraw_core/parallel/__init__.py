"""A run over ranks: FSDP2 over the adapter's model, GRPO groups spread across ranks, pipeline
stages laid out as a stage x replica mesh.

``shard_model(adapter)`` applies ``fully_shard`` to every decoder layer, then to the root
(the causal LM, which keeps the embeddings, the final norm and the head), as torchtitan's
``parallelize`` functions do; each rank keeps ``1 / world_size`` of every parameter and of its
gradient and optimizer state. Then each rank runs its own share of the step's groups
(``spread_groups``), and the gradients are averaged across ranks as they are computed.

How FSDP's hooks are engaged. ``fully_shard(layer)`` gathers a layer's parameters in a
forward pre-hook on ``layer.__call__`` and arms its backward hooks (gather again before the
layer's backward, reduce-scatter the gradients after it) from its forward hooks. The adapters
never call a layer: their ``run_layers`` drive its submodules with the prefix state. So every
decoder layer and the root get a method that only calls the function it is given
(``longstraw_forward``), registered with ``register_fsdp_forward_method``; the adapters send
each layer's work through ``ModelAdapter.call_layer`` and each pass over the model (a prefill
chunk, a branch, a decoding step, a recomputed chunk) through ``ModelAdapter._call_model``,
which call these methods on a sharded model and are plain calls otherwise. A layer's work
receives only the activations as arguments (FSDP casts them under mixed precision and hooks
the ones that need a gradient); what a recomputed prompt chunk writes (exact mode) is returned
to FSDP as well, so the layer is gathered again before the backward of those tensors.

Ranks in step. FSDP's gathers and reductions are collectives: every rank must run the same
passes in the same order, whatever its group holds. The loops whose length depends on the
data agree on the longest before they start and pad the shorter ranks with idle passes
(``ModelAdapter.in_step``): prefill chunks with passes that only gather, branches with a
zero-weight one-token branch, sweep chunks with a zero-gradient recompute; rollout decodes
until every rank's branches are done. So every rank must call ``prefill``, ``rollout``,
``grpo_step`` and the helpers here the same number of times, in the same order, with the
same settings (loss type, gradient mode, ``max_new_tokens``); groups may differ in prompt
length, group size and response lengths.

Gradient normalisation. The loss of an optimizer step is TRL's loss over all the step's
responses as one batch: ``losses.loss_weights`` over their concatenation (``dapo``/``bnpo``/
``cispo``: the sum of the per-token terms over all the step's active tokens; ``grpo``: the
mean over all responses of each response's token mean; ``dr_grpo``: the sum over
``(responses x max_completion_length)``). It equals each group's own loss (what
``grpo_step`` backpropagates) times its share of the step's normaliser: active tokens for the
token-level losses, responses for ``grpo``/``dr_grpo``. FSDP averages gradients over the
ranks, so ``group_loss_scales`` gives each group ``world_size x`` its share, to pass to
``grpo_step(..., loss_scale=...)``. One process with several groups per step gets the same
gradient with the same call. ``scale_rewards="batch"`` divides by the std of every reward of
the step (``step_reward_std``); ``generation.GenerationBatch`` does both for groups that
arrive one rollout at a time, as the recipes' do.

Typical use under ``torchrun``::

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # on GPUs, before any collective
    dist.init_process_group("nccl")  # "gloo" on CPU
    adapter = shard_model(ls.adapt(model))  # before the optimizer is built
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for groups in batches:  # every rank sees the same list of groups
        mine = spread_groups(groups, dist.get_rank(), dist.get_world_size())
        scales = group_loss_scales([g.lengths for g in mine], config)
        for group, scale in zip(mine, scales):
            result = ls.grpo_step(adapter, ..., config=config, loss_scale=scale)
        optimizer.step()
        optimizer.zero_grad()
        metrics = reduce_metrics(result.metrics())

The recipes run this way under ``torchrun ... distributed.fsdp=true``: ``prompts_per_step``
groups per rank and step (samples ``data_position + rank * prompts_per_step + k``), through
``GenerationBatch``; ``require_sharding`` refuses several unsharded
processes, ``gather_rows`` collects every rank's completions for the table rank 0 logs,
``longstraw_core.checkpoint`` gathers and restores the sharded state, and ``exit_ranks`` ends
a finished rank without gloo's fragile interpreter teardown.

Communication: every pass gathers every layer once, so a prefill of ``n`` chunks (or a
rollout of ``n`` tokens) gathers the model ``n`` times: a larger ``chunk_size`` trades
activation memory for less traffic, and ``reshard_after_forward=False`` keeps the layers
gathered (no traffic after the first pass, the memory of the whole model). Every backward (one
per branch, one per recomputed chunk) reduce-scatters the gradients it produced, so only
sharded gradients are ever kept; accumulating unsharded gradients instead
(``set_requires_gradient_sync(False)``) would hold the whole model's gradient on every rank.

Two rules the library keeps and user code must keep too. A no-grad pass leaves the root's and
the last layer's parameters gathered (FSDP frees them after the next backward): before an
optimizer step that follows one, call ``adapter.release_parameters()`` or those copies are
stale (``grpo_step`` does it when it runs no backward). And ``requires_grad`` is read from the
sharded parameters: change it only with every parameter released (``lora_reference`` does).

This package, one job per module: ``fsdp`` (``shard_model`` and ``FSDPRun``, the sharded
model's ``ModelAdapter.parallel``), ``mesh`` (the world as S stages x D replicas, an adapter put
on its stage) and ``topology`` (which prompt and stage a recipe's rank runs). Below it:
``longstraw_core.grpo.groups`` (the step's groups spread over the ranks, their share of the
loss, the step's reward std) and ``longstraw_core.distributed`` (small collectives the run
agrees through, the metrics combined over the ranks; what a run of several processes needs to
start and end: the timeout every group is made with, a gloo group for objects).
"""
