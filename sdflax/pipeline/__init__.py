"""The pipeline layer: the values a call is made of (`types`), the pieces (`text`, `sd3_text`, `denoisers`,
`starts`, `controlnet`, `t2i_adapter`, `ip_adapter`, `vae`), the one computation (`generate`), its checks, its
programs (`runner`), and how a family's rows become its public classes (`table`)."""

from .core import Pipeline, StableDiffusionOutput
from .generate import generate
from .types import Inputs, Settings, Spec, random_draws
