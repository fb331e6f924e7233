"""scripts/benchmark.py on weights/tiny-sd in subprocesses, compiling with the suite's options (compile_flags.py):
every figure is there and sane (no timing thresholds)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from compile_flags import xla_flags

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "benchmark.py"
TINY = str(ROOT / "weights" / "tiny-sd")
SIZE = ["--height", "32", "--width", "48"]
TIMES = ("load_s", "compile_s", "first_call_s", "first_image_s", "seconds_per_call", "seconds_per_image")
RATES = ("unet_steps_per_s", "flops_per_image", "unet_eval_flops_per_image", "tflops_per_s")


def run_benchmark(args, tmp, env=None):
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu",
           "HF_HUB_OFFLINE": "1", "SDFLAX_CACHE_DIR": str(tmp / "jax-cache"), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=600)


def parse(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # the whole of stdout is one JSON object


def positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("benchmark")


@pytest.fixture(scope="module")
def checkpoint_run(tmp):
    return parse(run_benchmark(["--model", TINY, "--steps", "2", "--repeats", "2", *SIZE], tmp))


def test_reports_every_figure(checkpoint_run):
    out = checkpoint_run
    for key in TIMES + RATES:
        assert positive(out[key]), (key, out[key])
    assert len(out["seconds_per_call_all"]) == 2 and all(map(positive, out["seconds_per_call_all"]))
    assert out["peak_memory_bytes"] is None  # the CPU backend keeps no memory statistics
    assert {k: out[k] for k in ("model", "weights", "backend", "devices", "dtype", "attention", "height", "width",
                                "steps", "unet_evals", "batch_per_device", "images_per_call")} == {
        "model": TINY, "weights": "checkpoint", "backend": "cpu", "devices": 1, "dtype": "float32",
        "attention": "auto", "height": 32, "width": 48, "steps": 2, "unet_evals": 3, "batch_per_device": 1,
        "images_per_call": 1}  # PNDM without PRK steps evaluates the UNet steps + 1 times
    assert out["cache"]["enabled"] and out["cache"]["warm"] is False  # a fresh cache folder
    assert out["flops_per_image"] > out["unet_evals"] * out["unet_eval_flops_per_image"]  # plus text and VAE


def test_compare_torch_adds_its_figures_and_the_ratios(checkpoint_run, tmp):
    # Random weights from tiny-sd's configs: the path of the default sd15-random, for both frameworks.
    out = parse(run_benchmark(["--model", TINY, "--random-weights", "--steps", "1", "--repeats", "1",
                               "--compare", "torch", *SIZE], tmp))
    assert out["weights"] == "random" and out["unet_evals"] == out["torch"]["unet_evals"] == 1
    for key in ("load_s", "first_image_s", "seconds_per_call", "seconds_per_image", "unet_steps_per_s",
                "tflops_per_s"):
        assert positive(out["torch"][key]), key
        assert positive(out["ratio"][key]), key
    assert out["torch"]["peak_memory_bytes"] is None and "peak_memory_bytes" not in out["ratio"]
    # XLA counts the scan's body once: the script adds the other iterations. Same architecture and size, so the
    # difference of the two runs is exactly the extra UNet evaluations.
    assert out["unet_eval_flops_per_image"] == checkpoint_run["unet_eval_flops_per_image"]
    extra = checkpoint_run["flops_per_image"] - out["flops_per_image"]
    assert extra == pytest.approx(2 * out["unet_eval_flops_per_image"], rel=1e-3)


def test_compare_torch_without_torch_fails_at_once(tmp):
    fake = tmp / "no-torch"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    result = run_benchmark(["--model", TINY, "--compare", "torch"], tmp, env={"PYTHONPATH": str(fake)})
    assert result.returncode == 2 and result.stdout == ""
    assert "--compare torch needs PyTorch" in result.stderr


def load_script():
    spec = importlib.util.spec_from_file_location("benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def test_sd15_configs_give_sd15s_parameter_counts():
    benchmark = load_script()
    from sdflax.models import AutoencoderKL, CLIPTextModel, UNet2DConditionModel

    counts = {name: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(cls.from_config(
        benchmark.SD15[name]).param_shapes())) for name, cls in (
        ("unet", UNet2DConditionModel), ("text_encoder", CLIPTextModel), ("vae", AutoencoderKL))}
    assert counts == {"unet": 859_520_964, "text_encoder": 123_060_480, "vae": 83_653_863}


def test_sd35_configs_give_sd35_mediums_parameter_counts():
    """diffusers' and transformers' counts of stable-diffusion-3.5-medium's models; sdflax's transformer holds its
    384 x 384 x 1536 position table as a param, diffusers as a buffer."""
    benchmark = load_script()
    from sdflax.models import AutoencoderKL, CLIPTextModelWithProjection, SD3Transformer2DModel, T5EncoderModel

    counts = {name: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(cls.from_config(
        benchmark.SD35_MEDIUM[name]).param_shapes())) for name, cls in (
        ("transformer", SD3Transformer2DModel), ("vae", AutoencoderKL), ("text_encoder", CLIPTextModelWithProjection),
        ("text_encoder_2", CLIPTextModelWithProjection), ("text_encoder_3", T5EncoderModel))}
    assert counts == {"transformer": 2_243_171_520 + 384 * 384 * 1536, "vae": 83_819_683,
                      "text_encoder": 123_650_304, "text_encoder_2": 694_659_840, "text_encoder_3": 4_762_310_656}


# SD 3.5 Medium's block structure with few channels and layers: a folder of configs and a CLIP tokenizer
TINY_SD3 = {
    "transformer": dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
                        caption_projection_dim=32, pooled_projection_dim=32 + 32, pos_embed_max_size=16,
                        qk_norm="rms_norm", dual_attention_layers=[0]),
    "vae": dict(latent_channels=16, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4,
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                sample_size=64, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                use_post_quant_conv=False),
    "text_encoder": dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                         hidden_act="quick_gelu", projection_dim=32, max_position_embeddings=77),
    "text_encoder_2": dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           hidden_act="gelu", projection_dim=32, max_position_embeddings=77),
    "text_encoder_3": dict(vocab_size=64, d_model=64, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                           feed_forward_proj="gated-gelu"),
}


def test_sd3_random_weights_against_diffusers(tmp):
    """--random-weights on an SD 3 folder's configs (sd35-medium-random's path at a size a test affords), with T5,
    against diffusers' StableDiffusion3Pipeline in its own process: its figures, the ratios, the same FLOP count."""
    import shutil

    folder = tmp / "tiny-sd3"
    for name, config in {**TINY_SD3, "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler",
                                                   "shift": 3.0}}.items():
        (folder / name).mkdir(parents=True)
        (folder / name / ("scheduler_config.json" if name == "scheduler" else "config.json")).write_text(
            json.dumps(config))
    shutil.copytree(Path(TINY) / "tokenizer", folder / "tokenizer")
    out = parse(run_benchmark(["--model", str(folder), "--random-weights", "--steps", "2", "--repeats", "1",
                               "--compare", "torch", "--height", "64", "--width", "48"], tmp))
    assert {k: out[k] for k in ("weights", "t5", "scheduler", "height", "width", "unet_evals", "guidance_scale")} == {
        "weights": "random", "t5": True, "scheduler": "flow_match_euler", "height": 64, "width": 48,
        "unet_evals": 2, "guidance_scale": 7.5}
    assert out["torch"]["unet_evals"] == 2
    for key in ("load_s", "first_image_s", "seconds_per_call", "seconds_per_image", "unet_steps_per_s",
                "tflops_per_s"):
        assert positive(out[key]) and positive(out["torch"][key]) and positive(out["ratio"][key]), key
    # XLA counts the scan's body once: the script adds the other evaluation of the transformer
    assert out["flops_per_image"] > out["unet_evals"] * out["unet_eval_flops_per_image"]


def test_no_t5_is_for_sd3(tmp):
    result = run_benchmark(["--model", TINY, "--no-t5"], tmp)
    assert result.returncode == 2 and result.stdout == "" and "--no-t5 leaves out SD 3.5's T5" in result.stderr


def test_kernel_benchmark_reports_every_kernel(tmp):
    """scripts/benchmark_kernels.py on tiny shapes: both attention paths, both conv paths, every figure."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_kernels.py"), "--small",
                             "--repeats", "1"], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    out = parse(result)
    assert [row["loops"] for row in out["attention"]] == [True, False]  # 9.7 MB and 39 kB of logits
    assert [row["patch_matmul"] for row in out["conv"]] == [True, False]  # 64 pixels x 256 channels; 1024 pixels
    for row, count in [(row, 5) for row in out["attention"]] + [(row, 5) for row in out["conv"]]:
        figures = {k: v for k, v in row.items() if k not in ("shape", "loops", "patch_matmul")}
        assert len(figures) == count and all(map(positive, figures.values())), row
