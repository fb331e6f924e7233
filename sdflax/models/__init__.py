from .clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTextOutput
from .layers import Kernels, resolve_kernels
from .unet import UNet2DConditionModel, UNetConfig
from .vae import AutoencoderKL, DiagonalGaussian, VAEConfig

__all__ = ["AutoencoderKL", "CLIPTextConfig", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTextOutput",
           "DiagonalGaussian", "Kernels", "UNet2DConditionModel", "UNetConfig", "VAEConfig", "resolve_kernels"]
