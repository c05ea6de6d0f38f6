"""Transient memory derived from tensor shapes, module by module, following the code that runs."""

from __future__ import annotations

from collections.abc import Sequence

import longstraw_core.plan.kernels as kernels
from longstraw_core.plan.model import LayerSpec, ModelSpec, Workload
from longstraw_core.plan.units import FP32, INT64, dtype_bytes


class Activations:
    """Bytes per token of what autograd saves, and the kernels' scratch, from shapes.

    Follows the code that runs module by module: RMSNorms save their float32 input (and the
    normalised tensor when their weight trains), linears save their input when their weight
    trains (PEFT LoRA: a float32 copy per adapted linear when the base is 16-bit), the
    attention functions save q, k, v, output and log-sum-exp, transformers' pure-torch
    gated delta rule saves its ``64 x 64`` chunk matrices, MoE saves ``top_k`` copies of
    each token. Widths come from ``LayerSpec``; ``b`` is the compute dtype's size. The token
    mixers' own formulas are their kinds' (``LayerSpec.kind.plan``, ``kinds.planning``),
    which this object is handed to as ``act``.
    """

    kernels = kernels  # the attention kernels' scratch formulas, for the kinds' formulas

    def __init__(self, spec: ModelSpec, work: Workload) -> None:
        self.spec, self.work = spec, work
        self.b = dtype_bytes(work.compute_dtype)
        self.lora = work.lora_rank > 0
        self.targets = set(work.lora_targets)

    # --- building blocks ---------------------------------------------------------------------

    def trains(self, name: str) -> bool:
        """Whether the weight of linear ``name`` receives a gradient."""
        return not self.lora or name in self.targets

    def linear_input(self, width: int, consumers: Sequence[str]) -> int:
        """Saved bytes per token of one activation that feeds the linears ``consumers``."""
        if not self.lora:
            return self.b * width
        adapted = [name for name in consumers if name in self.targets]
        if not adapted:
            return 0
        rank = self.work.lora_rank * FP32 * len(adapted)  # lora_A's output, saved by lora_B
        if self.b == FP32:
            return FP32 * width + rank
        return FP32 * width * len(adapted) + rank  # each adapter casts its input to fp32

    def norm(self, width: int, groups: int = 1) -> int:
        """An RMSNorm over ``width`` (in ``groups`` heads): its fp32 input, rsqrt, and the
        normalised tensor when the weight trains (not under LoRA)."""
        saved = FP32 * width + FP32 * groups
        if not self.lora:
            saved += self.b * width if self.spec.llama_norm else FP32 * width
        return saved

    # --- MLPs --------------------------------------------------------------------------------

    def mlp(self, layer: LayerSpec) -> int:
        b, hidden = self.b, self.spec.hidden
        if layer.mlp == "dense":
            width = layer.mlp_dims["intermediate"]
            saved = self.linear_input(hidden, ("gate_proj", "up_proj"))
            return saved + 3 * b * width + self.linear_input(width, ("down_proj",))
        d = layer.mlp_dims
        k, expert, shared = d["top_k"], d["expert_dim"], d["shared_dim"]
        saved = self.linear_input(hidden, ("gate_proj", "up_proj"))  # MoE input (shared MLP)
        if not self.lora:
            saved = max(saved, b * hidden) + (FP32 * hidden if b < FP32 else 0)  # router
        saved += FP32 * d["experts"] + 16 * k + 8  # router scores, top-k, weights
        experts = b * (3 * expert + hidden) + 20  # gate_up, silu, the weighted output, ids
        if not self.lora:
            experts += b * (hidden + expert)  # grouped_mm inputs (the experts train)
        saved += k * experts
        if shared:
            saved += 3 * b * shared + self.linear_input(shared, ("down_proj",))
        return saved

    # --- whole passes ------------------------------------------------------------------------

    def layer(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Saved bytes of one decoder layer over ``tokens`` tokens after ``prefix``."""
        mixer = layer.kind.plan.saved(self, layer, tokens, prefix)
        return mixer + (2 * self.norm(self.spec.hidden) + self.mlp(layer)) * tokens

    def last_layer_state_only(self, layer: LayerSpec, tokens: int) -> int:
        """A recomputed chunk's last layer only writes its state: what that write keeps."""
        saved = self.norm(self.spec.hidden) * tokens
        return saved + layer.kind.plan.state_only_saved(self, layer, tokens)

    def rotary(self, tokens: int) -> int:
        return 2 * self.spec.rotary_dim * self.b * tokens

    def head_rows(self, tokens: int) -> int:
        """Rows per chunk of ``score``'s LM head (``longstraw_core.adapters.lm_head.head_rows``)."""
        from longstraw_core.adapters.lm_head import head_rows

        return head_rows(tokens, self.spec.vocab)

    def head(self, tokens: int) -> int:
        """What the final norm, the LM head and ``log_softmax`` keep for backward (bytes).
        One chunk: the head's input and the float32 log-probs ``[T, vocab]``. Several
        (checkpointed) chunks: only the normed hidden states the chunks read."""
        hidden = self.spec.hidden
        head = self.norm(hidden) + 2 * INT64  # gather index, input ids
        if self.head_rows(tokens) < tokens:
            head += self.b * hidden
        else:
            head += self.linear_input(hidden, ("lm_head",)) + FP32 * self.spec.vocab
        return head * tokens

    def branch_graph(self, tokens: int) -> int:
        """Everything one replayed branch keeps for its backward (bytes). Checkpointed: each
        layer's input instead of its activations (``checkpoint_kept``)."""
        prefix = self.work.stored
        if self.work.activation_checkpointing:
            layers = sum(self.checkpoint_kept(layer, tokens, prefix) for layer in self.spec.layers)
        else:
            layers = sum(self.layer(layer, tokens, prefix) for layer in self.spec.layers)
        return layers + self.head_graph(tokens) + self.rotary(tokens)

    def branch_peak(self, tokens: int) -> int:
        """One replayed branch (or piece) of ``tokens`` tokens in its backward: its graph, then
        the head's logits or a layer's backward (checkpointed: one layer recomputed at a
        time while the others' inputs are kept)."""
        prefix = self.work.stored
        if self.work.activation_checkpointing:
            return self.checkpointed_branch_peak(tokens)
        working = max(
            max(
                self.backward_working(layer, tokens, prefix),
                self.kernel_forward_scratch(layer, tokens, prefix),
            )
            for layer in self.spec.layers
        )
        return self.branch_graph(tokens) + max(self.head_working(tokens), working)

    def head_graph(self, tokens: int) -> int:
        return self.head(tokens) if self.spec.has_head else 0  # earlier stages: no head

    def head_working(self, tokens: int) -> int:
        return self.head_peak(tokens) if self.spec.has_head else 0

    def split_last(self) -> tuple[list[LayerSpec], LayerSpec | None]:
        """(layers run whole, the model's last layer, which only writes its state, or None
        on a stage that ends before the model does)."""
        *layers, last = self.spec.layers
        return (layers, last) if self.spec.has_head else ([*layers, last], None)

    def chunk_graph(self, tokens: int, start: int) -> int:
        """Everything one recomputed prompt chunk keeps for its backward (bytes)."""
        if self.work.activation_checkpointing:
            kept = sum(
                self.checkpoint_kept(layer, tokens, start) + self.written(layer, tokens)
                for layer in self.spec.layers
            )
            return kept + self.rotary(tokens) + INT64 * tokens
        layers, last = self.split_last()
        saved = sum(self.layer(layer, tokens, start) for layer in layers)
        if last is not None:
            saved += self.last_layer_state_only(last, tokens)
        return saved + self.rotary(tokens) + INT64 * tokens

    # --- activation checkpointing ------------------------------------------------------------

    def checkpoint_kept(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """What a checkpointed layer keeps from its forward to its backward: its input
        ``[T, hidden]``, and the DSA selection it passes on (the next layer's work holds it)."""
        kept = self.b * self.spec.hidden * tokens
        return kept + layer.kind.plan.kept_beside_input(self, layer, tokens, prefix)

    def written(self, layer: LayerSpec, tokens: int) -> int:
        """What a recomputed chunk's layer hands the sweep, alive until the chunk's backward
        ends: keys and values, the latent, or DeltaNet's final states (conv window, fp32
        recurrent state)."""
        return layer.kind.plan.written(self, layer, tokens)

    def layer_recompute(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Backward of one checkpointed layer: its graph recomputed (with the kernels'
        forward scratch), then its MLP's backward over the whole graph, then its mixer's
        once the MLP's share is freed (with the attention's blocks over the prefix)."""
        b, hidden = self.b, self.spec.hidden
        graph = self.layer(layer, tokens, prefix)
        mlp_graph = (self.norm(hidden) + self.mlp(layer)) * tokens
        residual = 2 * b * hidden * tokens + self.weight_grad_scratch(layer)
        mlp = graph + residual + 3 * b * tokens * self.mlp_width(layer)
        mixer = graph - mlp_graph + residual + 3 * b * tokens * self.mixer_width(layer)
        mixer += self.prefix_backward_scratch(layer, tokens, prefix)
        return max(graph + self.kernel_forward_scratch(layer, tokens, prefix), mlp, mixer)

    def checkpointed_branch_peak(self, tokens: int) -> int:
        """A checkpointed branch's peak beyond the state: every layer's input kept, then the
        head's logits, or one layer recomputed and backpropagated while the inputs of the
        layers before it are still kept (the head's graph is freed by then)."""
        prefix = self.work.stored
        layers = self.spec.layers
        kept = [self.checkpoint_kept(layer, tokens, prefix) for layer in layers]
        rotary = self.rotary(tokens)
        peak = sum(kept) + rotary + self.head_graph(tokens) + self.head_working(tokens)
        for index, layer in enumerate(layers):
            before = sum(kept[:index]) + rotary
            peak = max(peak, before + self.forward_working(layer, tokens, prefix))
            recompute = self.layer_recompute(layer, tokens, prefix)
            peak = max(peak, before + kept[index] + recompute)
        return peak

    def checkpointed_chunk_peak(self, tokens: int, start: int) -> int:
        """A checkpointed chunk recompute's peak (without the ``dS`` slices handed with it):
        what every layer writes stays alive to the end of the chunk's backward; each layer's
        input until its own backward, which recomputes its graph (the last layer's: the
        state it writes)."""
        layers = self.spec.layers
        kept = [self.checkpoint_kept(layer, tokens, start) for layer in layers]
        written = [self.written(layer, tokens) for layer in layers]
        fixed = self.rotary(tokens) + INT64 * tokens
        peak = 0
        for index, layer in enumerate(layers):
            before = sum(kept[:index]) + sum(written[:index]) + fixed  # in its forward
            after = before + sum(written[index:])  # in its backward: every layer wrote
            last = index == len(layers) - 1 and self.spec.has_head
            if last:
                forward = self.state_only_working(layer, tokens, start)
                graph = self.last_layer_state_only(layer, tokens)
                working = forward
                if layer.kind.plan.state_only_backward:  # the key/value projections only
                    working = max(working, self.weight_grad_scratch(layer))
                recompute = graph + working
            else:
                forward = self.forward_working(layer, tokens, start)
                recompute = self.layer_recompute(layer, tokens, start)
            peak = max(peak, before + forward, after + kept[index] + recompute)
        return peak

    # --- working sets: what lives only while a step runs (no autograd, or in backward) -------

    def widest(self, layer: LayerSpec) -> int:
        """The widest per-token activation of a layer (elements): its MLP or its mixer."""
        return max(self.mlp_width(layer), self.mixer_width(layer), self.spec.hidden)

    def mlp_width(self, layer: LayerSpec) -> int:
        if layer.mlp == "dense":
            return layer.mlp_dims["intermediate"]
        m = layer.mlp_dims
        return max(m["top_k"] * (2 * m["expert_dim"] + self.spec.hidden), m["shared_dim"])

    def mixer_width(self, layer: LayerSpec) -> int:
        return layer.kind.plan.width(self, layer)

    def forward_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Peak bytes a layer holds while it runs without autograd (a prefill chunk), besides
        the residual stream: its normed input, then the larger of its mixer's activations
        with the kernel's scratch and its MLP's (silu(gate), up and their product)."""
        normed = tokens * self.b * self.spec.hidden
        return normed + max(
            self.mixer_working(layer, tokens, prefix), self.mlp_working(layer, tokens)
        )

    def mixer_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """A token mixer's projections (and their roped / convolved copies) and kernel."""
        return layer.kind.plan.working(self, layer, tokens, prefix)

    def mlp_working(self, layer: LayerSpec, tokens: int) -> int:
        if layer.mlp == "dense":
            return 3 * tokens * self.b * layer.mlp_dims["intermediate"]
        m = layer.mlp_dims
        experts = m["top_k"] * (self.spec.hidden + 4 * m["expert_dim"])  # gathered, gate_up..
        return tokens * (self.b * max(experts, 3 * m["shared_dim"]) + FP32 * m["experts"])

    def decode_scratch(self, layer: LayerSpec, group: int, prefix: int) -> int:
        """One decoding step of ``group`` branches: the DSA search and latent gathers, or
        the pure-torch loop over the prefix when no fused kernel serves it."""
        return layer.kind.plan.decode_scratch(self, layer, group, prefix)

    def state_only_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """A writing span's last layer (``base.writes_only``): attention layers compute only
        the keys/values (or latent) they store; a DeltaNet layer runs whole."""
        return layer.kind.plan.state_only_working(self, layer, tokens, prefix)

    def kernel_forward_scratch(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Scratch of a layer's attention kernels in a pass with autograd (beyond what the
        graph saves): the DSA top-k search and latent gathers, the attention merge."""
        return layer.kind.plan.forward_scratch(self, layer, tokens, prefix)

    def backward_working(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """Peak bytes of one layer's backward besides the graph: gradients of its widest
        activations and of the residual stream, a weight gradient before it is added into
        ``.grad``, and the attention kernel's per-block scratch over the prefix."""
        grads = tokens * (2 * self.b * self.spec.hidden + 3 * self.b * self.widest(layer))
        grads += self.weight_grad_scratch(layer)
        return grads + self.prefix_backward_scratch(layer, tokens, prefix)

    def weight_grad_scratch(self, layer: LayerSpec) -> int:
        """One weight gradient computed before it is added into an existing ``.grad`` (the
        largest trainable matrix of the layer; sharded runs account for theirs in FSDP)."""
        if self.work.fsdp:
            return 0
        grad_bytes = FP32 if self.lora else dtype_bytes(self.work.param_dtype)
        shapes = [
            (inp * out if not self.lora else self.work.lora_rank * max(inp, out))
            for name, (inp, out) in layer.linear_shapes.items()
            if self.trains(name)
        ]
        if layer.mlp == "moe" and not self.lora:
            m = layer.mlp_dims
            shapes.append(m["experts"] * 2 * m["expert_dim"] * self.spec.hidden)
        return grad_bytes * max(shapes, default=0)

    def prefix_backward_scratch(self, layer: LayerSpec, tokens: int, prefix: int) -> int:
        """The attention backward over the stored prefix, per block of keys."""
        if prefix == 0:
            return 0
        return layer.kind.plan.prefix_backward_scratch(self, layer, tokens, prefix)

    def head_peak(self, tokens: int) -> int:
        """The LM head beyond the graph: float32 logits next to the saved log-probs
        (entropy's exp and product; backward's gather and log_softmax grads), for the whole
        branch in one chunk. In several chunks, one chunk's backward: its recomputed
        log-probs and those, the gradients of the chunks' inputs, and (when the head trains)
        its weight's gradient next to the sum of the chunks' before it."""
        rows = self.head_rows(tokens)
        chunked = rows < tokens
        logits = FP32 * rows * self.spec.vocab
        peak = 2 * logits + (self.b * rows * self.spec.vocab if self.b < FP32 else 0)
        if not chunked:
            return peak
        peak += logits + self.b * self.spec.hidden * tokens
        if not self.lora:
            peak += self.b * self.spec.vocab * self.spec.hidden
        return peak
