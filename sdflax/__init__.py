from .models import AutoencoderKL, CLIPTextModel, UNet2DConditionModel
