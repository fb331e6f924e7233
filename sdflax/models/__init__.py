from .clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTextOutput
from .clip_vision import CLIPVisionConfig, CLIPVisionModelWithProjection, CLIPVisionOutput
from .controlnet import ControlNetConfig, ControlNetModel
from .flux import FluxTransformer2DModel, FluxTransformerConfig
from .inception import InceptionV3
from .layers import Kernels, resolve_kernels
from .mmdit import SD3Transformer2DModel, SD3TransformerConfig
from .siglip import SiglipVisionConfig, SiglipVisionModel, SiglipVisionOutput
from .t2i_adapter import T2IAdapter, T2IAdapterConfig, combine_adapter_states
from .t5 import T5Config, T5EncoderModel
from .unet import UNet2DConditionModel, UNetConfig, UNetEncoderConfig
from .vae import AutoencoderKL, DiagonalGaussian, VAEConfig

__all__ = ["AutoencoderKL", "CLIPTextConfig", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTextOutput",
           "CLIPVisionConfig", "CLIPVisionModelWithProjection", "CLIPVisionOutput", "ControlNetConfig",
           "ControlNetModel", "DiagonalGaussian", "FluxTransformer2DModel", "FluxTransformerConfig",
           "InceptionV3", "Kernels", "SD3Transformer2DModel", "SD3TransformerConfig", "SiglipVisionConfig",
           "SiglipVisionModel", "SiglipVisionOutput",
           "T2IAdapter", "T2IAdapterConfig", "T5Config", "T5EncoderModel", "UNet2DConditionModel", "UNetConfig",
           "UNetEncoderConfig", "VAEConfig", "combine_adapter_states", "resolve_kernels"]
