"""Small random-weight diffusers / transformers (PyTorch) models in SD 1.x and SD 2.x shapes: the test oracles."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "weights" / "tiny-sd" / "tokenizer"  # the real CLIP BPE vocabulary

SD14_SCHEDULER = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000, steps_offset=1,
    skip_prk_steps=True, set_alpha_to_one=False, clip_sample=False,
)

# SD 1.x traits (one head count for every block, a projection-free transformer, quick_gelu text encoder) at the
# smallest shape that has every kind of block: cross-attention down and up, a plain down and up block, the middle
# block; one layer each. The suite compiles this UNet in a few hundred programs, and each layer adds to every
# compile; SD 2.x's config below has three levels, SDXL's two layers a block.
SD1 = dict(
    unet=dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    ),
    vae=dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8, sample_size=32,
    ),
    text_encoder=dict(
        vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
        projection_dim=32,
    ),
)

# SD 2.x traits: per-block head counts, linear projections, upcast attention, gelu text encoder, a 3-level VAE.
# It also varies what SD never does (flip_sin_to_cos off, freq_shift 1, two transformer layers) to test the options.
SD2 = dict(
    unet=dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64, 96),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=48, attention_head_dim=(2, 4, 6), norm_num_groups=16, use_linear_projection=True,
        upcast_attention=True, flip_sin_to_cos=False, freq_shift=1, transformer_layers_per_block=2, norm_eps=1e-6,
    ),
    vae=dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32, 32), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        norm_num_groups=8, sample_size=32, scaling_factor=0.13025,
    ),
    text_encoder=dict(
        vocab_size=49408, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        max_position_embeddings=77, hidden_act="gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=0,
        projection_dim=48,
    ),
)

CONFIGS = {"sd1": SD1, "sd2": SD2}


def randomize_norms(model, seed=0):
    """Norm layers start at scale 1, bias 0; give them random values so a mix-up of the two would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return model


def torch_unet(config, seed=0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return randomize_norms(UNet2DConditionModel(**config), seed).eval()


def torch_vae(config, seed=0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return randomize_norms(AutoencoderKL(**config), seed).eval()


def torch_text_encoder(config, seed=0):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    return randomize_norms(CLIPTextModel(CLIPTextConfig(**config)), seed).eval()


BUILDERS = {"unet": torch_unet, "vae": torch_vae, "text_encoder": torch_text_encoder}


def saved(theirs, folder, cls):
    """`theirs` (a diffusers pipeline) saved to `folder` and loaded by sdflax's pipeline class `cls`:
    (theirs, pipeline, params)."""
    theirs.save_pretrained(folder)
    return (theirs, *cls.from_pretrained(folder))


def torch_pipeline(arch="sd1", scheduler="pndm", seed=0, **scheduler_config):
    """A diffusers StableDiffusionPipeline with small random models, the real tokenizer and SD 1.4's schedule;
    `scheduler` is one of sdflax's short names below or a diffusers scheduler class name."""
    import diffusers
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTokenizer

    kinds = {"pndm": diffusers.PNDMScheduler, "ddim": diffusers.DDIMScheduler, "euler": diffusers.EulerDiscreteScheduler,
             "euler_ancestral": diffusers.EulerAncestralDiscreteScheduler, "lms": diffusers.LMSDiscreteScheduler,
             "dpmpp_2m": diffusers.DPMSolverMultistepScheduler}
    config = CONFIGS[arch]
    return StableDiffusionPipeline(
        vae=torch_vae(config["vae"], seed), text_encoder=torch_text_encoder(config["text_encoder"], seed),
        tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER), unet=torch_unet(config["unet"], seed),
        scheduler=(kinds.get(scheduler) or getattr(diffusers, scheduler)).from_config(
            {**SD14_SCHEDULER, **scheduler_config}),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


# SDXL traits: no attention in the first down block, per-block transformer depths and heads, linear projections,
# `text_time` micro-conditioning, two text encoders whose penultimate states are concatenated (32 + 32 = 64),
# the second with a projection, legacy eos id 2 (pooled at the largest id, as SDXL's configs have it) and "!" as
# padding; a VAE with force_upcast.
SDXL = dict(
    unet=dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8,
        cross_attention_dim=64, norm_num_groups=8,
    ),
    vae=dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8, sample_size=32, scaling_factor=0.13025, force_upcast=True,
    ),
    text_encoder=dict(
        vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407,
        pad_token_id=49407, projection_dim=32,
    ),
    text_encoder_2=dict(
        vocab_size=49408, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="gelu", bos_token_id=0, eos_token_id=2, pad_token_id=0,
        projection_dim=32,
    ),
)

SDXL_SCHEDULER = dict(SD14_SCHEDULER, timestep_spacing="leading", interpolation_type="linear")


def torch_text_encoder_2(config, seed=0):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed + 1)  # not the first encoder's weights
    return randomize_norms(CLIPTextModelWithProjection(CLIPTextConfig(**config)), seed + 1).eval()


def torch_xl_pipeline(scheduler="euler", seed=0, force_zeros_for_empty_prompt=True, **scheduler_config):
    """A diffusers StableDiffusionXLPipeline with small random models, the real CLIP vocabulary (padded with the
    end token by the first tokenizer and with "!" by the second, as SDXL's) and SDXL's schedule."""
    import diffusers
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    kinds = {"euler": diffusers.EulerDiscreteScheduler, "ddim": diffusers.DDIMScheduler,
             "dpmpp_2m": diffusers.DPMSolverMultistepScheduler}
    return StableDiffusionXLPipeline(
        vae=torch_vae(SDXL["vae"], seed), text_encoder=torch_text_encoder(SDXL["text_encoder"], seed),
        text_encoder_2=torch_text_encoder_2(SDXL["text_encoder_2"], seed),
        tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER),
        tokenizer_2=CLIPTokenizer.from_pretrained(TOKENIZER, pad_token="!"),
        unet=torch_unet(SDXL["unet"], seed),
        scheduler=kinds[scheduler].from_config({**SDXL_SCHEDULER, **scheduler_config}),
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt, add_watermarker=False,
    )


def torch_controlnet(unet, channels=(8, 16), order="rgb", seed=0):
    """diffusers' ControlNetModel.from_unet with its zero convolutions made non-zero (random, as after training),
    so that its residuals change what the UNet computes. `channels`: conditioning_embedding_out_channels."""
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=channels,
                                    controlnet_conditioning_channel_order=order)
    g = torch.Generator().manual_seed(seed)
    zero = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zero:
            conv.weight.copy_(0.3 * torch.randn(conv.weight.shape, generator=g))
            conv.bias.copy_(0.1 * torch.randn(conv.bias.shape, generator=g))
    return net.eval()  # the norms come from the UNet's (randomized by torch_unet)


# stabilityai/stable-diffusion-xl-refiner-1.0's shape: the second text encoder alone (its 32 states are the
# cross-attention context), and five time ids (original size, crop, aesthetic score) instead of six.
SDXL_REFINER_UNET = dict(SDXL["unet"], cross_attention_dim=32, projection_class_embeddings_input_dim=32 + 5 * 8)


def torch_xl_refiner(scheduler="euler", seed=0, **scheduler_config):
    """A diffusers StableDiffusionXLImg2ImgPipeline shaped like SDXL's refiner: no first text encoder or tokenizer,
    `requires_aesthetics_score`, no zero negative embeddings; the base's VAE and second encoder (as the real
    refiner shares them), a UNet of its own."""
    from diffusers import StableDiffusionXLImg2ImgPipeline

    base = torch_xl_pipeline(scheduler, seed, **scheduler_config)
    return StableDiffusionXLImg2ImgPipeline(
        vae=base.vae, text_encoder=None, text_encoder_2=base.text_encoder_2, tokenizer=None,
        tokenizer_2=base.tokenizer_2, unet=torch_unet(SDXL_REFINER_UNET, seed + 2), scheduler=base.scheduler,
        requires_aesthetics_score=True, force_zeros_for_empty_prompt=False, add_watermarker=False,
    )


def torch_xl_inpaint_pipeline(unet_channels=9, scheduler="euler", seed=0, **scheduler_config):
    """A diffusers StableDiffusionXLInpaintPipeline on torch_xl_pipeline's models, with a 9-channel SDXL inpainting
    UNet (latents, mask, masked image latents) or the base's ordinary one."""
    from diffusers import StableDiffusionXLInpaintPipeline

    components = torch_xl_pipeline(scheduler, seed, **scheduler_config).components
    if unet_channels == 9:
        components["unet"] = torch_unet({**SDXL["unet"], "in_channels": 9}, seed + 1)
    return StableDiffusionXLInpaintPipeline(**components, add_watermarker=False)


def h94_names(kind, state_dict):
    """diffusers' names -> the original IP-Adapter's (the reverse of diffusers' converter)."""
    if kind == "base":
        return {k.replace("image_embeds", "proj"): v for k, v in state_dict.items()}
    if kind == "full":
        renames = {"ff.net.0.proj": "proj.0", "ff.net.2": "proj.2", "norm": "proj.3"}
        return {next((k.replace(a, b) for a, b in renames.items() if k.startswith(a)), k): v
                for k, v in state_dict.items()}
    renames = {"ln0": "0.norm1", "ln1": "0.norm2", "attn.to_q": "0.to_q", "attn.to_out.0": "0.to_out", "ff.0": "1.0",
               "ff.1.net.0.proj": "1.1", "ff.1.net.2": "1.3"}
    out = {}
    for key, value in state_dict.items():
        if key.startswith("layers."):
            _, n, rest = key.split(".", 2)
            if rest.startswith("attn.to_v"):
                continue
            if rest.startswith("attn.to_k"):
                out[f"layers.{n}.0.to_kv.weight"] = torch.cat([value, state_dict[key.replace("to_k", "to_v")]])
                continue
            old = next(a for a in renames if rest.startswith(a + "."))
            key = f"layers.{n}.{renames[old]}{rest[len(old):]}"
        out[key] = value
    return out


# A small CLIP vision tower (ViT-H's traits) for the IP-Adapters' image encoder.
VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, image_size=28,
              patch_size=14, projection_dim=24, hidden_act="gelu")


def h94_file(path, kind, cross_attention_dim, layer_widths, seed):
    """A random IP-Adapter in h94's layout: diffusers' image projection of `kind` under the original names
    (`image_proj.*`) and each cross-attention layer's to_k_ip / to_v_ip (`ip_adapter.{1,3,...}`, diffusers'
    attn_processors order)."""
    from diffusers.models.embeddings import (
        ImageProjection, IPAdapterFullImageProjection, IPAdapterPlusImageProjection)
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    width, hidden = cross_attention_dim, VISION["hidden_size"]
    projection = {"base": lambda: ImageProjection(VISION["projection_dim"], width, 4),
                  "full": lambda: IPAdapterFullImageProjection(hidden, width),
                  "plus": lambda: IPAdapterPlusImageProjection(embed_dims=hidden, output_dims=width, hidden_dims=64,
                                                               depth=4, heads=1, num_queries=4)}[kind]()
    projection = randomize_norms(projection, seed)
    state = {f"image_proj.{k}": v.contiguous() for k, v in h94_names(kind, projection.state_dict()).items()}
    g = torch.Generator().manual_seed(seed)
    for i, channels in enumerate(layer_widths):
        for name in ("to_k_ip", "to_v_ip"):
            state[f"ip_adapter.{2 * i + 1}.{name}.weight"] = 0.2 * torch.randn(channels, width, generator=g)
    save_file(state, str(path))


def write_ip_adapters(folder, unet, kinds: dict):
    """Random IP-Adapters for diffusers' `unet` ({kind: seed}: folder/ip-adapter_{kind}.safetensors) and their
    image encoder (folder/image_encoder), as h94's repository holds them."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(3)
    CLIPVisionModelWithProjection(CLIPVisionConfig(**VISION)).eval().save_pretrained(Path(folder) / "image_encoder")
    widths = [unet.get_submodule(name[: -len(".processor")]).to_k.out_features
              for name in unet.attn_processors if name.endswith("attn2.processor")]  # attn_processors order
    for kind, seed in kinds.items():
        h94_file(Path(folder) / f"ip-adapter_{kind}.safetensors", kind, unet.config.cross_attention_dim, widths, seed)


# A small T5 SentencePiece vocabulary (Unigram) for SD 3.5's third tokenizer.
T5_WORDS = "a the photo of cat dog on mars astronaut riding horse red blue".split()
T5_PIECES = ["<pad>", "</s>", "<unk>", "▁", *(f"▁{w}" for w in T5_WORDS), *"abcdefghijklmnopqrstuvwxyz", "ing", "er",
             ","]


# SD 3's text encoders, small: CLIP-L and CLIP-G with projections (72 pooled features), T5 of a given width.
SD3_CLIP = dict(vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407,
                pad_token_id=49407, projection_dim=32)
SD3_CLIP_G = {**SD3_CLIP, "hidden_size": 48, "intermediate_size": 64, "hidden_act": "gelu", "projection_dim": 40,
              "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}


def sd3_t5_config(width):
    return dict(vocab_size=len(T5_PIECES), d_model=width, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")


def t5_tokenizer_folder(folder):
    """tokenizer.json as transformers' SentencePiece converter writes T5's (its Precompiled normalizer aside)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(Unigram([(p, 0.0 if i < 3 else -1.0 - 0.1 * i) for i, p in enumerate(T5_PIECES)], unk_id=2))
    backend.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in T5_PIECES[:3]])
    backend.save(str(folder / "tokenizer.json"))
    return folder


def parts(pipe) -> dict:
    """An SD pipeline's text encoder, UNet, VAE, tokenizer and scheduler, as another pipeline class takes them."""
    return {name: getattr(pipe, name) for name in ("text_encoder", "unet", "vae", "tokenizer", "scheduler")}


@contextlib.contextmanager
def guided_by_batches(model, guider, num_steps):
    """diffusers' denoiser `model` (a UNet or SD 3's transformer, inside a diffusers pipeline) with its [uncond; cond]
    output replaced, at every evaluation, by diffusers' `guider`'s prediction (twice, so that the pipeline's own CFG
    at scale 2 gives it back unchanged): the loop of diffusers' modular pipelines (`set_state`, `prepare_inputs`, and
    for each batch `prepare_models`, the model's own forward on that batch's rows, `cleanup_models`; then the guider
    on the batches). The pipeline must call the model with return_dict=False."""
    forward, step = model.forward, [0]

    def guided(*args, return_dict=True, **kwargs):
        assert not return_dict
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]

        def half(x, index):  # the unconditional (0) or conditional (1) rows of the pipeline's batch
            if isinstance(x, dict):
                return {name: half(value, index) for name, value in x.items()}
            return x.chunk(2)[index] if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == rows else x

        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        guider.set_state(step=step[0], num_inference_steps=num_steps, timestep=timestep)
        step[0] += 1
        batches = guider.prepare_inputs({"half": (1, 0)})  # tuple index 0: conditional, 1: unconditional
        for batch in batches:
            guider.prepare_models(model)
            batch.noise_pred = forward(*(half(x, batch.half) for x in args), return_dict=False,
                                       **half(kwargs, batch.half))[0]
            guider.cleanup_models(model)
        pred = guider(batches).pred
        return (torch.cat([pred, pred]),)

    model.forward = guided
    try:
        yield
    finally:
        del model.forward
