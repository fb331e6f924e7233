"""Pictures -> FID's 2048-d Inception features, as pytorch-fid (default) or torch-fidelity compute them.

Both resize every picture to 299 x 299 bilinearly, without antialiasing, but not alike:
- "pytorch-fid": values in [0, 1] (uint8 / 255), torch's `F.interpolate(mode="bilinear", align_corners=False)`
  (pixel centres aligned), then 2x − 1;
- "torch-fidelity": values in [0, 255], TensorFlow 1's `resize_bilinear` (corners aligned at the top left: source
  position = out · in / out_size, as torch-fidelity's `interpolate_bilinear_2d_like_tensorflow1x`), then
  (x − 128) / 128.
The network (`sdflax.models.inception`) is compiled once per batch shape, the resize once per picture shape.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..models.inception import SIZE, InceptionV3
from .pictures import batches, pictures

PREPROCESSING = ("pytorch-fid", "torch-fidelity")


@dataclasses.dataclass(frozen=True)
class Inception:
    """The FID network's params, loaded once (`load_inception`) and passed to `inception_features` as often as
    needed."""

    params: dict
    source: str

    def __repr__(self):
        return f"Inception({self.source!r})"


def load_inception(path) -> Inception:
    """pytorch-fid's `pt_inception-2015-12-05-6726825d.pth` (torch-fidelity's weights file, or the same tensors as
    .safetensors), read without running its pickle."""
    from ..loading.files import read_checkpoint
    from ..loading.legacy_torch import read_torch_any
    from ..loading.weights import convert_state_dict

    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no Inception weights file at {name} (pytorch-fid's "
                                "pt_inception-2015-12-05-6726825d.pth)")
    tensors = read_torch_any(name) if name.lower().endswith((".pth", ".pt", ".bin")) else read_checkpoint(name)
    params = convert_state_dict(tensors, param_shapes(), jnp.float32, f"Inception weights {name}")
    return Inception(params, name)


@functools.cache
def param_shapes():
    return jax.eval_shape(lambda: InceptionV3().init(jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3))))["params"]


def resize_weights(size_in: int, size_out: int, preprocessing: str):
    """(low index, high index, weight of the high one) per output position, in float32 as the references
    compute them."""
    out = np.arange(size_out, dtype=np.float32)
    if preprocessing == "pytorch-fid":  # torch's area_pixel_compute_source_index, align_corners=False
        scale = np.float32(size_in) / np.float32(size_out)
        source = np.maximum(scale * (out + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    else:  # TensorFlow 1: source = out * in / out_size
        source = out * np.float32(size_in / size_out)
    low = source.astype(np.int64)
    return low, np.minimum(low + 1, size_in - 1), (source - low.astype(np.float32)).astype(np.float32)


def lerp_axis(x, size_out, axis, preprocessing):
    low, high, weight = resize_weights(x.shape[axis], size_out, preprocessing)
    shape = [1] * x.ndim
    shape[axis] = size_out
    a, b, w = jnp.take(x, low, axis=axis), jnp.take(x, high, axis=axis), weight.reshape(shape)
    if preprocessing == "pytorch-fid":
        return (1 - w) * a + w * b
    return a + (b - a) * w  # torch-fidelity's form


@functools.partial(jax.jit, static_argnames=("preprocessing",))
def prepare(images, preprocessing="pytorch-fid"):
    """(B, H, W, 3) uint8, or float in [0, 1] -> (B, 299, 299, 3) in the network's range."""
    if preprocessing == "pytorch-fid":
        x = images.astype(jnp.float32) / 255 if images.dtype == jnp.uint8 else images.astype(jnp.float32)
        x = lerp_axis(lerp_axis(x, SIZE, 2, preprocessing), SIZE, 1, preprocessing)  # width, then height
        return 2 * x - 1
    x = images.astype(jnp.float32) if images.dtype == jnp.uint8 else images.astype(jnp.float32) * 255
    x = lerp_axis(lerp_axis(x, SIZE, 2, preprocessing), SIZE, 1, preprocessing)
    return (x - 128) / 128


@jax.jit
def network(params, pixels):
    """(B, 299, 299, 3) -> (pool3 features (B, 2048), logits (B, 1008))."""
    return InceptionV3().apply({"params": params}, pixels)


def inception_features(images, inception, batch_size=50, preprocessing="pytorch-fid") -> np.ndarray:
    """(N, 2048) float32 pool3 features of `images` (a folder, an (N, H, W, 3) array, or a list of arrays and PIL
    images; uint8, or float in [0, 1]). `inception`: the weights file's path, or `load_inception`'s value."""
    if preprocessing not in PREPROCESSING:
        raise ValueError(f"preprocessing={preprocessing!r}: choose one of {', '.join(PREPROCESSING)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: a positive whole number")
    model = inception if isinstance(inception, Inception) else load_inception(inception)
    out = []
    for batch in batches(pictures(images), batch_size):
        groups = [[batch[0]]]  # runs of one shape and dtype: one resize program each
        for picture in batch[1:]:
            same = picture.shape == groups[-1][0].shape and picture.dtype == groups[-1][0].dtype
            groups[-1].append(picture) if same else groups.append([picture])
        pixels = jnp.concatenate([prepare(np.stack(group), preprocessing) for group in groups])
        count = len(pixels)
        if count < batch_size and out:  # the last of several batches runs at the others' shape
            pixels = jnp.pad(pixels, ((0, batch_size - count), (0, 0), (0, 0), (0, 0)))
        out.append(np.asarray(network(model.params, pixels)[0])[:count])
    if not out:
        raise ValueError("inception_features: no pictures given")
    return np.concatenate(out)
