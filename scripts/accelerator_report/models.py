"""Each family's models with random weights, in sdflax and in diffusers / transformers: the compute of the real
checkpoints, no download."""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

from .configs import TOKENIZER, configs_for


def random_params(module, dtype, seed=0):
    """Random params for `module`, fast for billions of them: slices of one pool of normal draws, and a tensor
    larger than the pool drawn on the device (FLUX.1's 17 billion weights would take minutes of the host's numpy).
    Kernels scaled by 1/sqrt(fan_in) (flax's default init), norm scales 1, biases 0, embeddings unscaled. The
    compute of the real weights, not their values (the speed runs)."""
    import jax
    import numpy as np

    from sdflax.cache import param_shapes

    pool = np.random.default_rng(seed).standard_normal(POOL, np.float32)
    offset = [0]
    key = jax.random.key(seed)

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name in ("bias", "scale"):
            return jax.device_put(np.full(shape, float(name == "scale"), dtype))
        n = math.prod(shape)
        start = offset[0] % pool.size
        offset[0] += 7919  # each tensor starts elsewhere in the pool
        std = 1 / math.sqrt(math.prod(shape[:-1])) if name == "kernel" else 1.0
        if n > pool.size:
            return device_normal()(jax.random.fold_in(key, offset[0]), np.float32(std), tuple(shape),
                                    np.dtype(dtype))
        value = np.resize(pool[start:], n).reshape(shape)
        return jax.device_put((value * np.float32(std)).astype(dtype))

    return jax.tree_util.tree_map_with_path(draw, param_shapes(module))


POOL = 1 << 22  # normal draws shared by the tensors that fit


@functools.cache
def device_normal():
    """(key, std, shape, dtype) -> std · N(0, 1) of `shape` in `dtype`, drawn on the device: one program per shape
    and dtype."""
    import jax

    return jax.jit(lambda key, std, shape, dtype: (jax.random.normal(key, shape) * std).astype(dtype),
                   static_argnums=(2, 3))


def model_classes(family) -> dict:
    """{name: sdflax class} of a family's pipeline."""
    from sdflax.models import (AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, SD3Transformer2DModel,
                               T5EncoderModel, UNet2DConditionModel)
    from sdflax.models.flux import FluxTransformer2DModel

    if family == "flux":
        return {"transformer": FluxTransformer2DModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
                "text_encoder_2": T5EncoderModel}
    if family == "sd35":
        return {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL,
                "text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
                "text_encoder_3": T5EncoderModel}
    classes = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    if family == "sdxl":
        classes["text_encoder_2"] = CLIPTextModelWithProjection
    return classes


def model_calls(modules, configs, batch) -> dict:
    """The models of a setting's program, each as {name: (function of its params and inputs, input shapes, keyword
    input shapes)}: the denoiser's one evaluation (the sampling loop's body) on the guidance batch of 2·`batch` rows
    (SD 3.5's transformer under "transformer", its text states CLIP's 77 tokens and T5's 256, diffusers'
    max_sequence_length; FLUX.1-dev's on `batch` rows, its guidance an input, over 2x2-packed latent tokens and T5's
    512), the VAE decode of `batch` latents, and each text encoder on 2·`batch` prompts (negatives and prompts in
    one call, as the pipelines encode them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdflax.families.flux_text import MAX_SEQUENCE_LENGTH, image_ids
    from sdflax.models.flux import FluxTransformer2DModel

    sds = jax.ShapeDtypeStruct
    vae = modules["vae"]
    h = configs["size"] // vae.config.scale_factor
    rows = 2 * batch
    latents = sds((rows, vae.config.latent_channels, h, h), jnp.float32)
    calls = {}
    flux = isinstance(modules.get("transformer"), FluxTransformer2DModel)
    if flux:  # the position ids are the program's constants, as `FluxDenoiser` gives them
        model, cfg = modules["transformer"], modules["transformer"].config
        ids = image_ids(h, h), np.zeros((MAX_SEQUENCE_LENGTH, 3), np.float32)
        calls["transformer"] = (
            lambda p, x, context, pooled, t, guidance=None: model.apply(p, x, context, pooled, t, *ids, guidance),
            (sds((batch, (h // 2) ** 2, cfg.in_channels), jnp.float32),
             sds((batch, MAX_SEQUENCE_LENGTH, cfg.joint_attention_dim), jnp.bfloat16),
             sds((batch, cfg.pooled_projection_dim), jnp.bfloat16), sds((batch,), jnp.float32)),
            {"guidance": sds((batch,), jnp.float32)} if cfg.guidance_embeds else {})
    elif "transformer" in modules:
        cfg = modules["transformer"].config
        calls["transformer"] = (modules["transformer"].apply, (
            latents, sds((rows, 77 + 256, cfg.joint_attention_dim), jnp.bfloat16),
            sds((rows, cfg.pooled_projection_dim), jnp.bfloat16), sds((), jnp.float32)), {})
    else:
        unet = modules["unet"]
        extra = {}
        if unet.config.addition_embed_type == "text_time":
            pooled = modules["text_encoder_2"].config.projection_dim
            n_ids = (unet.config.projection_class_embeddings_input_dim - pooled) // \
                unet.config.addition_time_embed_dim
            extra = {"text_embeds": sds((rows, pooled), jnp.float32), "time_ids": sds((rows, n_ids), jnp.float32)}
        calls["unet"] = (unet.apply, (latents, sds((), jnp.float32),
                                      sds((rows, 77, unet.config.cross_attention_dim), jnp.bfloat16)), extra)
    calls["vae"] = (lambda p, z: vae.apply(p, z, method=vae.decode),
                    (sds((batch, *latents.shape[1:]), jnp.float32),), {})
    clips = ("text_encoder",) if flux else ("text_encoder", "text_encoder_2")
    for name in clips:  # CLIP's: the pipelines read its hidden states (Flux: its pooled output)
        if name in modules:
            encoder = modules[name]
            calls[name] = (lambda p, ids, encoder=encoder: encoder.apply(p, ids, output_hidden_states=True),
                           (sds((rows, 77), jnp.int32),), {})
    t5 = "text_encoder_2" if flux else "text_encoder_3"
    if t5 in modules:  # T5's
        calls[t5] = (modules[t5].apply, (sds((rows, MAX_SEQUENCE_LENGTH if flux else 256), jnp.int32),), {})
    return calls


def sdflax_pipeline(family, size, dtype, attention="auto", scheduler=None, kernels=None, weights=True):
    """(pipeline, params) of `family` with random weights, or their shapes alone (`weights=False`: params of
    jax.ShapeDtypeStruct, for tracing); `kernels` as `build_models` takes them."""
    import jax

    from sdflax.loading.assemble import build_models

    configs = configs_for(family, size)
    modules = build_models(model_classes(family), configs, dtype, attention, kernels)
    if weights:
        params = {name: random_params(module, dtype, seed=i) for i, (name, module) in enumerate(modules.items())}
    else:
        from sdflax.cache import param_shapes

        params = {name: jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), param_shapes(module))
                  for name, module in modules.items()}
    return pipeline_of(family, modules, configs["scheduler"], dtype, scheduler), params


def pipeline_of(family, modules, scheduler_config, dtype, scheduler=None):
    """sdflax's pipeline of `family` on `modules`, with the report's tokenizers: the real CLIP vocabulary, and a
    small T5 one (the compute is T5's, whatever the words)."""
    from sdflax import Flux, StableDiffusion, StableDiffusion3, StableDiffusionXL
    from sdflax.loading.folders import load_tokenizer
    from sdflax.loading.tokenizers import T5Tokenizer
    from sdflax.schedulers import scheduler_from_config

    extra = {"tokenizer_2": load_tokenizer(str(TOKENIZER), pad_token="!")} if family in ("sdxl", "sd35") else {}
    if family in ("sd35", "flux"):
        from benchmark import write_t5_tokenizer  # scripts/benchmark.py's small vocabulary

        with tempfile.TemporaryDirectory() as folder:
            extra["tokenizer_3" if family == "sd35" else "tokenizer_2"] = T5Tokenizer.from_folder(
                write_t5_tokenizer(folder))
    cls = {"sd15": StableDiffusion, "sdxl": StableDiffusionXL, "sd35": StableDiffusion3, "flux": Flux}[family]
    return cls(tokenizer=load_tokenizer(str(TOKENIZER)), dtype=dtype,
               scheduler=scheduler_from_config(scheduler_config, scheduler), **modules, **extra)


def diffusers_pipeline(family, models, scheduler_config, scheduler=None):
    """diffusers' pipeline of `family` on `models` (`torch_models`'), with the same tokenizers as `pipeline_of`'s;
    `scheduler` "euler" for diffusers' EulerDiscreteScheduler, else the config's."""
    import diffusers
    import transformers

    tokenizer = transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER))
    scheduler_class = diffusers.EulerDiscreteScheduler if scheduler == "euler" else \
        getattr(diffusers, scheduler_config["_class_name"])
    scheduler = scheduler_class.from_config(scheduler_config)
    if family in ("sd35", "flux"):
        from benchmark import write_t5_tokenizer

        with tempfile.TemporaryDirectory() as folder:  # T5's tokenizer
            t5 = transformers.T5TokenizerFast(tokenizer_file=str(Path(write_t5_tokenizer(folder)) / "tokenizer.json"))
        if family == "flux":
            pipe = diffusers.FluxPipeline(tokenizer=tokenizer, tokenizer_2=t5, scheduler=scheduler, **models)
        else:
            pipe = diffusers.StableDiffusion3Pipeline(
                tokenizer_2=transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER), pad_token="!"),
                tokenizer=tokenizer, tokenizer_3=t5, scheduler=scheduler, **models)
    elif family == "sdxl":
        pipe = diffusers.StableDiffusionXLPipeline(
            tokenizer_2=transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER), pad_token="!"), tokenizer=tokenizer,
            scheduler=scheduler, add_watermarker=False, **models)
    else:
        pipe = diffusers.StableDiffusionPipeline(tokenizer=tokenizer, scheduler=scheduler, safety_checker=None,
                                                 feature_extractor=None, requires_safety_checker=False, **models)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_checkpoint(job, size):
    """SD 1.5's architecture with random weights (`torch_models`), saved in float32 by diffusers' own
    `save_pretrained` into `job["folder"]`, as the hub's files are: what the cold and warm jobs load, so that their
    `ready_s` counts a user's load from disk."""
    import diffusers
    import torch
    import transformers

    if job["family"] != "sd15":
        raise ValueError(f"checkpoints are written for sd15 only, not {job['family']}")
    models = torch_models("sd15", size, "cuda" if torch.cuda.is_available() else "cpu")
    scheduler = configs_for("sd15", size)["scheduler"]
    pipe = diffusers.StableDiffusionPipeline(
        tokenizer=transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER)), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
        scheduler=getattr(diffusers, scheduler["_class_name"]).from_config(scheduler), **models)
    pipe.save_pretrained(job["folder"])
    return {"bytes": sum(f.stat().st_size for f in Path(job["folder"]).rglob("*.safetensors"))}


def torch_models(family, size, device, seed=0, dtype=None, parity=False):
    """{name: model} of `family` from diffusers / transformers, random weights drawn on `device` in float32 (then
    cast to `dtype`, one model at a time: FLUX.1-dev's transformer alone is 48 GB in float32), with random norm
    scales and biases (so that a mix-up of the two shows); `parity`: `configs_for`'s smaller parity models."""
    import diffusers
    import torch
    import transformers

    configs = configs_for(family, size, parity)
    clip = lambda c: transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**c))  # noqa: E731
    clip_text = lambda c: transformers.CLIPTextModel(transformers.CLIPTextConfig(**c))  # noqa: E731
    t5 = lambda c: transformers.T5EncoderModel(transformers.T5Config(**c))  # noqa: E731
    if family == "flux":
        builders = {"transformer": lambda c: diffusers.FluxTransformer2DModel(**c),
                    "vae": lambda c: diffusers.AutoencoderKL(**c), "text_encoder": clip_text, "text_encoder_2": t5}
    elif family == "sd35":
        builders = {"transformer": lambda c: diffusers.SD3Transformer2DModel(**c),
                    "vae": lambda c: diffusers.AutoencoderKL(**c), "text_encoder": clip, "text_encoder_2": clip,
                    "text_encoder_3": t5}
    else:
        builders = {"unet": lambda c: diffusers.UNet2DConditionModel(**c),
                    "vae": lambda c: diffusers.AutoencoderKL(**c), "text_encoder": clip_text}
        if family == "sdxl":
            builders["text_encoder_2"] = clip
    models = {}
    with torch.device(device):
        torch.manual_seed(seed)
        g = torch.Generator(device).manual_seed(seed)
        for name, build in builders.items():
            model = build(configs[name])
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                        m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g, device=device))
                        m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g, device=device))
                    elif type(m).__name__ == "RMSNorm" and getattr(m, "weight", None) is not None:  # Flux's qk norms
                        m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g, device=device))
            models[name] = (model if dtype in (None, torch.float32) else model.to(dtype)).eval()
    return models
