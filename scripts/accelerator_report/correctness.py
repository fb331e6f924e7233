"""sdflax's models against diffusers' on the device, float32 and bfloat16, and each attention kernel against
float64."""

from __future__ import annotations

import copy
import dataclasses
import math
import os

from .configs import PROMPT, TEXT_ENCODERS, configs_for
from .models import diffusers_pipeline, model_classes, pipeline_of, torch_models
from .timing import log

# Bounds of the relative L2 error. float32: the modules' test tolerance. bfloat16: ours against float32 may be
# off by at most twice diffusers' own bfloat16 error against float32, or 1e-2, whichever is larger.
FLOAT32_BOUND = 1e-4
BFLOAT16_FLOOR = 1e-2
# Flux's parity: a few steps of the whole pipeline on small models (`configs.FLUX_PARITY`), its image against
# diffusers' FluxPipeline on the same packed noise (the T5 tokens: diffusers' 512, the CPU's tiny run fewer)
FLUX_PARITY_RUN = {"full": {"size": 256, "steps": 4, "max_sequence_length": 512},
                   "tiny": {"size": 64, "steps": 2, "max_sequence_length": 32}}
FLUX_PROMPTS = [PROMPT, "a red cat"]


def compare(ours, theirs, bound):
    """The check of one output against its reference."""
    import numpy as np

    ours, theirs = (np.asarray(x, np.float64) for x in (ours, theirs))
    finite = bool(np.isfinite(ours).all())
    rel = float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30)) if finite else None
    constant = bool(np.ptp(ours) == 0) if finite else None
    return {"rel_l2": rel, "max_abs": float(np.abs(ours - theirs).max()) if finite else None, "bound": bound,
            "finite": finite, "constant": constant,
            "ok": bool(finite and not constant and rel is not None and rel <= bound)}


def correctness(job, size):
    """sdflax's models against diffusers' on this device, float32 and bfloat16 (Flux: `flux_parity`)."""
    if job["family"] == "flux":
        return flux_parity(job, size)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the device
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes
    from sdflax.models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
    from sdflax.loading.weights import convert_state_dict

    family = job["family"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    configs = configs_for(family, size)
    theirs = torch_models(family, size, device)
    classes = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
               "text_encoder_2": CLIPTextModelWithProjection}
    classes = {name: classes[name] for name in theirs}
    state = {name: {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
             for name, model in theirs.items()}

    # inputs: two rows, as classifier-free guidance runs the UNet; latents at the family's image size
    rng = np.random.default_rng(0)
    side = configs["size"] // 8
    unet_cfg = configs["unet"]
    inputs = {"sample": rng.standard_normal((2, 4, side, side), np.float32),
              "timesteps": np.asarray([500.0, 20.0], np.float32),
              "context": rng.standard_normal((2, 77, unet_cfg["cross_attention_dim"]), np.float32)}
    if family == "sdxl":
        inputs["text_embeds"] = rng.standard_normal((2, configs["text_encoder_2"]["projection_dim"]), np.float32)
        size_px = configs["size"]
        inputs["time_ids"] = np.tile(np.asarray([size_px, size_px, 0, 0, size_px, size_px], np.float32), (2, 1))
    latents = rng.standard_normal((1, 4, side, side), np.float32)
    ids = rng.integers(0, 49407, (2, 77)).astype(np.int32)
    ids[:, -1] = 49407  # an end token to pool at

    def torch_outputs(dtype):
        t = lambda x: torch.from_numpy(x).to(device, dtype)  # noqa: E731
        out = {}
        with torch.no_grad():
            models = {name: copy.deepcopy(m).to(dtype) for name, m in theirs.items()}
            extra = {}
            if family == "sdxl":
                extra = {"added_cond_kwargs": {"text_embeds": t(inputs["text_embeds"]),
                                               "time_ids": t(inputs["time_ids"])}}
            out["unet"] = models["unet"](t(inputs["sample"]), t(inputs["timesteps"]),
                                         encoder_hidden_states=t(inputs["context"]), **extra).sample
            out["vae"] = models["vae"].decode(t(latents)).sample
            for name in TEXT_ENCODERS:
                if name in models:
                    result = models[name](torch.from_numpy(ids).long().to(device), output_hidden_states=True)
                    out[name] = result.hidden_states[-2]  # what SD 2 / SDXL condition on (SD 1: the last)
                    out[name + ".last"] = result.last_hidden_state
            del models
        return {k: v.float().cpu().numpy() for k, v in out.items()}

    converted = {}  # dtype -> params

    def sdflax_outputs(dtype, attention="auto", only=None):
        modules = build_models(classes if only is None else {only: classes[only]}, configs, dtype, attention)
        params = converted.setdefault(dtype, {})
        for name in modules:
            if name not in params:
                params[name] = convert_state_dict(state[name], param_shapes(modules[name]), dtype)
        unet = modules["unet"]
        extra = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]} if family == "sdxl" else {}
        out = {"unet": jax.jit(unet.apply)(params["unet"], inputs["sample"], inputs["timesteps"], inputs["context"],
                                           **extra)}
        if "vae" in modules:
            vae = modules["vae"]
            out["vae"] = jax.jit(lambda p, z: vae.apply(p, z, method=vae.decode))(params["vae"], latents)
        for name in TEXT_ENCODERS:
            if name in modules:
                result = jax.jit(lambda p, x, m=modules[name]: m.apply(p, x, output_hidden_states=True))(
                    params[name], ids)
                out[name] = result.hidden_states[-2]
                out[name + ".last"] = result.last_hidden_state
        return {k: np.asarray(jnp.asarray(v, jnp.float32)) for k, v in out.items()}

    report = {"device": str(jax.devices()[0].device_kind), "image_size": configs["size"]}
    log(f"correctness {family}: float32 ...")
    theirs32 = torch_outputs(torch.float32)
    with jax.default_matmul_precision("highest"):
        ours32 = sdflax_outputs(jnp.float32)
    report["float32"] = {k: compare(ours32[k], theirs32[k], FLOAT32_BOUND) for k in theirs32}
    log(f"correctness {family}: bfloat16 ...")
    theirs16 = torch_outputs(torch.bfloat16)
    try:
        ours16 = sdflax_outputs(jnp.bfloat16)
    except Exception as e:  # cuDNN refusing a shape: say so, and check XLA's attention instead
        report["attention_fallback"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        ours16 = sdflax_outputs(jnp.bfloat16, attention="xla")
    checks = {}
    for k in theirs16:
        reference = compare(theirs16[k], theirs32[k], math.inf)["rel_l2"]
        bound = max(2 * reference, BFLOAT16_FLOOR) if reference is not None else BFLOAT16_FLOOR
        checks[k] = {**compare(ours16[k], theirs32[k], bound), "diffusers_rel_l2": reference,
                     "against_diffusers_bfloat16": compare(ours16[k], theirs16[k], math.inf)["rel_l2"]}
    report["bfloat16"] = checks
    log(f"correctness {family}: attention kernels ...")
    report["attention"] = attention_layers(configs, side)
    if all(row["kernel"] == "xla" for row in report["attention"]):  # `auto` is XLA's attention here: one program
        xla16 = ours16
    else:
        xla16 = sdflax_outputs(jnp.bfloat16, attention="xla", only="unet")
    # the UNet with the attention `auto` picks here (cuDNN on a GPU) and with XLA's, each against float32
    bound = checks["unet"]["bound"]
    report["unet_attention"] = {"auto": compare(ours16["unet"], theirs32["unet"], bound),
                                "xla": compare(xla16["unet"], theirs32["unet"], bound),
                                "auto_vs_xla_rel_l2": compare(ours16["unet"], xla16["unet"], math.inf)["rel_l2"]}
    return report


def flux_parity(job, size):
    """Flux.1-dev's pipeline against diffusers' FluxPipeline on small random models, float32 (matmuls at "highest",
    PyTorch's TF32 off): the images from the same packed noise and two prompts, and the transformer's one
    evaluation on the same inputs."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the device
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sdflax.cache import param_shapes
    from sdflax.families.flux_text import image_ids, pack
    from sdflax.loading.assemble import build_models
    from sdflax.loading.weights import convert_state_dict

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    run = FLUX_PARITY_RUN[size]
    side, tokens = run["size"], run["max_sequence_length"]
    configs = configs_for("flux", size, parity=True)
    theirs = torch_models("flux", size, device, parity=True)
    state = {name: {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
             for name, model in theirs.items()}
    log("correctness flux: float32 images ...")
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((len(FLUX_PROMPTS), 16, side // 8, side // 8), np.float32)
    pipe = diffusers_pipeline("flux", theirs, configs["scheduler"])
    with torch.no_grad():
        expected = pipe(FLUX_PROMPTS, height=side, width=side, num_inference_steps=run["steps"], guidance_scale=3.5,
                        max_sequence_length=tokens, latents=pipe._pack_latents(torch.from_numpy(noise).to(device),
                                                                                *noise.shape),
                        output_type="np").images
    modules = build_models(model_classes("flux"), configs, jnp.float32)
    params = {name: convert_state_dict(state[name], param_shapes(module), jnp.float32)
              for name, module in modules.items()}
    pipeline = pipeline_of("flux", modules, configs["scheduler"], jnp.float32)
    with jax.default_matmul_precision("highest"):
        images = pipeline(pipeline.prepare_inputs(FLUX_PROMPTS, max_sequence_length=tokens), params,
                          jax.random.key(0), num_inference_steps=run["steps"], height=side, width=side,
                          guidance_scale=3.5, latents=noise).images
    log("correctness flux: the transformer's one evaluation ...")
    cfg = modules["transformer"].config
    h = side // 8
    x = pack(noise)
    context = rng.standard_normal((len(noise), tokens, cfg.joint_attention_dim), np.float32)
    pooled = rng.standard_normal((len(noise), cfg.pooled_projection_dim), np.float32)
    timestep, guidance = np.asarray([0.9, 0.3], np.float32), np.asarray([3.5, 3.5], np.float32)
    ids = image_ids(h, h), np.zeros((tokens, 3), np.float32)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    with torch.no_grad():
        reference = theirs["transformer"](hidden_states=t(x), encoder_hidden_states=t(context),
                                          pooled_projections=t(pooled), timestep=t(timestep), img_ids=t(ids[0]),
                                          txt_ids=t(ids[1]), guidance=t(guidance)).sample.cpu().numpy()
    with jax.default_matmul_precision("highest"):
        ours = jax.jit(modules["transformer"].apply)(params["transformer"], x, context, pooled, timestep, *ids,
                                                     guidance)
    return {"device": str(jax.devices()[0].device_kind), "image_size": side, "steps": run["steps"],
            "max_sequence_length": tokens, "prompts": len(FLUX_PROMPTS), "image_std": float(np.std(expected)),
            "float32": {"image": compare(np.asarray(images), expected, FLOAT32_BOUND),
                        "transformer": compare(np.asarray(ours), reference, FLOAT32_BOUND)}}


def attention_shapes(configs, side):
    """(kind, query tokens, key tokens, heads, head dim) of each distinct attention of the UNet at `side` latents."""
    unet = configs["unet"]
    channels = unet["block_out_channels"]
    heads = unet["attention_head_dim"]
    heads = heads if isinstance(heads, list) else [heads] * len(channels)
    shapes = set()
    for level, (kind, c) in enumerate(zip(unet["down_block_types"], channels)):
        if kind.startswith("CrossAttn"):
            n = heads[level]  # diffusers' old naming: "attention_head_dim" is the head count
            tokens = (side >> level) ** 2
            shapes.add(("self", tokens, tokens, n, c // n))
            shapes.add(("cross", tokens, 77, n, c // n))
    tokens, n = (side >> (len(channels) - 1)) ** 2, heads[-1]  # the mid block, at the lowest resolution
    shapes |= {("self", tokens, tokens, n, channels[-1] // n), ("cross", tokens, 77, n, channels[-1] // n)}
    return sorted(shapes, key=lambda s: (-s[1], s[0]))


def attention_layers(configs, side):
    """Per attention shape at bfloat16: the kernel sdflax picks here, and XLA's and (where it runs) cuDNN's
    results against float64 attention on the same (bfloat16-rounded) inputs."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from sdflax.models.layers import dot_product_attention, resolve_kernels

    kernels = resolve_kernels()
    rng = np.random.default_rng(0)
    rows = []
    for kind, t, s, heads, head_dim in attention_shapes(configs, side):
        q = rng.standard_normal((2, t, heads, head_dim)).astype(ml_dtypes.bfloat16)
        k, v = (rng.standard_normal((2, s, heads, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(head_dim)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        reference = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v64)
        row = {"kind": kind, "query_tokens": t, "key_tokens": s, "heads": heads, "head_dim": head_dim,
               "kernel": kernels.attention_kernel(head_dim, jnp.bfloat16, t, s)}
        runs = {"xla": True, "cudnn": kernels.cudnn_runs(head_dim, jnp.bfloat16),
                "pallas": kernels.pallas_runs(t, s, jnp.bfloat16)}
        for name, here in runs.items():
            if not here:
                row[name] = None  # the kernel does not run here (another device, or shapes): sdflax takes XLA
                continue
            chosen = dataclasses.replace(kernels, attention=name)
            try:
                out = jax.jit(lambda q, k, v, c=chosen: dot_product_attention(q, k, v, kernels=c))(q, k, v)
                row[name] = compare(np.asarray(out.astype(jnp.float32)), reference, BFLOAT16_FLOOR)
            except Exception as e:  # a shape the kernel refuses: the finding itself
                row[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", "ok": False}
        rows.append(row)
    return rows
