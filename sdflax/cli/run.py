"""Running a request: load the pipeline (and ControlNets, T2I- and IP-Adapters, LoRAs, embeddings, a refiner),
prepare the inputs, and make the images over a device mesh with `generate_sharded`, the one mode of `sdflax generate`,
`img2img`, `inpaint` and `batch` (`sample_rows`)."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

import numpy as np

from .. import cache
from .ip_adapter import check_ip_adapters, ip_adapter_inputs, load_ip_adapters
from .output import image_settings, output_target, save
from .pictures import read_controls, read_pictures
from .preflight import (check_attention, check_checkpoint, check_lora_and_embedding_files, command_line_side,
                        controlnet_configs)
from .request import UserError
from .sd3 import guidance_arguments, prompt_arguments
from .t2i_adapter import adapter_inputs, check_adapter_flags, load_t2i_adapters

# The events JAX records for tracing, lowering and compiling (or loading from the disk cache) one program.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def run(request) -> int:
    """generate, img2img and inpaint: check everything cheap, load, prepare the inputs, compile and run, write."""
    status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if request.progress is not False else (lambda m: 0)
    target = output_target(request.out, request.grid, request.num_images)  # before anything slow
    pictures = read_pictures(request)  # {"image": ..., "mask": ...} for img2img / inpaint
    controls = read_controls(request)  # the --control-image pictures, one per --controlnet
    check_ip_adapters(request)  # the --ip-image pictures are read again where the rows are made
    check_adapter_flags(request)  # the --adapter-image pictures are read again at the output size
    if request.progress is False:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    check_lora_and_embedding_files(request)
    checkpoint, pictures, controls = check_checkpoint(request, pictures, controls)
    request = dataclasses.replace(request, steps=checkpoint.steps)  # --steps, or the pipeline's default

    import jax  # after the checks above, so that mistakes are reported without starting JAX

    from ..parallel import device_mesh

    cache_dir = use_compile_cache(request)
    backend = jax.default_backend()
    dtype = request.dtype or ("float32" if backend == "cpu" else "bfloat16")
    check_attention(request, backend, dtype)
    mesh = device_mesh()
    num_images = request.num_images or mesh.size
    seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    target.check_unused(request.prompt, [(seed + i) % 2**32 for i in range(num_images)], request.grid)

    status(f"Loading {request.model} in {dtype} ...")
    start = time.perf_counter()
    pipeline, params = load(request, checkpoint, dtype)
    refiner = load_refiner(request, dtype) if checkpoint.high_noise_frac is not None else None
    seeds, call = prepare(request, pipeline, params, checkpoint, pictures, controls, seed, mesh, refiner)
    load_s = time.perf_counter() - start

    where = devices_text(mesh.size, backend)
    status(compiling_line(request.steps, checkpoint, len(seeds), where, cache_dir))
    step_bar = StepBar(steps_run(request, checkpoint, refiner)) if request.progress else None
    with CompileClock() as clock:
        start = time.perf_counter()
        images = out_of_memory_is_one_line(call, step_bar, f"{len(seeds)} image(s) of {checkpoint.width}x"
                                           f"{checkpoint.height} on {where}", "use fewer --num-images, a smaller "
                                           "size, or --dtype bfloat16")
        total_s = time.perf_counter() - start
    if step_bar is not None:
        step_bar.close()
    images = pipeline.numpy_to_pil(images)[:num_images]
    save(request, target, images, seeds[:num_images], image_settings(request, pipeline.scheduler, checkpoint, dtype))

    cached = " (from the disk cache)" if clock.cache_hits else ""
    print(f"seed {seeds[0]}: load {load_s:.1f} s, compile {clock.seconds:.1f} s{cached}, "
          f"generate {max(total_s - clock.seconds, 0.0):.1f} s for {len(seeds)} image(s)", file=sys.stderr)
    return 0


def use_compile_cache(request) -> str | None:
    """JAX's compilation cache in --cache-dir or sdflax's cache folder (None: SDFLAX_CACHE_DIR=off), turned on
    before the first compile: the one place the command line does it."""
    return cache.enable_compile_cache(os.path.expanduser(request.cache_dir) if request.cache_dir else None)


def compiling_line(steps, checkpoint, count, where, cache_dir) -> str:
    """The status line before a program's first call (generate's and batch's)."""
    strength = f" (strength {checkpoint.strength})" if checkpoint.strength is not None else ""
    return (f"Compiling for {steps} steps{strength} at {checkpoint.width}x{checkpoint.height}, {count} image(s) on "
            f"{where} (once per setting; {f'kept in {cache_dir}' if cache_dir else 'not kept'}) ...")


def devices_text(count, backend) -> str:
    return f"{count} {backend.upper()} device" + ("s" if count > 1 else "")


def out_of_memory_is_one_line(call, callback, what, fix):
    """call(callback), with the device running out of memory told in one line, not XLA's dump."""
    import jax

    try:
        return call(callback)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise UserError(f"out of memory making {what}: {fix}") from None


# ---- loading ------------------------------------------------------------------------------------------------

def load(request, checkpoint, dtype):
    """(pipeline, params) of the checkpoint's pipeline class, with the ControlNets, T2I- and IP-Adapters, LoRAs and
    embeddings."""
    import jax.numpy as jnp

    from .. import ControlNetModel

    kind, dtype = checkpoint.pipeline, getattr(jnp, dtype)
    try:
        nets = []
        for name, config in zip(request.controlnet, controlnet_configs(request)):
            if os.path.isfile(os.path.expanduser(name)):  # an original-layout file
                nets.append(load_controlnet_file(name, config, dtype, request.attention))
            else:
                nets.append(ControlNetModel.from_pretrained(name, dtype=dtype, attention=request.attention))
        adapters = load_t2i_adapters(request, dtype)
        extra = {"controlnet": [net for net, _ in nets]} if nets else {}
        extra.update({"adapter": [adapter for adapter, _ in adapters]} if adapters else {})
        if checkpoint.single_file:  # read by its family's layout, its errors in the family's flags
            pipeline, params = command_line_side(checkpoint.family).load_single_file(request, kind, dtype, extra)
        else:
            extra.update({"text_encoder_3": None} if request.no_t5 else {})
            pipeline, params = kind.from_pretrained(request.model, revision=request.revision, dtype=dtype,
                                                    scheduler=request.scheduler, attention=request.attention,
                                                    **extra)
    except (OSError, ValueError) as e:  # files missing, unreadable or not matching their config
        raise UserError(str(e)) from e
    if nets:
        params["controlnet"] = [net_params for _, net_params in nets]
    if adapters:
        params["adapter"] = [adapter_params for _, adapter_params in adapters]
    if request.ip_adapter:
        pipeline, params = load_ip_adapters(request, pipeline, params)
    return add_loras_and_embeddings(request, pipeline, params)


def load_controlnet_file(name, config, dtype, attention):
    """(controlnet, params) of an original-layout --controlnet file, its config from --controlnet-config or read
    off its tensors."""
    from .. import ControlNetModel
    from ..loading.single_file import SingleFileError

    try:
        return ControlNetModel.from_single_file(os.path.expanduser(name), config=config, dtype=dtype,
                                                attention=attention)
    except SingleFileError as e:  # the library's advice names its Python argument, config=: here it is a flag
        raise flag_error("--controlnet", name, str(e).replace("pass config=<", "pass --controlnet-config <")) from e


def load_refiner(request, dtype):
    """(pipeline, params) of --refiner, an SDXL image-to-image pipeline (a refiner: its second encoder alone)."""
    import jax.numpy as jnp

    from .. import StableDiffusionXLImg2Img

    try:
        return StableDiffusionXLImg2Img.from_pretrained(request.refiner, dtype=getattr(jnp, dtype),
                                                        scheduler=request.scheduler, attention=request.attention)
    except (OSError, ValueError) as e:
        raise UserError(f"--refiner {request.refiner}: {e}") from e


def add_loras_and_embeddings(request, pipeline, params):
    """(pipeline, params) with each --lora merged in order, then each --embedding's token added (a pipeline whose
    tokenizer knows it)."""
    for path, scale in request.lora:
        try:
            params = pipeline.load_lora(params, os.path.expanduser(path), scale)
        except (OSError, ValueError) as e:  # LoraMismatchError: a LoRA for another model
            raise flag_error("--lora", path, e) from e
    for path in request.embedding:
        try:
            pipeline, params = pipeline.load_textual_inversion(params, os.path.expanduser(path))
        except (OSError, ValueError) as e:
            raise flag_error("--embedding", path, e) from e
    return pipeline, params


def flag_error(flag, path, error) -> UserError:
    """The library's message (an error or its text) about a file, led by the flag that named it."""
    message = str(error)
    return UserError(f"{flag} {message}" if message.startswith(path) else f"{flag} {path}: {message}")


# ---- inputs and the call ------------------------------------------------------------------------------------

def prepare(request, pipeline, params, checkpoint, pictures, controls, seed, mesh, refiner=None):
    """(seeds, call(callback) -> images): the images fill every device of `mesh`, and image i has its own key,
    seed + i, so it does not depend on the batch it was made in."""
    from ..parallel import replicate_on

    per_device = -(-(request.num_images or mesh.size) // mesh.size)
    seeds = [(seed + i) % 2**32 for i in range(per_device * mesh.size)]
    rows = [dataclasses.replace(request, seed=s) for s in seeds]
    return seeds, sample_rows(pipeline, replicate_on(params, mesh), mesh, checkpoint, rows, pictures, controls,
                              refiner)


def sample_rows(pipeline, params, mesh, checkpoint, rows, pictures=None, controls=None, refiner=None):
    """call(callback) -> this process's images of `rows` (requests of one program and guidance scale that differ
    in prompts, seed and image prompts), made by `generate_sharded` over `mesh`, the same pictures for every row.
    With `refiner` (pipeline, params) the base runs to --high-noise-frac and the refiner from there."""
    import jax

    if checkpoint.guider is not None:
        pipeline = pipeline.with_guider(checkpoint.guider)
    n = len(rows)
    ids = pipeline.prepare_inputs([r.prompt for r in rows], **prompt_arguments(rows))
    # Pass negative ids even for an empty prompt (it is SD's and SD 3's unconditional one): one program with or
    # without them. SDXL's default is zeros for no negative prompt (force_zeros_for_empty_prompt): None there.
    negative = any(r.negative_prompt or r.negative_prompt_2 for r in rows)
    neg_ids = None if checkpoint.family.zeros_for_empty_negative and not negative else pipeline.prepare_inputs(
        [r.negative_prompt for r in rows], **prompt_arguments(rows, negative=True))
    # one key per image (sdflax.random_draws), as numpy: every process of a mesh spanning several passes them all
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(r.seed))) for r in rows])
    arrays, extra = [], {}
    if pictures:
        from ..pipeline.images import preprocess_images, preprocess_images_and_masks

        try:
            if "mask" in pictures:
                arrays = list(preprocess_images_and_masks([pictures["image"]], [pictures["mask"]],
                                                          pipeline.vae_scale_factor))
            else:
                arrays = [preprocess_images([pictures["image"]], pipeline.vae_scale_factor)]
        except ValueError as e:
            raise UserError(str(e)) from e
        extra["strength"] = checkpoint.strength
    if controls:
        from ..pipeline.images import preprocess_control_images

        arrays.append([preprocess_control_images([picture], pipeline.vae_scale_factor)
                       for picture in controls.pictures])
        extra["controlnet_conditioning_scale"] = list(checkpoint.control_scales)
    arrays = [jax.tree.map(lambda x: np.repeat(x, n, axis=0), x) for x in arrays]  # the same for every row
    positional, keywords = adapter_inputs(pipeline, checkpoint.adapters, n)
    arrays, extra = arrays + positional, {**extra, **keywords}
    extra.update(ip_adapter_inputs(pipeline, rows))  # each row's own
    if not pictures:
        extra.update(height=checkpoint.height, width=checkpoint.width)
    request = rows[0]
    extra.update(guidance_arguments(request))

    def call(callback=None, **more):
        return pipeline.generate_sharded(ids, *arrays, params, keys, num_inference_steps=request.steps,
                                         guidance_scale=checkpoint.guidance, neg_prompt_ids=neg_ids, mesh=mesh,
                                         callback=callback, **extra, **more)

    return call if refiner is None else refined(call, refiner, mesh, checkpoint, rows, keys)


def refined(base, refiner, mesh, checkpoint, rows, keys):
    """The base call stopped at --high-noise-frac, returning its latents, and the refiner continuing from them with
    the same steps, guidance and per-image keys: diffusers' base + refiner, `denoising_end` then `denoising_start`.
    The refiner has one text encoder (the second): as diffusers, it reads the prompt and negative prompt."""
    from ..parallel import replicate_on

    pipe, params = refiner
    if checkpoint.guider is not None:
        pipe = pipe.with_guider(checkpoint.guider)
    ids = pipe.prepare_inputs([r.prompt for r in rows])
    # No negative prompt: the refiner's own default (the empty prompt's embedding: it does not force zeros)
    negative = any(r.negative_prompt for r in rows)
    neg_ids = pipe.prepare_inputs([r.negative_prompt for r in rows]) if negative else None
    params = replicate_on(params, mesh)

    def call(callback=None):
        latents = base(callback, denoising_end=checkpoint.high_noise_frac, output_type="latent")
        if callback is not None:
            callback.close()  # the base's bar ends before the refiner's starts
        steps = rows[0].steps
        bar = StepBar(steps - refiner_start(pipe, steps, checkpoint.high_noise_frac), "refining") \
            if callback is not None else None
        try:
            return pipe.generate_sharded(ids, latents, params, keys, num_inference_steps=rows[0].steps,
                                         guidance_scale=checkpoint.guidance, neg_prompt_ids=neg_ids,
                                         denoising_start=checkpoint.high_noise_frac, mesh=mesh, callback=bar)
        finally:
            if bar is not None:
                bar.close()
    return call


# ---- progress and timing ------------------------------------------------------------------------------------

def steps_run(request, checkpoint, refiner=None) -> int:
    """The steps of the schedule the (base) model runs: img2img and inpaint skip the first 1 - strength of them; with
    a refiner the base stops where the refiner's part begins."""
    from ..pipeline.starts import start_step

    if checkpoint.strength is not None:
        return request.steps - start_step(request.steps, checkpoint.strength)
    if refiner is not None:
        return refiner_start(refiner[0], request.steps, checkpoint.high_noise_frac)
    return request.steps


def refiner_start(pipe, steps, high_noise_frac) -> int:
    """The steps of the schedule the refiner skips: the base's."""
    from ..pipeline.starts import schedule_window
    from ..pipeline.types import Settings

    return schedule_window(pipe.scheduler, Settings(steps, denoising_start=high_noise_frac))[0]


class StepBar:
    """A tqdm bar of `steps` steps fed by the pipeline's per-evaluation host callback. A sampler may run more
    evaluations than steps (PNDM one more, Heun and DPM2 two a step): evaluation i of n completes
    (i + 1) * steps // n steps, so the bar ends at steps/steps. Each device reports every evaluation, so it counts
    once, when the first device reaches it. One object per run: the callback is static."""

    def __init__(self, steps, desc="denoising"):
        self.steps, self.desc = steps, desc
        self.bar, self.done, self.lock = None, 0, threading.Lock()

    def __call__(self, evaluation, num_evals, latents):
        with self.lock:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.steps, desc=self.desc, unit="step", file=sys.stderr, dynamic_ncols=True)
            done = (evaluation + 1) * self.steps // num_evals
            if done > self.done:
                self.bar.update(done - self.done)
                self.done = done

    def close(self):
        if self.bar is not None:
            self.bar.close()


class CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (or loading compiled programs) inside the block."""

    def __enter__(self):
        from jax import monitoring

        self.seconds, self.cache_hits = 0.0, 0
        monitoring.register_event_duration_secs_listener(self.on_duration)
        monitoring.register_event_listener(self.on_event)
        return self

    def __exit__(self, *exc):
        from jax import monitoring

        monitoring.unregister_event_duration_listener(self.on_duration)
        monitoring.unregister_event_listener(self.on_event)

    def on_duration(self, event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            self.seconds += duration

    def on_event(self, event, **kwargs):
        if event == CACHE_HIT_EVENT:
            self.cache_hits += 1
