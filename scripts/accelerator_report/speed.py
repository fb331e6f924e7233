"""The speed jobs: each setting timed in sdflax and in diffusers, and its FLOPs counted by XLA."""

from __future__ import annotations

import statistics
import time

from .configs import PROMPT, configs_for
from .models import diffusers_pipeline, model_calls, model_classes, sdflax_pipeline, torch_models
from .profile import device_profile
from .timing import job_seconds, log, timed


def figures(batch, first, times, peak):
    median = statistics.median(times)
    return {"batch": batch, "first_call_s": first, "seconds_per_call": median, "seconds_per_call_min": min(times),
            "seconds_per_call_max": max(times), "seconds_per_image": median / batch, "images_per_s": batch / median,
            "peak_memory_bytes": peak}


def speed_sdflax(job, size, repeats):
    import jax
    import jax.numpy as jnp

    if job["cache"] == "none":
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_compilation_cache_dir", job["cache_dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from sdflax.cli import CompileClock

    import_s = job_seconds()
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    if job.get("weights") == "checkpoint":  # a user's load: the files written by `write_checkpoint`
        from sdflax import StableDiffusion

        pipeline, params = StableDiffusion.from_pretrained(job["checkpoint"], dtype=dtype, scheduler=job["scheduler"],
                                                           attention=job["attention"])
    else:
        pipeline, params = sdflax_pipeline(job["family"], size, dtype, job["attention"], job["scheduler"])
    jax.block_until_ready(params)
    build_s = job_seconds() - import_s
    side = configs_for(job["family"], size)["size"]
    out = {"import_s": import_s, "build_s": build_s, "dtype": jnp.dtype(dtype).name,
           "device": jax.devices()[0].device_kind, "height": side, "width": side, "results": []}
    for batch in job["batches"]:
        ids = pipeline.prepare_inputs([PROMPT] * batch)

        def call(seed):
            # Flux: the noise diffusers' job is given (packed), as `latents`
            extra = {"latents": flux_noise(batch, side, seed)} if job["family"] == "flux" else {}
            images = pipeline(ids, params, jax.random.key(seed), num_inference_steps=job["steps"], height=side,
                              width=side, guidance_scale=job["guidance"], **extra)
            return images.images

        log(f"sdflax {job['family']} batch {batch} ...")
        with CompileClock() as clock:
            try:
                first, times = timed(call, repeats)
            except Exception as e:  # cuDNN refusing a shape: say so, and measure XLA's attention instead
                if pipeline.denoiser.model.kernels.attention == "xla":
                    raise
                log(f"attention {job['attention']!r} failed ({type(e).__name__}: {e}); XLA's attention instead")
                out["attention_fallback"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
                pipeline, params = sdflax_pipeline(job["family"], size, dtype, "xla", job["scheduler"])
                first, times = timed(call, repeats)
        if "ready_s" not in out:
            out["ready_s"] = job_seconds() - sum(times)
            out["cache_hits"] = clock.cache_hits
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        out["results"].append({**figures(batch, first, times, peak), "compile_s": clock.seconds})
    log(f"sdflax {job['family']} batch {batch}: one more call, profiled ...")
    out["profile"] = {"batch": batch, **device_profile(lambda: call(repeats + 1))}  # the last batch's
    return out


def speed_diffusers(job, size, repeats):
    import torch

    import_s = job_seconds()
    cuda = torch.cuda.is_available()
    family = job["family"]
    # Flux in bfloat16, as diffusers' Flux pipelines run it (T5-XXL's float16 activations overflow)
    device, dtype = ("cuda", torch.bfloat16 if family == "flux" else torch.float16) if cuda else ("cpu", torch.float32)
    configs = configs_for(family, size)
    models = torch_models(family, size, device, dtype=dtype)
    pipe = diffusers_pipeline(family, models, configs["scheduler"], job["scheduler"])
    compiled = job["framework"] == "diffusers+compile"
    if compiled:  # diffusers' speed guide: channels-last, the UNet compiled whole
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.unet = torch.compile(pipe.unet, fullgraph=True, backend="inductor" if cuda else "eager")
    build_s = job_seconds() - import_s
    side = configs["size"]
    out = {"import_s": import_s, "build_s": build_s, "dtype": str(dtype).removeprefix("torch."),
           "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
           "attention": "sdpa", "compile": "torch.compile(unet, fullgraph=True)" if compiled else None,
           "height": side, "width": side, "results": []}
    for batch in job["batches"]:
        def call(seed):
            extra = {}
            if family == "flux":  # sdflax's noise, packed as diffusers takes it
                noise = torch.from_numpy(flux_noise(batch, side, seed))
                extra["latents"] = pipe._pack_latents(noise, *noise.shape).to(device)
            pipe([PROMPT] * batch, height=side, width=side, num_inference_steps=job["steps"],
                 guidance_scale=job["guidance"], generator=torch.Generator(device).manual_seed(seed),
                 output_type="np", **extra)
            if cuda:
                torch.cuda.synchronize()

        log(f"diffusers {family} batch {batch} ...")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            first, times = timed(call, repeats)
        if "ready_s" not in out:
            out["ready_s"] = job_seconds() - sum(times)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        out["results"].append(figures(batch, first, times, peak))
    return out


def flux_noise(batch, side, seed):
    """A Flux call's initial latents (batch, 16, side/8, side/8), the same in sdflax's job and in diffusers'."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal((batch, 16, side // 8, side // 8), np.float32)


def flop_count(job, size):
    """FLOPs per image of a speed setting from XLA's cost analysis, counted in a CPU-only process from the param
    shapes (no weights, no device): the UNet (SD 3.5, Flux: the transformer, counted under the same keys) lowered
    once with XLA's attention (cuDNN's is a custom call XLA cannot count) on a guidance batch of two rows (Flux, its
    guidance an input: one), times its evaluations, plus the VAE decode. The text encoders' share is left out
    (under 0.1%; SD 3.5's T5-XXL, about 0.4%; Flux's T5-XXL on 512 tokens, about 0.2% a prompt). The count is the
    model's, whatever device or framework runs it."""
    import jax
    import jax.numpy as jnp

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes
    from sdflax.models.layers import Kernels
    from sdflax.schedulers import scheduler_from_config

    configs = configs_for(job["family"], size)
    kernels = Kernels("gpu", None, "xla")  # a GPU's graph, XLA's attention
    modules = build_models(model_classes(job["family"]), configs, jnp.bfloat16, kernels=kernels)
    calls = model_calls(modules, configs, batch=1)

    def flops(name):
        function, inputs, keywords = calls[name]
        cost = jax.jit(function).lower(param_shapes(modules[name]), *inputs, **keywords).cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    unet_flops = flops("transformer" if "transformer" in calls else "unet")
    vae_flops = flops("vae")
    scheduler = scheduler_from_config(configs["scheduler"], job["scheduler"])
    shape = calls["vae"][1][0].shape
    if hasattr(scheduler, "for_image_seq_len"):  # Flux's schedule shifts by the image's tokens
        scheduler = scheduler.for_image_seq_len((shape[-2] // 2) * (shape[-1] // 2))
    evals = int(scheduler.set_timesteps(job["steps"], shape=shape).timesteps.shape[0])
    return {"flops_per_image": evals * unet_flops + vae_flops, "unet_evals": evals,
            "unet_eval_flops": unet_flops, "vae_decode_flops": vae_flops, "program": program_size(job, size, kernels)}


def program_size(job, size, kernels):
    """The whole generate program of a speed setting (batch 1, the GPU's graph with XLA's attention), traced and
    lowered from the param shapes: the seconds of the host's part of a cold compile, and the size of the StableHLO
    module XLA then compiles."""
    import jax
    import jax.numpy as jnp

    pipeline, params = sdflax_pipeline(job["family"], size, jnp.bfloat16, scheduler=job["scheduler"], kernels=kernels,
                                       weights=False)
    side = configs_for(job["family"], size)["size"]

    def generate(params, ids, key):
        return pipeline._generate(ids, params, key, num_inference_steps=job["steps"], height=side, width=side,
                                  guidance_scale=job["guidance"])

    start = time.perf_counter()
    traced = jax.jit(generate).trace(params, pipeline.prepare_inputs([PROMPT]), jax.random.key(0))
    trace_s = time.perf_counter() - start
    text = traced.lower().as_text()
    return {"batch": 1, "trace_s": trace_s, "lower_s": time.perf_counter() - start - trace_s,
            "stablehlo_bytes": len(text.encode()), "stablehlo_lines": text.count("\n")}
