"""``make gpu-check`` on CPU: its arguments and budget, the bf16 GPU-dim recipe configs it runs
(validated, and their models built and run here), the two-stage runs' configs, its FLOP
count, the kernel trace (CUDA's choices seen through fake CUDA tensors), and its record:
a failing, crashing, timed-out or killed step or phase keeps its JSON entry, and the quick
CPU check passes and calibrates the planner."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import longstraw_core as ls
from longstraw_core import attention, config
from longstraw_core.models import build as models
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan.calibration import load_calibration, resolve_hardware
from longstraw_core.plan.cli import main as plan_main
from longstraw_core.tensors import gpu_emulation

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the check's modules import each other by name

import gpu_check  # noqa: E402
import gpu_check_bench  # noqa: E402
import gpu_check_report  # noqa: E402
import kernel_trace  # noqa: E402
from gpu_check_report import Report, Step, run_step  # noqa: E402


def test_arguments(tmp_path):
    settings = gpu_check.parse_args(["--out", str(tmp_path / "r.json")])
    assert settings.device == "cuda" and settings.dtype_name == "bfloat16"
    assert settings.phases == gpu_check.PHASES and gpu_check.PHASES[0] == "warmup"
    assert settings.families == gpu_check.FAMILIES and settings.work == tmp_path / "work"
    cpu = gpu_check.parse_args(["--device", "cpu", "--quick"])
    assert cpu.dtype_name == "float32" and cpu.prompt_tokens < settings.prompt_tokens
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--families", "llama4"])


def test_phases_that_cannot_run_here_say_why():
    cuda = gpu_check.parse_args([])
    cpu = gpu_check.parse_args(["--device", "cpu"])
    for phase in ("warmup", "tests", "host_syncs", "pinned", "fla", "multi_gpu"):
        assert gpu_check.skip_reason(phase, cpu, {}) == "needs CUDA (--device cpu)"
    for phase in ("collectives", "fsdp", "profile", "layers", "recipes", "benchmark"):
        assert gpu_check.skip_reason(phase, cpu, {}) is None  # the CPU self-test runs them
    one = gpu_check.skip_reason("multi_gpu", cuda, {"cuda_devices": 1})
    assert one == "1 CUDA GPU(s) here: the two-stage NCCL runs need 2"
    assert gpu_check.skip_reason("multi_gpu", cuda, {"cuda_devices": 2}) is None
    qwen3 = gpu_check.parse_args(["--families", "qwen3"])
    assert gpu_check.skip_reason("multi_gpu", qwen3, {"cuda_devices": 8}).startswith("no step")


def test_the_inner_limits_fit_inside_the_outer_one():
    """Every step's limit and the start-up fit inside the shell's timeout, which the shell
    reads from gpu_check.py; every step a phase can run has a limit."""
    assert gpu_check.inner_total_s() + gpu_check.START_AND_WRITE_S <= gpu_check.OUTER_LIMIT_S
    everything = gpu_check.parse_args([])
    for phase in gpu_check.PHASES:
        assert set(gpu_check.steps_of(phase, everything)) == set(gpu_check.LIMITS_S[phase])
    printed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--outer-limit"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert int(printed) == gpu_check.OUTER_LIMIT_S
    shell = (ROOT / "benchmarks/gpu_check.sh").read_text()
    assert 'outer=$("$PYTHON" benchmarks/gpu_check.py --outer-limit)' in shell
    assert 'exec timeout -k 15 "$outer"' in shell
    assert not re.search(r"timeout (-k \d+ )?\d", shell)  # no second, hard-coded limit


def test_the_phases_limits_add_up_inside_the_outer_limit():
    """Each phase has its own limit (its steps'), every phase and step is in the plan, and
    the plan's figures are the runner's: all of them, and a one-GPU run's, fit the outer
    limit with the start-up."""
    import gpu_check_plan as plan

    assert plan.PHASES == gpu_check.PHASES and plan.LIMITS_S is gpu_check.LIMITS_S
    assert set(plan.LIMITS_S) == set(plan.PHASES) == set(plan.PURPOSE)
    assert all(limit > 0 for steps in plan.LIMITS_S.values() for limit in steps.values())
    total = sum(sum(steps.values()) for steps in plan.LIMITS_S.values())
    assert total == plan.inner_total_s() and plan.one_gpu_total_s() < total
    assert total + plan.START_AND_WRITE_S <= plan.OUTER_LIMIT_S < 600  # the device's 600 s
    assert set(plan.STEP_GPUS) == set(plan.LIMITS_S["multi_gpu"]) == set(gpu_check.MULTI_GPU)
    text = plan.plan_text()
    for phase, steps in plan.LIMITS_S.items():
        line = next(line for line in text.splitlines() if line.split()[:1] == [phase])
        assert all(f"{step} {limit} s" in line for step, limit in steps.items())


def test_without_a_gpu_make_gpu_check_prints_its_plan_and_exits_0_in_seconds(tmp_path):
    """`make gpu-check` on a machine with no NVIDIA GPU: the plan (every phase and its
    limits), exit 0, in seconds, with a Python that has no torch (nothing is imported)."""
    if Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA GPU")
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PYTHON": "python3", "PATH": f"{bare}:/usr/bin:/bin"}
    env["PYTHONPATH"] = str(tmp_path)  # no torch reachable through it ...
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")  # ... nor here
    start = time.monotonic()
    done = subprocess.run(
        ["make", "-s", "gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - start < 10
    for phase, steps in gpu_check.LIMITS_S.items():
        assert re.search(rf"^  {phase} +{sum(steps.values())} s", done.stdout, re.M), phase
    assert "no NVIDIA GPU" in done.stdout
    assert gpu_check.main(["--out", str(tmp_path / "r.json")]) == 0  # the Python entry too
    assert not (tmp_path / "r.json").exists()


def test_every_file_with_gpu_tests_is_collected():
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    }
    marked.discard("tests/test_gpu_check.py")  # names the marker in this test only
    assert marked == set(gpu_check.GPU_TEST_FILES)


@pytest.mark.parametrize("family", gpu_check.FAMILIES)
def test_the_cuda_recipe_configs_validate_and_their_models_run(family, tmp_path):
    """What the GPU machine's recipe step gets: bfloat16, GPU head dims, the state offloaded;
    the model is built from that config and scores a short prompt here (CPU, bf16)."""
    settings = gpu_check.parse_args(["--out", str(tmp_path / "r.json")])
    overrides = gpu_check.recipe_overrides(family, settings, tmp_path / "run")
    script, path = gpu_check.gpu_shapes(family).recipe
    cfg = config.load_config(ROOT / path, overrides)
    assert cfg.model.tiny == family and cfg.model.dtype == "bfloat16"
    assert cfg.offload.attention == "cpu" and cfg.train.steps == 1
    assert cfg.model.tiny_overrides.items() >= gpu_check.gpu_shapes(family).recipe_dims.items()
    command = gpu_check.recipe_command(family, settings, tmp_path / "run", tmp_path / "k.json")
    assert command[1].endswith("benchmarks/kernel_trace.py") and command[4].endswith(script)
    assert command[-len(overrides) :] == overrides
    model = models.build_model(cfg.model, seed=0)
    assert next(model.parameters()).dtype == torch.bfloat16
    adapter = ls.adapt(model)
    prompt = torch.randint(0, model.config.get_text_config().vocab_size, (40,))
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=16, offload=config.offload_policy(cfg))
        logprobs = adapter.score(state, prompt[:5])
    assert logprobs.shape == (5,) and torch.isfinite(logprobs).all()


@pytest.mark.parametrize("name", sorted(gpu_check.MULTI_GPU))
def test_the_pipeline_nccl_runs_are_torchrun_one_gpu_a_stage(name, tmp_path):
    """S=2 (both recipes) and S=3 with a group of 2 (G < S), one GPU a stage."""
    settings = gpu_check.parse_args([])
    command = gpu_check.multi_gpu_command(name, settings, tmp_path / "run", tmp_path / "{rank}")
    stages = gpu_check.STEP_GPUS[name]
    assert command[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(stages), str(ROOT / "benchmarks/kernel_trace.py")]  # fmt: skip
    family = gpu_check.MULTI_GPU[name]
    path = gpu_check.gpu_shapes(family).recipe[1]
    start = command.index(str(ROOT / path)) + 1
    cfg = config.load_config(ROOT / path, command[start:])
    assert cfg.distributed.pipeline_stages == stages and cfg.model.tiny == family
    if stages == 3:
        assert cfg.rollout.num_generations == 2 < stages
    assert cfg.distributed.timeout_minutes * 60 < gpu_check.LIMITS_S["multi_gpu"][name]


def test_forward_flops_count_the_decoder_weights():
    model = tiny_model("qwen3", head_dim=16)
    text = model.config
    weights = sum(
        module.weight.numel()
        for name, module in model.model.layers.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    tokens = 100
    attention = 2 * text.num_hidden_layers * text.num_attention_heads * 16 * tokens**2
    want = 2 * weights * tokens + attention
    assert gpu_check_bench.forward_flops(text, tokens, lm_head=False) == pytest.approx(want)
    head = 2 * text.hidden_size * text.vocab_size * tokens
    assert gpu_check_bench.forward_flops(text, tokens) == pytest.approx(want + head)


# --- the kernel trace --------------------------------------------------------------------------


def _inputs(q_dim: int, v_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q = torch.empty(1, 8, 16, q_dim, dtype=dtype)
    k = torch.empty(1, 2, 16, q_dim, dtype=dtype)
    return q, k, torch.empty(1, 2, 16, v_dim, dtype=dtype)


def _choose(q_dim: int, v_dim: int, dtype: torch.dtype) -> str:
    """The choice alone (what ``segmented_attention`` calls first; the torch path does not
    run on fake tensors)."""
    return attention._choose_backend("auto", *_inputs(q_dim, v_dim, dtype), ())


def test_the_trace_sees_what_a_cuda_run_chooses(tmp_path):
    """Fake tensors standing in for CUDA ones take the GPU's choices (``gpu_emulation``):
    bf16 attention the SDPA flash kernels and Gated DeltaNet fla; float32 falls back to the
    torch paths, which fails a CUDA run; MLA's unequal head dims go to torch by design."""
    from model_adapters import qwen36

    deltanet = tiny_model("qwen3_5_text").model.layers[0].linear_attn
    cpu = torch.device("cpu")
    path = tmp_path / "kernels.json"
    with kernel_trace.tracing(path) as trace, FakeTensorMode(), gpu_emulation.gpu_kernels():
        ls.segmented_attention(*_inputs(64, 64, torch.bfloat16), scale=0.1)
        qwen36.deltanet_kernels(deltanet, cpu, torch.bfloat16, emulated=True)
    clean = trace.as_dict()
    assert set(clean["attention"]) <= {"cuda/sdpa", "cuda/flash"} and clean["deltanet"] == {
        "cuda/fla": 1
    }
    assert json.loads(path.read_text()) == clean  # written as it goes
    assert kernel_trace.failures(clean, "cuda", "qwen3_5_text") == []
    assert kernel_trace.failures(clean, "cuda", "glm_moe_dsa") == []

    with kernel_trace.tracing() as trace, FakeTensorMode(), gpu_emulation.gpu_kernels():
        assert _choose(64, 64, torch.float32) == "torch"
        qwen36.deltanet_kernels(deltanet, cpu, torch.float32, emulated=True)
    fallen = trace.as_dict()
    assert fallen["attention"] == {"cuda/torch": 1} and fallen["deltanet"] == {"cuda/torch": 1}
    problems = kernel_trace.failures(fallen, "cuda", "qwen3_5_text")
    assert len(problems) == 2 and "dtype torch.float32" in problems[0]
    assert "flash-linear-attention is missing" in problems[1]

    with kernel_trace.tracing() as trace, FakeTensorMode(), gpu_emulation.gpu_kernels():
        assert _choose(96, 64, torch.bfloat16) == "torch"  # MLA: keys [c_kv, k_pe], values c_kv
    latent = trace.as_dict()
    assert latent["attention_torch_reasons"] == {kernel_trace.MLA_LATENT: 1}
    assert kernel_trace.failures(latent, "cuda", "glm_moe_dsa") == []
    # what a run must record: a qwen3 run without attention calls was not seen
    assert kernel_trace.failures(latent, "cuda", "qwen3_5_text") == [
        "no cuda deltanet call recorded ({})"
    ]
    # the wrappers are gone after the block: a real CPU call, nothing counted
    ls.segmented_attention(
        *(torch.zeros_like(t) for t in _inputs(64, 64, torch.float32)), scale=0.1
    )
    assert trace.as_dict() == latent


def test_an_output_folder_not_made_by_the_check_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not made by gpu-check: use another --work"):
        gpu_check.fresh_output(mine)
    assert (mine / "notes.txt").read_text() == "keep"
    ours = tmp_path / "ours"
    gpu_check.fresh_output(ours)
    (ours / "old").write_text("x")
    gpu_check.fresh_output(ours)
    assert not (ours / "old").exists()


def test_a_cuda_benchmark_calibrates_against_the_datasheet(tmp_path):
    """The calibration block a CUDA run writes (from its steps' rows) is what the planner
    reads: MFU per family over the GPU's datasheet peak, the lowest as the default, the copy's
    share of the datasheet HBM bandwidth; a family whose run failed is left out."""
    phase = gpu_check_report.Phase("benchmark")
    phase.steps["peaks"] = Step("peaks", status="passed", details={
        "device_name": "NVIDIA H200", "matmul_tflop_per_s": 700.0, "matmul_dtype": "bfloat16",
        "copy_tbps": 4.0,
    })  # fmt: skip
    for family, tflops, kernels in (
        ("qwen3", 300.0, {"attention": {"cuda/sdpa": 3}}),
        ("qwen3_5_text", 250.0, {"attention": {"cuda/flash": 3}, "deltanet": {"cuda/fla": 18}}),
    ):
        row = {"prefill_tflop_per_s": tflops, "tokens": 32768, "dtype": "bfloat16"}
        phase.steps[family] = Step(family, status="passed", details={**row, "kernels": kernels})
    settings = gpu_check.parse_args([])
    block = gpu_check.calibration_block(phase, settings, "NVIDIA H200")
    assert block["values"] == {
        "mfu": round(250 / 989, 3),
        "bandwidth_efficiency": round(4 / 4.8, 3),
    }
    note = block["mfu_by_model_type"]["qwen3_5_text"]["note"]
    assert "250 TFLOP/s of NVIDIA H200's datasheet 989 TFLOP/s" in note and "cuda/fla" in note
    phase.steps["qwen3_5_text"].status = "failed"  # e.g. a torch fallback: not a measurement
    assert gpu_check.calibration_block(phase, settings, None)["values"]["mfu"] == round(
        300 / 989, 3
    )

    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"phases": {}, "calibration": block}))
    hardware = resolve_hardware({}, load_calibration(path), "qwen3_5_text")
    assert (hardware.mfu, hardware.bandwidth_efficiency) == (round(250 / 989, 3), 0.833)


# --- the record: whatever happens ----------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_failing_crashing_or_timed_out_step_keeps_its_entry(tmp_path):
    out = tmp_path / "r.json"
    report = Report(out, {"settings": {}})
    report.plan({"one": 10.0, "two": 10.0})
    assert [p["status"] for p in json.loads(out.read_text())["phases"].values()] == ["pending"] * 2
    with report.phase("one") as phase:
        run = {"limit": 30, "cwd": tmp_path}
        fine = run_step(report, phase, "fine", _python("print('hello')"), log=tmp_path / "a", **run)
        failed = run_step(
            report, phase, "failed", _python("print('boom'); raise SystemExit(3)"),
            log=tmp_path / "b", **run,
        )  # fmt: skip
        crashed = run_step(
            report, phase, "crashed", _python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"),
            log=tmp_path / "c", **run,
        )  # fmt: skip
        start = time.monotonic()
        slow = run_step(
            report, phase, "slow", _python("import time; print('started', flush=True); time.sleep(60)"),
            log=tmp_path / "d", limit=1, cwd=tmp_path,
        )  # fmt: skip
        assert time.monotonic() - start < 15
        checked = run_step(
            report, phase, "checked", _python("pass"), log=tmp_path / "e", **run,
            check=lambda step: "the result was wrong",
        )  # fmt: skip
    assert (fine.status, fine.tail) == ("passed", "hello\n")
    assert (failed.status, failed.error, failed.tail) == ("failed", "exit status 3", "boom\n")
    assert (crashed.status, crashed.error) == ("crashed", "died by SIGSEGV")
    assert (slow.status, slow.error, slow.tail) == (
        "timeout",
        "killed at its limit of 1 s",
        "started\n",
    )
    assert (checked.status, checked.error) == ("failed", "the result was wrong")
    report.finish()
    record = json.loads(out.read_text())
    one = record["phases"]["one"]
    assert one["status"] == "crashed" and not one["ok"] and not record["ok"]  # the worst step's
    assert {name: s["status"] for name, s in one["steps"].items()} == {
        "fine": "passed", "failed": "failed", "crashed": "crashed", "slow": "timeout",
        "checked": "failed",
    }  # fmt: skip
    assert (
        one["steps"]["failed"]["tail"] == "boom\n" and "slow: killed at its limit" in one["error"]
    )
    assert record["phases"]["two"]["status"] == "skipped"  # never started


def test_a_phase_that_raises_is_recorded_and_the_check_goes_on(tmp_path):
    out = tmp_path / "r.json"
    report = Report(out, {})
    report.plan({"broken": 5.0, "after": 5.0})
    with report.phase("broken"):
        raise KeyError("no such row")
    with report.phase("after"):
        pass
    report.finish()
    phases = json.loads(out.read_text())["phases"]
    assert phases["broken"]["status"] == "crashed"
    assert phases["broken"]["error"] == "KeyError: 'no such row'"
    assert "raise KeyError" in phases["broken"]["details"]["traceback"]
    assert phases["after"]["status"] == "passed"


class _StoppedWhileWriting(Report):
    """A report whose ``stop_at``-th write is cut by SIGTERM just after the file was
    replaced: where the outer ``timeout`` can land when it reacts to a step's "running"."""

    def __init__(self, path: Path, stop_at: int) -> None:
        super().__init__(path, {})
        self.writes, self.stop_at = 0, stop_at

    def write(self) -> None:
        super().write()
        self.writes += 1
        if self.writes == self.stop_at:
            raise gpu_check_report.Killed("SIGTERM")


def test_a_signal_during_the_steps_first_write_marks_it_killed(tmp_path):
    out = tmp_path / "r.json"
    report = _StoppedWhileWriting(out, stop_at=3)  # plan, phase start, step start
    report.plan({"recipes": 10.0, "benchmark": 10.0})
    with pytest.raises(gpu_check_report.Killed), report.phase("recipes") as phase:
        run_step(
            report, phase, "qwen3", _python("pass"), limit=30, log=tmp_path / "a", cwd=tmp_path
        )
    report.finish()
    record = json.loads(out.read_text())
    recipes = record["phases"]["recipes"]
    assert record["status"] == "killed" and recipes["status"] == "killed"
    assert recipes["steps"]["qwen3"]["status"] == "killed"
    assert record["phases"]["benchmark"]["status"] == "skipped"


def test_a_signal_during_the_phases_first_write_marks_it_killed(tmp_path):
    out = tmp_path / "r.json"
    report = _StoppedWhileWriting(out, stop_at=2)  # plan, phase start
    report.plan({"recipes": 10.0, "benchmark": 10.0})
    with pytest.raises(gpu_check_report.Killed), report.phase("recipes"):
        pass
    report.finish()
    record = json.loads(out.read_text())
    assert record["status"] == "killed" and record["phases"]["recipes"]["status"] == "killed"
    assert record["phases"]["benchmark"]["status"] == "skipped"


def test_a_step_left_running_is_closed_at_the_end(tmp_path):
    """Whatever cut a step short before it recorded its end, the record never says running."""
    report = Report(tmp_path / "r.json", {})
    report.plan({"killed": 1.0, "raised": 1.0})
    report.phases["killed"].status = "killed"
    report.phases["raised"].status, report.phases["raised"].error = "crashed", "OSError: disk"
    for phase in report.phases.values():
        phase.steps["s"] = Step("s", status="running")
    report.finish()
    steps = {n: p["steps"]["s"] for n, p in json.loads(report.path.read_text())["phases"].items()}
    assert steps["killed"]["status"] == "killed"
    assert (steps["raised"]["status"], steps["raised"]["error"]) == ("crashed", "OSError: disk")


@pytest.mark.multiprocess
def test_a_check_stopped_by_its_outer_limit_records_what_it_was_doing(tmp_path):
    """SIGTERM (what `timeout` sends) mid-recipe: the step and its phase are `killed`, the
    phases after it `skipped`, the JSON written, exit 124, the recipe's processes gone."""
    out = tmp_path / "gpu_check.json"
    command = [
        sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--device", "cpu", "--quick",
        "--phases", "recipes,benchmark", "--families", "qwen3", "--out", str(out),
    ]  # fmt: skip
    check = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            steps = json.loads(out.read_text())["phases"]["recipes"]["steps"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
        if steps.get("qwen3", {}).get("status") == "running":
            break
    else:
        check.kill()
        pytest.fail("the recipe step never started")
    check.send_signal(signal.SIGTERM)
    output, _ = check.communicate(timeout=60)
    assert check.returncode == 124, output.decode()[-3000:]
    record = json.loads(out.read_text())
    assert record["status"] == "killed" and not record["ok"]
    recipes, benchmark = record["phases"]["recipes"], record["phases"]["benchmark"]
    assert recipes["status"] == "killed" and recipes["steps"]["qwen3"]["status"] == "killed"
    assert benchmark["status"] == "skipped" and "stopped" in benchmark["error"]
    log = Path(recipes["steps"]["qwen3"]["log"])
    assert log.exists()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    cmdlines = []
    for pid in pids:
        try:
            cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    assert not [c for c in cmdlines if str(tmp_path).encode() in c]  # the recipe is gone


@pytest.mark.multiprocess
def test_the_quick_cpu_check_passes_and_calibrates_the_planner(tmp_path, capsys):
    """`make gpu-check`'s script with --device cpu --quick: every phase has its entry (the
    CUDA ones skipped with the reason), each run's kernels are recorded, and the planner
    takes the measured MFU from the JSON, saying where it came from."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    env.pop("OUT", None)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--device", "cpu", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=gpu_check.OUTER_LIMIT_S + 30,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["ok"] and record["status"] == "passed"
    phases = record["phases"]
    assert list(phases) == list(gpu_check.PHASES)
    for name in ("warmup", "tests", "host_syncs", "pinned", "fla", "multi_gpu"):
        assert phases[name]["status"] == "skipped", name
    # The probes a CPU runs (gloo for the process groups): their rows in the record.
    collectives = phases["collectives"]["steps"]["nccl_one_rank"]["details"]
    assert collectives["backend"] == "gloo" and not collectives["problems"]
    assert all(entry["ok"] for entry in collectives["helpers"].values())
    assert "clip_grad_norm (no grads)" in collectives["helpers"]
    fsdp = phases["fsdp"]["steps"]["lora_bf16_gathers"]["details"]
    assert fsdp["all_gathers_per_token"] == fsdp["explicit_reshards_per_token"] == 0
    assert set(fsdp["lora_dtypes"]) and fsdp["fsdp_units"]
    assert phases["profile"]["steps"]["decode"]["details"]["steps"] == 20
    for family in ("qwen3", "qwen3_5_text"):
        rows = phases["layers"]["steps"][family]["details"]["rows"]
        assert [row["prefix"] for row in rows] == [1024, 4096]
        assert all(
            row["attention_forward_s"] > 0 and row["planner_flops"]["mixing"] > 0 for row in rows
        )
    assert phases["multi_gpu"]["error"] == "needs CUDA (--device cpu)"
    recipes = phases["recipes"]["steps"]
    assert all(recipes[f]["details"]["checkpoint_saved"] for f in gpu_check.FAMILIES)
    assert recipes["qwen3_5_text"]["details"]["kernels"]["deltanet"]["cpu/torch"] > 0
    bench = phases["benchmark"]["steps"]
    assert bench["peaks"]["details"]["matmul_tflop_per_s"] > 0
    assert bench["qwen3_5_text"]["details"]["kernels"]["attention"]["cpu/torch"] > 0
    assert (tmp_path / "work" / "logs" / "recipes_glm_moe_dsa.log").exists()
    calibration = record["calibration"]
    mfu = calibration["mfu_by_model_type"]["qwen3_5_text"]["value"]
    assert 0 < mfu <= 1 and calibration["values"]["mfu"] <= mfu

    json_path = tmp_path / "gpu_check.json"
    args = ["--preset", "Qwen3.6-27B", "--prompt-tokens", "100000", "--time"]
    assert plan_main([*args, "--calibration", str(json_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"MFU {mfu:g}," in out
    assert f"mfu {mfu:g} ({json_path}: qwen3_5_text prefill at" in out
    assert "matmul peak measured on cpu" in out


@pytest.mark.multiprocess
def test_the_two_stage_phase_adds_up_its_ranks_kernels(tmp_path):
    """The multi_gpu phase's own code on two CPU ranks (gloo; a GPU machine runs the same
    command over NCCL): torchrun under the step's limit, a checkpoint, and each stage's
    kernel record (its own layers only) added into the step's."""
    out = tmp_path / "r.json"
    args = ["--device", "cpu", "--quick", "--families", "qwen3_5_text", "--out", str(out)]
    settings = gpu_check.parse_args(args)
    report = Report(out, {"settings": {"work": str(settings.work)}})
    report.plan({"multi_gpu": 55.0})
    with report.phase("multi_gpu") as phase:
        gpu_check.run_multi_gpu(settings, report, phase, gpu_check.Budget())
    step = phase.steps["qwen36"]
    assert step.status == "passed", step.tail
    assert step.details["checkpoint_saved"]
    stages = [json.loads((settings.work / f"kernels_multi_gpu_qwen36_{r}.json").read_text()) for r in (0, 1)]  # fmt: skip
    kernels = step.details["kernels"]
    for kind in ("attention", "deltanet"):
        assert kernels[kind]["cpu/torch"] == sum(s[kind].get("cpu/torch", 0) for s in stages) > 0
    assert json.loads(out.read_text())["phases"]["multi_gpu"]["status"] == "passed"


def test_host_syncs_are_counted_where_longstraw_asked_for_them(monkeypatch):
    """The host_syncs probe's counting (CUDA's sync debug mode stood in for: a CPU build has
    none): each synchronisation warning is put at its innermost LongStraw frame."""
    import gpu_check_rollout

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    source = (
        "import warnings\ndef step():\n    warnings.warn('called a synchronizing CUDA operation')\n"
    )
    namespace: dict = {}
    exec(compile(source, str(ROOT / "longstraw_core" / "decode_stand_in.py"), "exec"), namespace)

    def work():
        for _ in range(3):
            namespace["step"]()
        warnings.warn("an unrelated warning", stacklevel=1)

    sites = gpu_check_rollout.count_syncs(work)
    assert sites == {"longstraw_core/decode_stand_in.py:3 step": 3}
