"""Dry runs' GPU emulation (``longstraw_core.tensors.gpu_emulation``): fake CPU tensors that choose
CUDA's kernels, and the flash-linear-attention stand-ins' memory.

On the CPU: the choices (inside the context only, fake tensors only), and that the stand-ins
return what fla returns (shapes, dtypes, gradients for every input). On a GPU (``make
gpu-check``): the stand-in's tracked peak and saved bytes against fla's own measured ones.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw_core import attention
from longstraw_core.models.tiny import tiny_model
from longstraw_core.tensors import gpu_emulation
from longstraw_core.tensors.memory import LiveTensorMemory
from model_adapters import qwen36

# Qwen3.6-27B's Gated DeltaNet heads: 16 key heads and 48 value heads of 128.
B, T, HK, HV, D = 1, 1000, 16, 48, 128


def _attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.empty(1, 8, 16, 64, dtype=torch.bfloat16)
    k = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
    return q, k, torch.empty_like(k)


def test_only_fake_tensors_inside_the_context_take_the_cuda_kernels():
    deltanet = tiny_model("qwen3_5_text").model.layers[0].linear_attn
    cpu = torch.device("cpu")
    real = _attention_inputs()
    with FakeTensorMode():
        fake = _attention_inputs()
        assert attention._choose_backend("auto", *fake, ()) == "torch"
        with gpu_emulation.gpu_kernels():
            assert gpu_emulation.emulated(fake[0]) and not gpu_emulation.emulated(real[0])
            assert attention._choose_backend("auto", *fake, ()) in ("sdpa", "flash")
            assert attention._choose_backend("auto", *real, ()) == "torch"
            emulated = qwen36.deltanet_kernels(deltanet, cpu, torch.bfloat16, emulated=True)
            assert emulated.names == ("torch", "fla")
            # the fused recurrent kernel decodes single tokens outside autograd
            assert emulated.rule_for(1) is emulated.step
            # fla refuses float32, as on a GPU
            fp32 = qwen36.deltanet_kernels(deltanet, cpu, torch.float32, emulated=True)
            assert fp32.names == ("torch", "torch")
        assert not gpu_emulation.emulating()
    assert qwen36.deltanet_kernels(deltanet, cpu, torch.bfloat16).names == ("torch", "torch")


def test_fake_cuda_tensors_take_the_gpus_paths_attention_with_sinks_included():
    """On a GPU the torch backend's segments cannot use PyTorch's fused CPU kernel, so a fake
    tensor standing in for a CUDA one must not either (a dry run would otherwise measure the
    CPU's path); attention with sinks runs under the emulation with its gradients."""
    from longstraw_core.attention import cpu_flash

    real = [t[0] for t in _attention_inputs()]  # a prefix segment: [KVH, R, D]
    assert cpu_flash.usable(*real, None, None)
    with FakeTensorMode():
        fake = _attention_inputs()
        assert cpu_flash.usable(fake[0][0], fake[1][0], fake[2][0], None, None)
        with gpu_emulation.gpu_kernels():
            assert not cpu_flash.usable(fake[0][0], fake[1][0], fake[2][0], None, None)
            assert cpu_flash.usable(*real, None, None)
            q, k, v = (t.requires_grad_() for t in fake)
            sink = torch.empty(8, dtype=torch.bfloat16).requires_grad_()
            out = attention.segmented_attention(q, k, v, [], scale=0.125, sink=sink)
            out.sum().backward()
            assert sink.grad.shape == sink.shape and q.grad.shape == q.shape


def test_fake_attention_runs_sdpa_flash_with_its_gradients():
    with FakeTensorMode(), gpu_emulation.gpu_kernels():
        q, k, v = (t.requires_grad_() for t in _attention_inputs())
        prefix = (torch.empty(2, 100, 64, dtype=torch.bfloat16).requires_grad_(),) * 2
        out = attention.segmented_attention(q, k, v, [prefix], scale=0.125)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
        assert prefix[0].grad.shape == prefix[0].shape


def _delta_inputs(device: str = "cpu") -> dict[str, torch.Tensor]:
    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    return {
        "q": rand(B, T, HV, D),  # LongStraw's wrapper repeats q/k to the value heads
        "k": rand(B, T, HV, D),
        "v": rand(B, T, HV, D),
        "g": (-torch.rand(B, T, HV, device=device)).requires_grad_(),
        "beta": torch.rand(B, T, HV, device=device, dtype=torch.bfloat16).requires_grad_(),
        "initial_state": (torch.randn(B, HV, D, D, device=device) * 0.01).requires_grad_(),
    }


def _run_delta(rule, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    options = {name: inputs[name] for name in ("g", "beta", "initial_state")}
    return rule(q, k, v, output_final_state=True, use_qk_l2norm_in_kernel=True, **options)


def test_the_chunk_stand_in_returns_fla_shapes_and_every_gradient():
    with FakeTensorMode():
        inputs = _delta_inputs()
        out, final = _run_delta(gpu_emulation.chunk_gated_delta_rule, inputs)
        assert out.shape == inputs["v"].shape and out.dtype == torch.bfloat16
        assert final.shape == (B, HV, D, D) and final.dtype == torch.float32
        (out.float().sum() + final.sum()).backward()
        for name, tensor in inputs.items():
            assert tensor.grad.shape == tensor.shape and tensor.grad.dtype == tensor.dtype, name


def _stand_in_bytes() -> tuple[int, int]:
    """(forward + backward peak, bytes alive after forward) of the stand-in, above inputs."""
    with FakeTensorMode(), LiveTensorMemory() as memory:
        inputs = _delta_inputs()
        base = memory.current
        out, final = _run_delta(gpu_emulation.chunk_gated_delta_rule, inputs)
        saved = memory.current - base - out.nbytes - final.nbytes
        (out.float().sum() + final.sum()).backward()
        return memory.peak - base, saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_chunk_stand_in_holds_what_fla_holds():
    """fla's own chunk kernel, measured by the CUDA allocator, against the stand-in's tracked
    bytes: what it keeps for backward, and the peak of forward + backward (within 10%)."""
    fla = qwen36.kernels._fla_chunk_gated_delta_rule()
    assert fla is not None, "flash-linear-attention is not installed"
    inputs = _delta_inputs("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, final = _run_delta(fla, inputs)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - out.nbytes - final.nbytes
    (out.float().sum() + final.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    want_peak, want_saved = _stand_in_bytes()
    assert abs(saved - want_saved) <= 0.1 * saved, (saved, want_saved)
    assert abs(peak - want_peak) <= 0.1 * peak, (peak, want_peak)
