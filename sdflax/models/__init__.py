"""The models, each a Flax (Linen) module with its config dataclass, imported on first use (sdflax/lazy.py)."""

from ..lazy import by_module, exports

MODULES = by_module({
    ".clip": ("CLIPTextConfig", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTextOutput"),
    ".clip_vision": ("CLIPVisionConfig", "CLIPVisionModelWithProjection", "CLIPVisionOutput"),
    ".controlnet": ("ControlNetConfig", "ControlNetModel"),
    ".flux": ("FluxTransformer2DModel", "FluxTransformerConfig"),
    ".inception": ("InceptionV3",),
    ".layers": ("Kernels", "resolve_kernels"),
    ".mmdit": ("SD3Transformer2DModel", "SD3TransformerConfig"),
    ".siglip": ("SiglipVisionConfig", "SiglipVisionModel", "SiglipVisionOutput"),
    ".t2i_adapter": ("T2IAdapter", "T2IAdapterConfig", "combine_adapter_states"),
    ".t5": ("T5Config", "T5EncoderModel"),
    ".unet": ("UNet2DConditionModel", "UNetConfig", "UNetEncoderConfig"),
    ".vae": ("AutoencoderKL", "DiagonalGaussian", "VAEConfig"),
})
__getattr__, __dir__ = exports(__name__, MODULES)
__all__ = sorted(MODULES)
