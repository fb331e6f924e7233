from .clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTextOutput
from .unet import UNet2DConditionModel, UNetConfig
from .vae import AutoencoderKL, DiagonalGaussian, VAEConfig

__all__ = ["AutoencoderKL", "CLIPTextConfig", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTextOutput",
           "DiagonalGaussian", "UNet2DConditionModel", "UNetConfig", "VAEConfig"]
