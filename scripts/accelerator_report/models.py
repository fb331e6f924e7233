"""Each family's models with random weights, in sdflax and in diffusers / transformers: the compute of the real
checkpoints, no download."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from .configs import TOKENIZER, configs_for


def random_params(module, dtype, seed=0):
    """Random params for `module`, fast for billions of them: slices of one pool of normal draws. Kernels scaled
    by 1/sqrt(fan_in) (flax's default init), norm scales 1, biases 0, embeddings unscaled. The compute of the real
    weights, not their values (the speed runs)."""
    import jax
    import numpy as np

    from sdflax.cache import param_shapes

    pool = np.random.default_rng(seed).standard_normal(1 << 22, np.float32)
    offset = [0]

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name in ("bias", "scale"):
            return jax.device_put(np.full(shape, float(name == "scale"), dtype))
        n = math.prod(shape)
        start = offset[0] % pool.size
        offset[0] += 7919  # each tensor starts elsewhere in the pool
        value = np.resize(pool[start:], n).reshape(shape)
        std = 1 / math.sqrt(math.prod(shape[:-1])) if name == "kernel" else 1.0
        return jax.device_put((value * np.float32(std)).astype(dtype))

    return jax.tree_util.tree_map_with_path(draw, param_shapes(module))


def model_classes(family) -> dict:
    """{name: sdflax class} of a family's pipeline."""
    from sdflax.models import (AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, SD3Transformer2DModel,
                               T5EncoderModel, UNet2DConditionModel)

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
    max_sequence_length), the VAE decode of `batch` latents, and each text encoder on 2·`batch` prompts (negatives
    and prompts in one call, as the pipelines encode them)."""
    import jax
    import jax.numpy as jnp

    sds = jax.ShapeDtypeStruct
    vae = modules["vae"]
    h = configs["size"] // vae.config.scale_factor
    rows = 2 * batch
    latents = sds((rows, vae.config.latent_channels, h, h), jnp.float32)
    calls = {}
    if "transformer" in modules:
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
    for name in ("text_encoder", "text_encoder_2"):  # CLIP's: the pipelines read its hidden states
        if name in modules:
            encoder = modules[name]
            calls[name] = (lambda p, ids, encoder=encoder: encoder.apply(p, ids, output_hidden_states=True),
                           (sds((rows, 77), jnp.int32),), {})
    if "text_encoder_3" in modules:  # T5's
        calls["text_encoder_3"] = (modules["text_encoder_3"].apply, (sds((rows, 256), jnp.int32),), {})
    return calls


def sdflax_pipeline(family, size, dtype, attention="auto", scheduler=None, kernels=None, weights=True):
    """(pipeline, params) of `family` with random weights, or their shapes alone (`weights=False`: params of
    jax.ShapeDtypeStruct, for tracing); `kernels` as `build_models` takes them."""
    import jax

    from sdflax import StableDiffusion, StableDiffusion3, StableDiffusionXL
    from sdflax.loading.assemble import build_models
    from sdflax.loading.folders import load_tokenizer
    from sdflax.schedulers import scheduler_from_config
    from sdflax.loading.tokenizers import T5Tokenizer

    configs = configs_for(family, size)
    modules = build_models(model_classes(family), configs, dtype, attention, kernels)
    if weights:
        params = {name: random_params(module, dtype, seed=i) for i, (name, module) in enumerate(modules.items())}
    else:
        from sdflax.cache import param_shapes

        params = {name: jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), param_shapes(module))
                  for name, module in modules.items()}
    extra = {"tokenizer_2": load_tokenizer(str(TOKENIZER), pad_token="!")} if family != "sd15" else {}
    if family == "sd35":
        from benchmark import write_t5_tokenizer  # scripts/benchmark.py's small vocabulary: the compute is T5's

        with tempfile.TemporaryDirectory() as folder:
            extra["tokenizer_3"] = T5Tokenizer.from_folder(write_t5_tokenizer(folder))
    cls = {"sd15": StableDiffusion, "sdxl": StableDiffusionXL, "sd35": StableDiffusion3}[family]
    pipeline = cls(tokenizer=load_tokenizer(str(TOKENIZER)), dtype=dtype,
                   scheduler=scheduler_from_config(configs["scheduler"], scheduler), **modules, **extra)
    return pipeline, params


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


def torch_models(family, size, device, seed=0):
    """{name: model} of `family` from diffusers / transformers, random weights drawn on `device`, float32, with
    random norm scales and biases (so that a mix-up of the two shows)."""
    import diffusers
    import torch
    import transformers

    configs = configs_for(family, size)
    clip = lambda c: transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**c))  # noqa: E731
    with torch.device(device):
        torch.manual_seed(seed)
        if family == "sd35":
            models = {"transformer": diffusers.SD3Transformer2DModel(**configs["transformer"]),
                      "vae": diffusers.AutoencoderKL(**configs["vae"]), "text_encoder": clip(configs["text_encoder"]),
                      "text_encoder_2": clip(configs["text_encoder_2"]), "text_encoder_3": transformers.T5EncoderModel(
                          transformers.T5Config(**configs["text_encoder_3"]))}
        else:
            models = {"unet": diffusers.UNet2DConditionModel(**configs["unet"]),
                      "vae": diffusers.AutoencoderKL(**configs["vae"]),
                      "text_encoder": transformers.CLIPTextModel(
                          transformers.CLIPTextConfig(**configs["text_encoder"]))}
        if family == "sdxl":
            models["text_encoder_2"] = clip(configs["text_encoder_2"])
        g = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            for model in models.values():
                for m in model.modules():
                    if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                        m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g, device=device))
                        m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g, device=device))
    return {name: model.eval() for name, model in models.items()}
