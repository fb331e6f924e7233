"""InceptionV3 as FID computes it (Szegedy et al. 2016; Heusel et al. 2017): the TensorFlow graph of
`inception-2015-12-05` as pytorch-fid's `fid_inception_v3` and torch-fidelity's `FeatureExtractorInceptionV3`
rebuild it, whose blocks differ from torchvision's (FIDInceptionA, C and E_1 average without the padded zeros,
E_2 max-pools). Module names follow their state dict (`Mixed_6b.branch7x7_2.conv.weight`), so pytorch-fid's
`pt_inception-2015-12-05-6726825d.pth` loads by the usual name table. Pixels (B, 299, 299, 3) in [-1, 1], NHWC ->
(pool3 features (B, 2048), logits (B, 1008))."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

SIZE = 299  # the side the graph was trained at; the metrics resize every picture to it
FEATURES = 2048
CLASSES = 1008  # ImageNet's 1000 and 8 unused: the TensorFlow graph's softmax


class BasicConv2d(nn.Module):
    """Convolution without bias, BatchNorm with its running statistics (eps 1e-3), ReLU."""

    features: int
    kernel: tuple = (1, 1)
    stride: int = 1
    padding: tuple = (0, 0)
    precision: jax.lax.Precision = jax.lax.Precision.HIGHEST

    @nn.compact
    def __call__(self, x):
        (ph, pw) = self.padding
        x = nn.Conv(self.features, self.kernel, self.stride, ((ph, ph), (pw, pw)), use_bias=False,
                    precision=self.precision, name="conv")(x)
        return nn.relu(BatchNorm(name="bn")(x))


class BatchNorm(nn.Module):
    """Inference BatchNorm: the statistics are parameters here, read from the checkpoint beside weight and bias."""

    eps: float = 1e-3

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,))
        bias = self.param("bias", nn.initializers.zeros, (c,))
        mean = self.param("running_mean", nn.initializers.zeros, (c,))
        var = self.param("running_var", nn.initializers.ones, (c,))
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias


def avg_pool_3x3(x):
    """TensorFlow's 3x3 average, stride 1, over the pixels inside the picture only (count_include_pad=False)."""
    return nn.avg_pool(x, (3, 3), (1, 1), ((1, 1), (1, 1)), count_include_pad=False)


def max_pool_3x3(x, stride=2, padding=0):
    return nn.max_pool(x, (3, 3), (stride, stride), ((padding, padding),) * 2)


class InceptionA(nn.Module):
    pool_features: int

    @nn.compact
    def __call__(self, x):
        b5 = BasicConv2d(64, (5, 5), padding=(2, 2), name="branch5x5_2")(BasicConv2d(48, name="branch5x5_1")(x))
        b3 = BasicConv2d(64, name="branch3x3dbl_1")(x)
        b3 = BasicConv2d(96, (3, 3), padding=(1, 1), name="branch3x3dbl_2")(b3)
        b3 = BasicConv2d(96, (3, 3), padding=(1, 1), name="branch3x3dbl_3")(b3)
        pool = BasicConv2d(self.pool_features, name="branch_pool")(avg_pool_3x3(x))
        return jnp.concatenate([BasicConv2d(64, name="branch1x1")(x), b5, b3, pool], -1)


class InceptionB(nn.Module):
    @nn.compact
    def __call__(self, x):
        b3 = BasicConv2d(384, (3, 3), stride=2, name="branch3x3")(x)
        dbl = BasicConv2d(64, name="branch3x3dbl_1")(x)
        dbl = BasicConv2d(96, (3, 3), padding=(1, 1), name="branch3x3dbl_2")(dbl)
        dbl = BasicConv2d(96, (3, 3), stride=2, name="branch3x3dbl_3")(dbl)
        return jnp.concatenate([b3, dbl, max_pool_3x3(x)], -1)


ROW, COLUMN = dict(kernel=(1, 7), padding=(0, 3)), dict(kernel=(7, 1), padding=(3, 0))  # the factored 7x7s


class InceptionC(nn.Module):
    channels_7x7: int

    @nn.compact
    def __call__(self, x):
        c7 = self.channels_7x7
        b7 = BasicConv2d(c7, name="branch7x7_1")(x)
        b7 = BasicConv2d(c7, **ROW, name="branch7x7_2")(b7)
        b7 = BasicConv2d(192, **COLUMN, name="branch7x7_3")(b7)
        dbl = BasicConv2d(c7, name="branch7x7dbl_1")(x)
        for i, (width, shape) in enumerate(((c7, COLUMN), (c7, ROW), (c7, COLUMN), (192, ROW)), start=2):
            dbl = BasicConv2d(width, **shape, name=f"branch7x7dbl_{i}")(dbl)
        pool = BasicConv2d(192, name="branch_pool")(avg_pool_3x3(x))
        return jnp.concatenate([BasicConv2d(192, name="branch1x1")(x), b7, dbl, pool], -1)


class InceptionD(nn.Module):
    @nn.compact
    def __call__(self, x):
        b3 = BasicConv2d(320, (3, 3), stride=2, name="branch3x3_2")(BasicConv2d(192, name="branch3x3_1")(x))
        b7 = BasicConv2d(192, name="branch7x7x3_1")(x)
        b7 = BasicConv2d(192, **ROW, name="branch7x7x3_2")(b7)
        b7 = BasicConv2d(192, **COLUMN, name="branch7x7x3_3")(b7)
        b7 = BasicConv2d(192, (3, 3), stride=2, name="branch7x7x3_4")(b7)
        return jnp.concatenate([b3, b7, max_pool_3x3(x)], -1)


class InceptionE(nn.Module):
    """`max_pool`: the second E block of the FID graph max-pools its pool branch (the first averages)."""

    max_pool: bool = False

    @nn.compact
    def __call__(self, x):
        def split(h, name):  # a 1x3 and a 3x1 convolution side by side
            return [BasicConv2d(384, (1, 3), padding=(0, 1), name=f"{name}a")(h),
                    BasicConv2d(384, (3, 1), padding=(1, 0), name=f"{name}b")(h)]

        b3 = split(BasicConv2d(384, name="branch3x3_1")(x), "branch3x3_2")
        dbl = BasicConv2d(448, name="branch3x3dbl_1")(x)
        dbl = split(BasicConv2d(384, (3, 3), padding=(1, 1), name="branch3x3dbl_2")(dbl), "branch3x3dbl_3")
        pooled = max_pool_3x3(x, stride=1, padding=1) if self.max_pool else avg_pool_3x3(x)
        pool = BasicConv2d(192, name="branch_pool")(pooled)
        return jnp.concatenate([BasicConv2d(320, name="branch1x1")(x), *b3, *dbl, pool], -1)


class InceptionV3(nn.Module):
    """(B, 299, 299, 3) in [-1, 1] -> (pool3 features (B, 2048), logits (B, 1008))."""

    @nn.compact
    def __call__(self, x):
        x = BasicConv2d(32, (3, 3), stride=2, name="Conv2d_1a_3x3")(x)  # (B, 149, 149, 32)
        x = BasicConv2d(32, (3, 3), name="Conv2d_2a_3x3")(x)  # (B, 147, 147, 32)
        x = max_pool_3x3(BasicConv2d(64, (3, 3), padding=(1, 1), name="Conv2d_2b_3x3")(x))  # (B, 73, 73, 64)
        x = BasicConv2d(80, name="Conv2d_3b_1x1")(x)
        x = max_pool_3x3(BasicConv2d(192, (3, 3), name="Conv2d_4a_3x3")(x))  # (B, 35, 35, 192)
        for name, pool_features in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
            x = InceptionA(pool_features, name=name)(x)  # (B, 35, 35, 288)
        x = InceptionB(name="Mixed_6a")(x)  # (B, 17, 17, 768)
        for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
            x = InceptionC(c7, name=name)(x)
        x = InceptionD(name="Mixed_7a")(x)  # (B, 8, 8, 1280)
        x = InceptionE(name="Mixed_7b")(x)
        x = InceptionE(max_pool=True, name="Mixed_7c")(x)  # (B, 8, 8, 2048)
        pool = x.mean(axis=(1, 2))
        logits = nn.Dense(CLASSES, precision=jax.lax.Precision.HIGHEST, name="fc")(pool)
        return pool, logits
