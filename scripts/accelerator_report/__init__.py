"""The accelerator run in one command: sdflax against diffusers (PyTorch) on the device it finds, as one JSON.

On a GPU machine without internet access, from the repository root, with the two wheels such machines' images
lack in `.whl/` (downloaded where pip works: `pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp --platform manylinux2014_x86_64 -d .whl diffusers==0.39.0 importlib_metadata==10.2.0`):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/sdflax .
    PYTHONPATH=/tmp/site:/tmp/sdflax python3 scripts/accelerator_report.py --out report.json --deadline-s 525

It needs jax (CUDA), flax, tokenizers, huggingface_hub, torch (CUDA) and transformers there; sdflax comes from the
working tree, installed with its dependencies left alone. The whole run (`--part all`) takes about 15 minutes of
an H200's time before the jobs that come last, SD 3.5 Medium's, the training's and FLUX.1-dev's (a deadline may
drop them: `--part sd35`, `--part train` and `--part flux` run them alone); each part (`--part
correctness|sd15|sdxl|sd35|flux|compile|flags|train`) fits a 10-minute command, but for Flux's batch-4 jobs, last
in its part (`--part flux --batch 4` runs them alone), `--family sd15|sdxl|sd35|flux` keeps one family's jobs of a
part, `--batch N` its speed jobs at batch N, and `--deadline-s` stops launching jobs once that many seconds have
passed (and stops a running one there), so a run never outlasts its time limit. The report is rewritten after every
job: a run cut short keeps what it finished. The Flux part has not run on a GPU yet; by its FLOPs (2.1 PFLOP an
image) its parity and batch 1 should take about 5 minutes of an H200's, its batch 4 about 6 more.

On a TPU VM (`pip install "jax[tpu]" flax tokenizers huggingface_hub ml_dtypes pillow tqdm diffusers==0.39.0
transformers torch --extra-index-url https://download.pytorch.org/whl/cpu`, then the command above without
PYTHONPATH's /tmp/site): sdflax runs in bfloat16 with the Pallas flash attention kernel where its 128-token
blocks fit (`Kernels.pallas_runs`), correctness compares it with PyTorch on the host's CPU, and the diffusers speed
jobs are skipped (PyTorch has no TPU without torch_xla), so the speed rows are sdflax's alone.

On the CPU (`python scripts/accelerator_report.py --out report.json`: `--size tiny`, the default there; it needs
the test extra, `pip install -e '.[test]'`, for torch and diffusers) the same code runs on small models of the
same architectures, one
job per code path; tests/test_accelerator_report.py does that daily, so the GPU path's code runs up to the device
calls. There the jobs that do not time their own start-up are forked from the parent, which imports the libraries
once (the tiny models cost less than importing torch and diffusers in every job), and two jobs run at once, each
after the jobs whose files it reads; an accelerator's jobs run one at a time, in order, so that none times another.

What it measures. Random weights everywhere: the compute of the real checkpoints, no download.
- `correctness`, for the SD 1.5 and SDXL architectures (one fresh process each): the UNet, the VAE decoder and the
  text encoder(s) against diffusers/transformers on the same device and inputs. float32 with
  `jax_default_matmul_precision="highest"` and PyTorch's TF32 off; bfloat16 against diffusers' bfloat16 and both
  against float32; the relative L2 error ‖ours − theirs‖ / ‖theirs‖ of each, against a stated bound (`ok`), and
  whether the output is finite and not constant. `attention`: each attention shape of the UNet at bfloat16, which
  kernel sdflax picks on this device (`Kernels.attention_kernel`) and XLA's, cuDNN's (NVIDIA) and Pallas's (TPU)
  results against float64. `flux` (`--part flux`): FLUX.1-dev's pipeline against diffusers' `FluxPipeline` on small
  random models (`configs.FLUX_PARITY`: FLUX.1-dev's widths, 24 heads x 128 and its rotary axes, with one double-
  and two single-stream blocks and two T5-XXL layers), float32 as above: the image of a few steps from the same
  packed noise and two prompts, and the transformer's one evaluation.
- `speed`, each job in its own fresh process: sdflax (`auto`: cuDNN attention where it runs, or `xla`) and diffusers
  (SDPA, float16; `+compile`: its UNet through `torch.compile`) at the issue's settings (SD 1.5 512x512 50 PNDM
  steps, SDXL 1024x1024 30 Euler steps, the MLPerf setting: SDXL 1024x1024, 20 Euler steps, guidance 8, batch 8;
  SD 3.5 Medium 1024x1024, 28 flow-matching Euler steps, guidance 7.0, T5-XXL's 256 tokens, batch 1; FLUX.1-dev
  1024x1024, 28 steps, its distilled guidance 3.5, T5-XXL's 512 tokens, batch 1 and 4, both in bfloat16 (T5 would
  overflow in diffusers' float16), diffusers given sdflax's noise packed. Its 12 billion transformer weights (19
  double- and 38 single-stream blocks) and T5-XXL's 4.8 billion are 33 GB in bfloat16, one copy in each job's
  process; diffusers' are drawn in float32 a model at a time, 48 GB at most: an 80 GB H100 holds either.
  Per batch size: the first call (compiling included), the median of `--repeats` timed calls with their range,
  seconds per image, images per second, peak device memory, FLOPs per image from XLA's cost analysis (UNet
  evaluations (SD 3.5, Flux: its transformer's, under the same keys) and the VAE decode; the same count is used for
  diffusers) and the achieved TFLOP/s; the flops job also traces and lowers the setting's whole program from
  the param shapes (`program`: the host's seconds of a cold compile, the size of the StableHLO module).
  Per process: `ready_s`, from the process's start to the first program compiled and run once (a cold compile
  cache, then a warm one); `import_s`, `build_s`. The cold- and warm-cache jobs load their weights as a user does
  (`from_pretrained`) from an SD 1.5 checkpoint that the run writes first with diffusers' `save_pretrained`
  (float32 safetensors, as on the hub: 4.3 GB, read from the page cache); the other jobs draw random weights.
  Each sdflax job ends with one more call of its last batch under JAX's profiler (`profile`): its kernels' device
  seconds in all, by category (attention, convolution, matmul, memory, XLA's other fusions) and the top kernels.
  `--part flags` times SD 1.5 at batch 1 and the MLPerf setting under XLA's defaults and each of `XLA_FLAG_SETS`,
  the measurement behind sdflax setting no XLA flags; each run's `compile_s` is a cold compile (no cache), so
  `--part flags --family sdxl` (the MLPerf setting alone, the compile-time sets first; about 2 minutes a job on an
  H100) says what the autotuning and Triton GEMM flags save of SDXL's compile and cost of its speed.
- `compile_split` (`--part compile --family sdxl` alone): the MLPerf setting's models (the UNet's one evaluation on
  the guidance batch, the VAE decode, each text encoder) each lowered and compiled cold on the device from the
  param shapes: which model's compile the speed job's `compile_s` is made of. Then what scanning over the repeated
  layers (one loop body instead of SDXL's stacks of ten, CLIP-G's 32 layers) would save of it: the UNet and the
  text encoders with each stack cut to one layer (`one_layer`, a bound), the UNet with each stack one `lax.scan`
  over its layers' stacked params (`scanned`), and both UNets run on the same random weights (`unet_runs`): what
  scanning would cost of the speed, and the scanned output against the plain one.
- `training` (`--part train`; in `all` before Flux's): a LoRA update (rank 4 on the UNet's attention projections, cached
  latents, the text encoders run in the step, bfloat16 compute with the LoRA and Adam in float32) of
  `sdflax.train` against diffusers' LoRA scripts' update with PEFT (`train_text_to_image_lora.py`, its SDXL twin),
  each in its own process: SD 1.5 at 512² batch 8 and SDXL at 1024² batch 2. The first step (compiling included),
  the median of `--repeats` steps with their range, steps and images per second, peak device memory, and both
  against diffusers'. diffusers' side needs peft: add `peft==0.21.2 accelerate==1.15.0 psutil pyyaml` to the
  wheels downloaded above where the image lacks them.
- `provenance`: the devices, the driver, package versions, the command, the commit (`--commit`, else git's).
- `table`: the speed rows as Markdown, for the README's GPU table.

JSON schema (version 1): {"schema": 1, "provenance": {...}, "correctness": {family: {"float32": {model: check},
"bfloat16": {model: check}, "attention": [layer, ...], "unet_attention": {"auto": check, "xla": check}}, "flux":
{"image_size", "steps", "max_sequence_length", "prompts", "image_std", "float32": {"image": check, "transformer":
check}}}, "speed":
{"runs": [run, ...], "flops": [count, ...], "compile_split": [split, ...], "checkpoint": {"family", "bytes",
"wall_s"}}, "training": [run, ...], "table": str, "errors": [str, ...]} ("checkpoint" where a job loads one); a
check is {"rel_l2", "max_abs", "bound", "ok", "finite", "constant"}; a run is the job's settings and {"wall_s",
"ready_s", "results": [{"batch", "seconds_per_call", ..., "tflops_per_s"}]} (an sdflax run also {"profile":
{"batch", "wall_s", "device_busy_s", "kernel_launches", "categories_s": {...}, "top": [{"name", "hlo_op", "count",
"seconds"}, ...]}}, or {"profile": {"batch", "error"}}); a count is a setting and {"flops_per_image", ...,
"program": {"batch", "trace_s", "lower_s", "stablehlo_bytes", "stablehlo_lines"}}; a split is a setting and
{"batch", "dtype", "device", "models": {model: times}, "one_layer": {model: times}, "scanned": {"unet": times},
"unet_runs": {"plain": run, "scanned": run, "scanned_rel_l2", "output_std"}}, times being {"lower_s", "compile_s",
"stablehlo_lines"} and a UNet run {"first_call_s", "seconds_per_call", "seconds_per_call_min",
"seconds_per_call_max"}. A training run is the job ({"framework", "family", "batches", "rank", "mixed_precision"})
and {"import_s", "build_s", "dtype", "device", "wall_s", "results": [{"batch", "first_step_s", "seconds_per_step",
"seconds_per_step_min", "seconds_per_step_max", "steps_per_s", "images_per_s", "peak_memory_bytes",
"speedup_vs_diffusers", "memory_vs_diffusers"}]}.
"""

# Its modules: configs (the models' configs: sdflax's bundled ones, and the tiny ones), jobs (each part's jobs),
# processes (the command line, each job in a process of its own), models (random weights in sdflax and in
# diffusers), correctness, speed, profile (where a call's device time goes), compile_split, training, timing (the
# clocks of a process and of its job) and report (the JSON and its Markdown table). What the command line and
# the tests import from the package:
from .compile_split import one_layer_configs, scanned_transformer_stacks
from .configs import FULL, SIZES, TINY, configs_for
from .correctness import BFLOAT16_FLOOR, FLOAT32_BOUND, attention_shapes, compare
from .jobs import COMPILE_FLAG_SETS, XLA_FLAG_SETS, code_path, jobs, plan, setting_key
from .models import model_calls, model_classes, random_params
from .processes import JobProcess, job_environment, main, needs, run_jobs, work, worker_command
from .profile import kernel_category
from .report import SCHEMA, assemble, markdown

__all__ = ["BFLOAT16_FLOOR", "COMPILE_FLAG_SETS", "FLOAT32_BOUND", "FULL", "JobProcess", "SCHEMA", "SIZES", "TINY",
           "XLA_FLAG_SETS", "assemble", "attention_shapes", "code_path", "compare", "configs_for", "job_environment",
           "jobs", "kernel_category", "main", "markdown", "model_calls", "model_classes", "needs",
           "one_layer_configs", "plan", "random_params", "run_jobs", "scanned_transformer_stacks", "setting_key",
           "work", "worker_command"]
