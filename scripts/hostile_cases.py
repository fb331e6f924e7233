"""The hostile cases of issue 59, rebuilt: every reproducer its fifteen causes name (one case per distinct input) and
the classes it found well handled, each run bounded and classified clean or unclean.

    PYTHONPATH=. python scripts/hostile_cases.py [--json cases.json] [--cause 6,7] [--work DIR] [--keep]

It needs the test extras (`pip install -e '.[test]'`: torch, diffusers, transformers build the stand-ins: tiny-sd
with a random IP-Adapter and image encoder, a T2I-Adapter, a small SD 3.5 and its single file, and their broken
copies). Command-line cases run `python -m sdflax` in a subprocess each; library cases run in one worker process per
group, each case under its own deadline (a case that hangs or kills its worker is recorded, and the rest go on in a
new worker). Every process runs under `ulimit -v` (--memory-gb) in a scratch folder under --work.

Clean: exit 2 with one line on stderr and no traceback, naming the argument (command line); one ValueError or
TypeError of one line naming the argument (library); a finite, not constant image where the input is legal.
Unclean: a traceback, a hang, a crash, a silent wrong result (a constant or NaN image, a setting that ran and was
ignored), a file written outside --out or a user's file overwritten. One line per case, a summary by cause; --json
writes every case's verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "weights" / "tiny-sd"
CAUSES = {0: "well handled before", 1: "data loss", 2: "resource: IP picture size", 3: "resource: custom schedules",
          4: "hang: signal before start", 5: "resume mixes guiders", 6: "non-finite numbers", 7: "guider arguments",
          8: "non-finite weights", 9: "T5 ids", 10: "ignored settings", 11: "pixel dtypes and ranges",
          12: "IP-Adapter shapes", 13: "guider + CFG++", 14: "undecodable argv", 15: "unclear messages"}
GEN = ["--steps", "2", "--num-images", "1", "--height", "32", "--width", "32", "--no-progress", "--seed", "1"]


# --- the cases ------------------------------------------------------------------------------------------------------

@dataclass
class Cli:
    """`python -m sdflax ARGV` ({w}: the work folder, {out}: the case's own output folder). needles: the words its
    one line must hold; None: the input is legal and must make a finite PNG. before / after: set up the scratch
    folder, and return a problem (data loss) or None after the run."""
    cause: int
    name: str
    argv: list
    needles: tuple | None = ()
    before: Callable | None = None
    after: Callable | None = None
    timeout: float = 180
    stop_after: float | None = None  # send SIGTERM this many seconds after the start (a run that must stop)


@dataclass
class Api:
    """call(ctx) in a worker of `group`; needles: the words its one-line ValueError / TypeError must hold; None: a
    legal input whose images must be finite (check(ctx, images) may name what else is wrong)."""
    cause: int
    name: str
    group: str
    call: Callable
    needles: tuple | None = ()
    check: Callable | None = None
    timeout: float = 240


CASES: list = []


def cli(*args, **kwargs):
    CASES.append(Cli(*args, **kwargs))


def api(*args, **kwargs):
    CASES.append(Api(*args, **kwargs))


def kept(path, content):
    """An after-check: the user's file outside --out still holds `content`."""
    def check(w, out):
        p = Path(str(path).format(w=w, out=out))
        return None if p.exists() and p.read_bytes() == content else f"{p} was overwritten"
    return check


def symlink(link, target, content=b"the user's notes\n"):
    def make(w, out):
        t = Path(str(target).format(w=w, out=out))
        t.write_bytes(content)
        link_path = Path(str(link).format(w=w, out=out))
        link_path.parent.mkdir(parents=True, exist_ok=True)
        link_path.symlink_to(t)
    return make


# 0: the classes the issue found well handled (a regression would show here) ---------------------------------------
for kind in ("bin", "ckpt", "pth"):
    cli(0, f"malicious pickle .{kind} as --model", ["generate", "x", "--model", "{w}/evil." + kind, *GEN, "--out",
                                                    "{out}/a.png"], ("evil." + kind,),
        after=lambda w, out: "the pickle ran" if (Path(w) / "pwned").exists() else None)
cli(0, "lying safetensors header", ["generate", "x", "--model", "{w}/lying.safetensors", *GEN, "--out", "{out}/a.png"],
    ("lying.safetensors",), timeout=60)
cli(0, "foreign manifest in --out", ["batch", "{w}/prompts.txt", "--model", "{w}/tiny", "--steps", "2", "--height",
                                     "32", "--width", "32", "--no-progress", "--out", "{out}"], ("manifest",),
    before=lambda w, out: (Path(out) / "manifest.jsonl").write_text('{"who": "someone else"}\n'))
cli(0, "/dev/zero as prompts", ["batch", "/dev/zero", "--model", "{w}/tiny", "--out", "{out}"], ("/dev/zero",),
    timeout=60)
cli(0, "100,000-deep JSON prompts", ["batch", "{w}/deep.jsonl", "--model", "{w}/tiny", "--out", "{out}"],
    ("deep.jsonl",), timeout=60)
cli(0, "adapter that does not fit", ["generate", "x", "--model", "{w}/tiny", *GEN, "--ip-adapter",
                                     "{w}/wide/ip-adapter_wide.safetensors", "--ip-image", "{w}/face.png", "--out",
                                     "{out}/a.png"], ("ip-adapter",))

# 1: data loss ------------------------------------------------------------------------------------------------------
BATCH = ["batch", "{w}/prompts.txt", "--model", "{w}/tiny", "--steps", "2", "--height", "32", "--width", "32",
         "--no-progress", "--seed", "1"]
cli(1, "batch lock symlink out of --out", [*BATCH, "--out", "{out}/o"], ("lock",),
    before=symlink("{out}/o/.sdflax-batch.0.lock", "{out}/notes.txt"), after=kept("{out}/notes.txt",
                                                                                  b"the user's notes\n"))
cli(1, "batch manifest symlink out of --out", [*BATCH, "--out", "{out}/o"], ("manifest.jsonl",),
    before=symlink("{out}/o/manifest.jsonl", "{out}/notes.txt"), after=kept("{out}/notes.txt", b"the user's notes\n"))
cli(1, "batch PNG name a symlink out of --out", [*BATCH, "--out", "{out}/o"], None,
    before=symlink("{out}/o/000001-a-fox.png", "{out}/notes.txt"), after=kept("{out}/notes.txt", b"the user's notes\n"))
cli(1, "generate --out a symlink to a file", ["generate", "x", "--model", "{w}/tiny", *GEN, "--out", "{out}/l.png"],
    ("exists",), before=symlink("{out}/l.png", "{out}/notes.txt"), after=kept("{out}/notes.txt",
                                                                              b"the user's notes\n"))

# 2: an IP picture that scales up without bound ---------------------------------------------------------------------
IP = ["--ip-adapter", "{w}/tiny/models/ip-adapter_base.safetensors"]
cli(2, "--ip-image 67108864x1", ["generate", "x", "--model", "{w}/tiny", *GEN, *IP, "--ip-image", "{w}/long.png",
                                 "--out", "{out}/a.png"], ("--ip-image",))
cli(2, "--ip-image 1x67108864", ["generate", "x", "--model", "{w}/tiny", *GEN, *IP, "--ip-image", "{w}/tall.png",
                                 "--out", "{out}/a.png"], ("--ip-image",))


def long_picture(ctx, name="long.png"):
    from PIL import Image
    return Image.open(ctx.w / name)


api(2, "clip_image_inputs(67108864x1)", "none",
    lambda ctx: __import__("sdflax").clip_image_inputs(long_picture(ctx)), ("image of 67108864x1",))
api(2, "prepare_ip_adapter_image(1x67108864)", "ip",
    lambda ctx: ctx.ip()[0].prepare_ip_adapter_image(long_picture(ctx, "tall.png")), ("image of 1x67108864",))

# 3: custom schedules without a length cap --------------------------------------------------------------------------
def call(group, **kwargs):
    """A call of the group's pipeline at 2 steps and 32 px (steps from timesteps/sigmas where given)."""
    def run(ctx):
        import jax
        pipe, params, ids, extra = ctx.pipe(group)
        args = {**extra, **kwargs}
        steps = () if "timesteps" in args or "sigmas" in args else (2,)
        return pipe(*ids, params, jax.random.PRNGKey(0), *steps, height=32, width=32, **args).images
    return run


def linspace(a, b, n):
    import numpy as np
    return np.linspace(a, b, n).tolist()


api(3, "timesteps= 4000 fractional", "euler", call("euler", timesteps=linspace(999, 0.25, 4000)), ("timesteps",))
api(3, "timesteps= 1500 whole", "euler", lambda ctx: call("euler", timesteps=list(range(1499, -1, -1)))(ctx),
    ("timesteps",))
api(3, "sigmas= 4001 values", "euler", call("euler", sigmas=linspace(14.6, 0.0, 4001)), ("sigmas",))
api(3, "SD 3 sigmas= 4000 values", "sd3", call("sd3", sigmas=linspace(1.0, 0.0, 4000)), ("sigmas",))

# 4: a signal before the run starts ---------------------------------------------------------------------------------
cli(4, "batch reading a FIFO, SIGTERM", ["batch", "{out}/fifo", "--model", "{w}/tiny", "--out", "{out}/o"], None,
    before=lambda w, out: os.mkfifo(Path(out) / "fifo"), stop_after=8, timeout=60)

# 5: resume with other settings -------------------------------------------------------------------------------------
for flag, first, second in (("--guider", "cfg", "apg"), ("--guider-arg", "eta=1", "eta=0"),
                            ("--scheduler", "euler", "ddim")):
    extra = ["--guider", "apg"] if flag == "--guider-arg" else []
    cli(5, f"resume with another {flag}", [*BATCH, *extra, flag, second, "--out", "{out}/o"],
        ({"--guider-arg": "guider_args", "--scheduler": "sampler"}.get(flag, "guider"),),
        before=(lambda first, flag, extra: lambda w, out: first_run(w, out, [*extra, flag, first]))(
            first, flag, extra), timeout=300)


def first_run(w, out, args):
    argv = [a.format(w=w, out=out) for a in [*BATCH, *args, "--out", "{out}/o"]]
    subprocess.run([sys.executable, "-m", "sdflax", *argv], env=ENV, cwd=out, capture_output=True, timeout=240,
                   check=True)


# 6: non-finite numbers and pictures --------------------------------------------------------------------------------
for value in ("3e38", "nan", "-inf"):
    cli(6, f"--guidance={value}", ["generate", "x", "--model", "{w}/tiny", *GEN, f"--guidance={value}", "--out",
                                   "{out}/a.png"], ("--guidance",))
cli(6, "--adapter-scale=1e30", ["generate", "x", "--model", "{w}/tiny", *GEN, "--t2i-adapter",
                                                     "{w}/t2i", "--adapter-image", "{w}/face.png",
                                                     "--adapter-scale=1e30", "--out", "{out}/a.png"],
    ("--adapter-scale",))
cli(6, "--eta=nan", ["generate", "x", "--model", "{w}/tiny", *GEN, "--scheduler", "ddim", "--eta=nan", "--out",
                     "{out}/a.png"], ("--eta",))
cli(6, "--adapter-scale=3e38", ["generate", "x", "--model", "{w}/tiny", *GEN, "--t2i-adapter", "{w}/t2i",
                                "--adapter-image", "{w}/face.png", "--adapter-scale=3e38", "--out", "{out}/a.png"],
    ("--adapter-scale",))
cli(6, "--ip-adapter scale nan", ["generate", "x", "--model", "{w}/tiny", *GEN, "--ip-adapter",
                                  "{w}/tiny/models/ip-adapter_base.safetensors:nan", "--ip-image", "{w}/face.png",
                                  "--out", "{out}/a.png"], ("--ip-adapter",))
cli(6, "--slg-scale=inf", ["generate", "x", "--model", "{w}/sd35", *GEN, "--slg-layers", "7,8,9", "--slg-scale=inf",
                           "--out", "{out}/a.png"], ("--slg-scale",))
for name, value in (("ip_adapter_scale", float("nan")), ("ip_adapter_scale", 3e38),
                    ("ip_adapter_scale", {"up": {"block_1": [float("nan")]}})):
    api(6, f"{name}={value}", "ip", call("ip", **{name: value}), (name,))
for name, value in (("adapter_conditioning_scale", 3e38), ("adapter_conditioning_scale", float("nan")),
                    ("adapter_conditioning_factor", float("inf"))):
    api(6, f"{name}={value}", "t2i", call("t2i", **{name: value}), (name,))
for name, value in (("controlnet_conditioning_scale", float("nan")), ("control_guidance_end", float("nan"))):
    api(6, f"{name}={value}", "controlnet", call("controlnet", **{name: value}), (name,))
api(6, "skip_layer_guidance_scale=nan", "sd3", call("sd3", skip_guidance_layers=[7, 8, 9],
                                                    skip_layer_guidance_scale=float("nan")), ("skip_layer_guidance",))
api(6, "guidance_rescale=inf", "sd", call("sd", guidance_rescale=float("inf")), ("guidance_rescale",))
api(6, "sigmas=[1e300, 0]", "euler", call("euler", sigmas=[1e300, 0.0]), ("sigmas",))
api(6, "timesteps=[nan, 0]", "euler", call("euler", timesteps=[float("nan"), 0.0]), ("timesteps",))
api(6, "NaN latents", "sd", lambda ctx: call("sd", latents=ctx.np.full((1, 4, 16, 16), ctx.np.nan,
                                                                        ctx.np.float32))(ctx), ("latents",))
api(6, "NaN pixels for img2img", "img2img", lambda ctx: ctx.img2img(ctx.np.nan), ("image",))
api(6, "NaN mask for inpaint", "inpaint", lambda ctx: ctx.inpaint(mask_value=ctx.np.nan), ("mask",))
api(6, "NaN IP-Adapter pixels", "ip", lambda ctx: call("ip", ip_adapter_image=ctx.np.full(
    ctx.ip()[3].shape, ctx.np.nan, ctx.np.float32))(ctx), ("ip_adapter_image",))
api(6, "strength=nan", "img2img", lambda ctx: ctx.img2img(0.5, strength=float("nan")), ("strength",))

# 7: guider arguments -----------------------------------------------------------------------------------------------
GUIDERS = [("SmoothedEnergyGuidance", {"seg_blur_sigma": 0.0}), ("SmoothedEnergyGuidance", {"seg_blur_sigma": -5.0}),
           ("SmoothedEnergyGuidance", {"seg_guidance_scale": 3e38}),
           ("AdaptiveProjectedGuidance", {"eta": 1e38}), ("MagnitudeAwareGuidance", {"alpha": -1e30}),
           ("FrequencyDecoupledGuidance", {"guidance_scales": (1e38, 5.0)}),
           ("ClassifierFreeGuidance", {"guidance_scale": float("nan")}),
           ("AdaptiveProjectedMixGuidance", {"adaptive_projected_guidance_rescale": float("inf")}),
           ("TangentialClassifierFreeGuidance", {"guidance_scale": 3e38}),
           ("ClassifierFreeZeroStarGuidance", {"zero_init_steps": float("nan")}),
           ("PerturbedAttentionGuidance", {"perturbed_guidance_scale": float("nan")})]
for cls, kwargs in GUIDERS:
    api(7, f"{cls}({kwargs})", "none", (lambda cls, kwargs: lambda ctx: guider(cls, **kwargs))(cls, kwargs),
        (next(iter(kwargs)),))


def guider(cls, **kwargs):
    """A guider of sdflax.guiders; the perturbed ones with a layer to perturb (they refuse to be built without)."""
    from sdflax import guiders
    fqn = "mid_block.attentions.0.transformer_blocks"
    layers = {"SmoothedEnergyGuidance": {"seg_guidance_config": guiders.SmoothedEnergyGuidanceConfig([0], fqn=fqn)},
              "PerturbedAttentionGuidance": {"perturbed_guidance_config": guiders.LayerSkipConfig([0], fqn=fqn)}}
    return getattr(guiders, cls)(**layers.get(cls, {}), **kwargs)

# 8: weights with NaN or inf ----------------------------------------------------------------------------------------
cli(8, "NaN in the image encoder", ["generate", "x", "--model", "{w}/tiny", *GEN, *IP, "--ip-image", "{w}/face.png",
                                    "--ip-image-encoder", "{w}/encoder_nan", "--out", "{out}/a.png"], ("NaN",))
cli(8, "NaN in an IP-Adapter's to_k_ip", ["generate", "x", "--model", "{w}/tiny", *GEN, "--ip-adapter",
                                          "{w}/tiny/models/ip-adapter_nan.safetensors", "--ip-image", "{w}/face.png",
                                          "--out", "{out}/a.png"], ("NaN",))
cli(8, "inf in a T2I-Adapter", ["generate", "x", "--model", "{w}/tiny", *GEN, "--t2i-adapter", "{w}/t2i_nan",
                                "--adapter-image", "{w}/face.png", "--out", "{out}/a.png"], ("inf",))
cli(8, "NaN in an SD 3 single file", ["generate", "x", "--model", "{w}/sd35_nan.safetensors", "--config", "{w}/sd35",
                                      *GEN, "--out", "{out}/a.png"], ("NaN",))
cli(8, "NaN in the UNet", ["generate", "x", "--model", "{w}/tiny_nan", *GEN, "--out", "{out}/a.png"], ("NaN",))

# 9: T5 ids outside T5's vocabulary ---------------------------------------------------------------------------------
cli(9, "T5 tokenizer larger than its encoder", ["generate", "a photo of a cat", "--model", "{w}/sd35_t5small", *GEN,
                                                "--out", "{out}/a.png"], ("vocabulary",))
api(9, "T5 ids past the encoder's rows", "sd3", lambda ctx: ctx.t5_ids_past_vocabulary(), ("vocabulary",))

# 10: settings that were silently ignored ---------------------------------------------------------------------------
SD3 = ["generate", "a photo", "--model", "{w}/sd35", *GEN]
cli(10, "SD 3 'Euler Align Your Steps'", [*SD3, "--scheduler", "Euler Align Your Steps", "--out", "{out}/a.png"],
    ("Align Your Steps",))
# at 4 steps: at 2 both schedules are the same two end points
cli(10, "SD 3 'Euler KL Optimal' differs from Euler", [*SD3, "--steps", "4", "--scheduler", "Euler KL Optimal",
                                                         "--out", "{out}/a.png"], None,
    after=lambda w, out: differs(Path(out) / "a.png", [*SD3, "--steps", "4", "--scheduler", "Euler", "--out",
                                                       "{out}/b.png"], w, out))
cli(10, "--prompt-3 with --no-t5", [*SD3, "--no-t5", "--prompt-3", "a cat", "--out", "{out}/a.png"], ("--prompt-3",))
cli(10, "--negative-prompt-3 with --no-t5", [*SD3, "--no-t5", "--negative-prompt-3", "dog", "--out", "{out}/a.png"],
    ("--negative-prompt-3",))
cli(10, "--slg-layers at 2 steps (window holds none)", [*SD3, "--slg-layers", "7,8,9", "--out", "{out}/a.png"],
    ("step",))
cli(10, "--slg-scale without --slg-layers", [*SD3, "--slg-scale", "3", "--out", "{out}/a.png"], ("--slg-layers",))
for label, kwargs in (("start > stop", dict(skip_layer_guidance_start=0.5, skip_layer_guidance_stop=0.1)),
                      ("start nan", dict(skip_layer_guidance_start=float("nan"))),
                      ("stop 1.5", dict(skip_layer_guidance_stop=1.5)), ("start -0.1", dict(
                          skip_layer_guidance_start=-0.1)), ("no layers", dict(skip_guidance_layers=[])),
                      ("window holds no step at 2 steps", {})):
    layers = {} if "skip_guidance_layers" in kwargs else {"skip_guidance_layers": [7, 8, 9]}
    api(10, f"SD 3 skip-layer guidance {label}", "sd3", call("sd3", **layers, **kwargs), ("skip_",))
api(10, "ip_adapter_scale dict naming no block", "ip", call("ip", ip_adapter_scale={"up": {"block_9": [1.0]}}),
    ("block_9",))
api(10, "ip_adapter_scale dict naming a block without attention", "ip",
    call("ip", ip_adapter_scale={"down": {"block_2": [1.0]}}), ("block_2",))
for name, value in (("ip_adapter_scale", 0.5), ("ip_adapter_masks", "mask"), ("adapter_conditioning_scale", 0.5),
                    ("adapter_conditioning_factor", 0.5), ("adapter_image", "picture")):
    api(10, f"{name} without the adapter", "sd", (lambda name, value: lambda ctx: call("sd", **{name: {
        "mask": [ctx.np.ones((1, 1, 32, 32), ctx.np.float32)], "picture": ctx.np.zeros((1, 3, 32, 32),
                                                                                         ctx.np.float32)}.get(
        value, value)})(ctx))(name, value), (name,))
api(10, "guidance_scale beside a guider", "guided", call("guided", guidance_scale=3.0), ("guidance_scale",))
api(10, "guidance_rescale beside a guider", "guided", call("guided", guidance_rescale=0.7), ("guidance_rescale",))
api(10, "misspelled scheduler_config key", "none", lambda ctx: __import__("sdflax").StableDiffusion.from_pretrained(
    ctx.w / "tiny", scheduler="euler", scheduler_config={"use_karas_sigmas": True}), ("use_karas_sigmas",))
api(10, "coloured IP-Adapter mask", "sd", lambda ctx: ctx.pipe("sd")[0].prepare_ip_adapter_masks(
    [__import__("PIL.Image").Image.new("RGB", (32, 32), (255, 0, 0))], 32, 32), ("mask",))
cli(10, "--guidance beside --guider-arg guidance_scale", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guider",
                                                          "cfg", "--guider-arg", "guidance_scale=3", "--guidance",
                                                          "5", "--out", "{out}/a.png"], ("guidance",))

# 11: pixel dtypes and ranges ---------------------------------------------------------------------------------------
api(11, "ip_adapter_image as uint8", "ip", lambda ctx: call("ip", ip_adapter_image=(ctx.ip()[3] * 0).astype(
    ctx.np.uint8))(ctx), ("ip_adapter_image",))
api(11, "T2I image x255", "t2i", lambda ctx: ctx.t2i_call(scale=255.0), ("adapter_image",))
api(11, "T2I image as uint8 0..255", "t2i", lambda ctx: ctx.t2i_call(scale=255.0, dtype="uint8"),
    ("adapter_image",))
api(11, "T2IAdapter.from_pretrained(dtype=np.int32)", "none", lambda ctx: __import__("sdflax").T2IAdapter
    .from_pretrained(ctx.w / "t2i", dtype=ctx.np.int32), ("dtype",))

# 12: IP-Adapter shapes ---------------------------------------------------------------------------------------------
ROWS = ["--ip-adapter", "{w}/tiny/models/ip-adapter_rows.safetensors", "--ip-image", "{w}/face.png"]
cli(12, "generate: wrong rows in layer 3", ["generate", "x", "--model", "{w}/tiny", *GEN, *ROWS, "--out",
                                            "{out}/a.png"], ("ip_adapter.3",))
cli(12, "batch: wrong rows in layer 3", [*BATCH, *ROWS, "--out", "{out}/o"], ("ip_adapter.3",))
cli(12, "img2img: wrong rows in layer 3", ["img2img", "x", "--image", "{w}/face.png", "--model", "{w}/tiny", *GEN,
                                           *ROWS, "--out", "{out}/a.png"], ("ip_adapter.3",))
api(12, "load_ip_adapter: wrong rows in layer 3", "sd", lambda ctx: ctx.load_ip("ip-adapter_rows.safetensors"),
    ("ip_adapter.3",))
api(12, "load_ip_adapter: wrong columns in the last layer", "sd",
    lambda ctx: ctx.load_ip("ip-adapter_cols.safetensors"), ("ip_adapter.",))

# 13: guider + CFG++ ------------------------------------------------------------------------------------------------
cli(13, "generate --guider apg --scheduler 'Euler CFG++'", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guider",
                                                            "apg", "--scheduler", "Euler CFG++", "--out",
                                                            "{out}/a.png"], ("CFG++",))
cli(13, "batch --guider mag --scheduler 'Euler a CFG++'", [*BATCH, "--guider", "mag", "--scheduler", "Euler a CFG++",
                                                           "--out", "{out}/o"], ("CFG++",))

# 14: undecodable argv ----------------------------------------------------------------------------------------------
cli(14, "generate prompt with \\xff", ["generate", b"a \xff fox", "--model", "{w}/tiny", *GEN, "--out",
                                       "{out}/a.png"], None)
cli(14, "--negative-prompt with \\xff", ["generate", "x", "--negative-prompt", b"\xfe\xff", "--model", "{w}/tiny",
                                         *GEN, "--out", "{out}/a.png"], None)

# 15: messages that did not name the argument -----------------------------------------------------------------------
api(15, "ip_adapter_scale=None", "ip", call("ip", ip_adapter_scale=None), ("ip_adapter_scale",))
api(15, "ip_adapter_image='face.png'", "ip", call("ip", ip_adapter_image="face.png"), ("ip_adapter_image",))
api(15, "ip_adapter_image_embeds of the wrong width", "ip", lambda ctx: call(
    "ip", ip_adapter_image=None, ip_adapter_image_embeds=[ctx.np.zeros((2, 1, 7), ctx.np.float32)])(ctx),
    ("ip_adapter_image_embeds",))
api(15, "grey (H, W) array to prepare_ip_adapter_image", "ip", lambda ctx: ctx.ip()[0].prepare_ip_adapter_image(
    ctx.np.zeros((40, 50), ctx.np.float32)), ("(40, 50)",))
api(15, "mask of extreme aspect", "ip", lambda ctx: call("ip", ip_adapter_masks=[ctx.np.ones((1, 1, 1, 4096),
                                                                                             ctx.np.float32)])(ctx),
    ("mask",))
api(15, "pixels for an adapter without its encoder", "ip_no_encoder", call("ip_no_encoder"), ("image_encoder",))
api(15, "adapter_image missing", "t2i", lambda ctx: ctx.t2i_call(image=None), ("adapter_image",))
for name in ("text_encoder_3", "adapter", "controlnet", "vae"):
    api(15, f"{name}='none'", "none", (lambda name: lambda ctx: ctx.rebuilt(name))(name), (name,))
api(15, "APG norm_dim='x'", "none", lambda ctx: __import__("sdflax.guiders").guiders.AdaptiveProjectedGuidance(
    adaptive_projected_guidance_norm_dim="x"), ("norm_dim",))
api(15, "FDG with 8 levels on 16-wide latents", "fdg", call("fdg"), ("guidance_scales",))
api(15, "PAG hook beside a PAG guider", "pag_both", call("pag_both"), ("PerturbedAttentionGuidance",))
api(15, "APG guider beside the PAG hook (clear before)", "apg_pag", call("apg_pag"), ("guider",))
cli(15, "SD 3 single file with a wrong-shaped tensor", ["generate", "x", "--model", "{w}/sd35_shape.safetensors",
                                                         "--config", "{w}/sd35", *GEN, "--out", "{out}/a.png"],
    ("qkv",))
cli(15, "truncated zip .bin", ["generate", "x", "--model", "{w}/truncated", *GEN, "--out", "{out}/a.png"],
    ("truncated",))
cli(15, "SD 3 folder without tokenizer.json", ["generate", "x", "--model", "{w}/sd35_notok", *GEN, "--out",
                                               "{out}/a.png"], ("tokenizer.json",))
cli(15, "T5 tokenizer without </s>", ["generate", "x", "--model", "{w}/sd35_noeos", *GEN, "--out", "{out}/a.png"],
    ("</s>", "tokenizer"))
cli(15, "--guider-arg start=0.1,0.2", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guider", "cfg",
                                       "--guider-arg", "start=0.1,0.2", "--out", "{out}/a.png"], ("start",))
cli(15, "--guidance -1e6", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guidance", "-1e6", "--out",
                            "{out}/a.png"], None)
cli(15, "--guider-arg nosuch=1", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guider", "apg", "--guider-arg",
                                  "nosuch=1", "--out", "{out}/a.png"], ("nosuch",))
cli(15, "--guider-arg norm_dim=x", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guider", "apg", "--guider-arg",
                                    "norm_dim=x", "--out", "{out}/a.png"], ("norm_dim",))
cli(15, "--guider fdg with 8 levels", ["generate", "x", "--model", "{w}/tiny", *GEN, "--guider", "fdg",
                                       "--guider-arg", "guidance_scales=2,2,2,2,2,2,2,2", "--out", "{out}/a.png"],
    ("guidance_scales",))
cli(15, "--ip-image-encoder a folder that is not there", ["generate", "x", "--model", "{w}/tiny", *GEN, *IP,
                                                          "--ip-image", "{w}/face.png", "--ip-image-encoder",
                                                          "{w}/nowhere", "--out", "{out}/a.png"],
    ("--ip-image-encoder",))

IMG2IMG = ["img2img", "x", "--image", "{w}/face.png", "--model", "{w}/tiny", *GEN]
cli(15, "batch --guider-arg start=0.1,0.2", [*BATCH, "--guider", "cfg", "--guider-arg", "start=0.1,0.2", "--out",
                                             "{out}/o"], ("start",))
cli(15, "img2img --guider-arg start=0.1,0.2", [*IMG2IMG, "--guider", "cfg", "--guider-arg", "start=0.1,0.2",
                                               "--out", "{out}/a.png"], ("start",))
cli(15, "batch --guider-arg norm_dim=x", [*BATCH, "--guider", "apg", "--guider-arg", "norm_dim=x", "--out",
                                          "{out}/o"], ("norm_dim",))
cli(15, "batch --guider fdg with 8 levels", [*BATCH, "--guider", "fdg", "--guider-arg",
                                             "guidance_scales=2,2,2,2,2,2,2,2", "--out", "{out}/o"],
    ("guidance_scales",))
cli(15, "batch: SD 3 single file with a wrong-shaped tensor", ["batch", "{w}/prompts.txt", "--model",
                                                               "{w}/sd35_shape.safetensors", "--config", "{w}/sd35",
                                                               "--no-progress", "--out", "{out}/o"], ("qkv",))
cli(15, "img2img: truncated zip .bin", ["img2img", "x", "--image", "{w}/face.png", "--model", "{w}/truncated", *GEN,
                                        "--out", "{out}/a.png"], ("truncated",))
cli(15, "img2img --ip-image-encoder a folder that is not there", [*IMG2IMG, *IP, "--ip-image", "{w}/face.png",
                                                                  "--ip-image-encoder", "{w}/nowhere", "--out",
                                                                  "{out}/a.png"], ("--ip-image-encoder",))
api(15, "ip_adapter_scale='high'", "ip", call("ip", ip_adapter_scale="high"), ("ip_adapter_scale",))
api(15, "ip_adapter_image=None with an adapter", "ip", call("ip", ip_adapter_image=None), ("ip_adapter_image",))


def differs(first, argv, w, out):
    """After-check: the case's PNG differs from the one `argv` makes (the setting took effect)."""
    import numpy as np
    from PIL import Image
    argv = [a.format(w=w, out=out) for a in argv]
    subprocess.run([sys.executable, "-m", "sdflax", *argv], env=ENV, cwd=out, capture_output=True, timeout=240)
    second = Path(argv[argv.index("--out") + 1])
    if not (first.exists() and second.exists()):
        return "no PNG to compare"
    a, b = (np.asarray(Image.open(p), np.float32) for p in (first, second))
    return None if np.abs(a - b).max() > 0 else "the same pixels as plain Euler: the setting was ignored"


# --- the inputs -----------------------------------------------------------------------------------------------------

def build_inputs(w: Path):
    """Every file the cases read, made once in w (the test extras' builders)."""
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.numpy import load_file, save_file

    sys.path.insert(0, str(REPO / "tests"))
    from builders import h94_file, write_ip_adapters
    from docs_standins import sd35
    from test_t2i_adapter_pipelines import torch_adapter

    def poison(path, match, value=np.nan, rows=None):
        tensors = {k: v.copy() for k, v in load_file(path).items()}
        key = sorted(k for k in tensors if match in k)[-1]
        if rows is not None:
            tensors[key] = np.zeros((tensors[key].shape[0] + rows[0], tensors[key].shape[1] + rows[1]),
                                    tensors[key].dtype)
        else:
            tensors[key].reshape(-1)[0] = value
        save_file(tensors, path, metadata={"format": "pt"})
        return key

    from diffusers import UNet2DConditionModel
    shutil.copytree(TINY, w / "tiny")
    unet = UNet2DConditionModel.from_pretrained(TINY, subfolder="unet")
    write_ip_adapters(w / "tiny" / "models", unet, {"base": 1})
    models = w / "tiny" / "models"
    widths = [unet.get_submodule(name[: -len(".processor")]).to_k.out_features
              for name in unet.attn_processors if name.endswith("attn2.processor")]
    (w / "wide").mkdir()
    h94_file(w / "wide" / "ip-adapter_wide.safetensors", "base", 48, widths, 5)
    for name, edit in (("nan", dict(match="to_k_ip")), ("rows", dict(match="ip_adapter.3.to_k_ip", rows=(8, 0))),
                       ("cols", dict(match="to_v_ip", rows=(0, 4)))):
        shutil.copy(models / "ip-adapter_base.safetensors", models / f"ip-adapter_{name}.safetensors")
        poison(models / f"ip-adapter_{name}.safetensors", **edit)
    shutil.copytree(models / "image_encoder", w / "encoder_nan")
    poison(w / "encoder_nan" / "model.safetensors", "encoder.layers.0.mlp.fc1.weight")
    shutil.copytree(TINY, w / "tiny_nan")
    poison(next((w / "tiny_nan" / "unet").glob("*.safetensors")), "conv_in.weight")

    torch_adapter(dict(in_channels=3, channels=[32, 64, 64], num_res_blocks=1, downscale_factor=4,
                       adapter_type="full_adapter"), 1).save_pretrained(w / "t2i")
    shutil.copytree(w / "t2i", w / "t2i_nan")
    poison(next((w / "t2i_nan").glob("*.safetensors")), "conv_in.weight", np.inf)

    sd35(w / "sd35")
    from diffusers import StableDiffusion3Pipeline
    from test_sd3_single_file import to_single_file
    from safetensors.torch import save_file as save_torch
    single = to_single_file(StableDiffusion3Pipeline.from_pretrained(w / "sd35"))
    for name, key, edit in (("nan", "model.diffusion_model.joint_blocks.0.x_block.mlp.fc1.weight", "nan"),
                            ("shape", "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "shape")):
        tensors = dict(single)
        tensors[key] = tensors[key].clone()
        if edit == "nan":
            tensors[key].view(-1)[0] = float("nan")
        else:
            tensors[key] = tensors[key][:-1]
        save_torch(tensors, str(w / f"sd35_{name}.safetensors"))
    shutil.copytree(w / "sd35", w / "sd35_notok")
    (w / "sd35_notok" / "tokenizer_3" / "tokenizer.json").unlink()
    shutil.copytree(w / "sd35", w / "sd35_noeos")
    tok = json.loads((w / "sd35_noeos" / "tokenizer_3" / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok.get("added_tokens", []) if t["content"] != "</s>"]
    tok["model"]["vocab"] = [p if p[0] != "</s>" else ["<eos-gone>", p[1]] for p in tok["model"]["vocab"]]
    (w / "sd35_noeos" / "tokenizer_3" / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copytree(w / "sd35", w / "sd35_t5small")  # T5's encoder keeps 8 rows: the tokenizer's ids reach past them
    config_path = w / "sd35_t5small" / "text_encoder_3" / "config.json"
    config = json.loads(config_path.read_text())
    config["vocab_size"] = 8
    config_path.write_text(json.dumps(config))
    weights = next((w / "sd35_t5small" / "text_encoder_3").glob("*.safetensors"))
    tensors = {k: (v[:8] if ("shared" in k or "embed_tokens" in k) else v) for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(w / "face.png")
    Image.new("L", (67108864, 1)).save(w / "long.png")
    Image.new("L", (1, 67108864)).save(w / "tall.png")
    (w / "prompts.txt").write_text("a fox\n")
    (w / "deep.jsonl").write_text("[" * 100000 + "]" * 100000 + "\n")
    for kind in ("bin", "ckpt", "pth"):  # a REDUCE payload that would create w/pwned
        class Evil:
            def __reduce__(self):
                return (open, (str(w / "pwned"), "w"))
        torch.save({"state_dict": Evil()}, w / f"evil.{kind}", _use_new_zipfile_serialization=kind != "pth")
    header = json.dumps({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}).encode()
    (w / "lying.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    (w / "truncated").mkdir()
    shutil.copytree(TINY, w / "truncated", dirs_exist_ok=True)
    unet_file = next((w / "truncated" / "unet").glob("*.safetensors"))
    state = {k: torch.from_numpy(v.copy()) for k, v in load_file(unet_file).items()}
    unet_file.unlink()
    torch.save(state, w / "truncated" / "unet" / "diffusion_pytorch_model.bin")
    data = (w / "truncated" / "unet" / "diffusion_pytorch_model.bin").read_bytes()
    (w / "truncated" / "unet" / "diffusion_pytorch_model.bin").write_bytes(data[: len(data) // 2])


# --- the library worker ---------------------------------------------------------------------------------------------

class Context:
    """The pipelines a worker's cases call, loaded once on first use."""

    def __init__(self, w: Path):
        import numpy as np
        self.w, self.np, self._cache = w, np, {}

    def _once(self, name, make):
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    def ip(self):
        """(pipeline, params, ids, pixels) with tiny-sd's base IP-Adapter."""
        def make():
            from PIL import Image
            import sdflax
            pipe, params = sdflax.StableDiffusion.from_pretrained(self.w / "tiny")
            ip_pipe, ip_params = pipe.load_ip_adapter(params, self.w / "tiny", subfolder="models",
                                                      weight_name="ip-adapter_base.safetensors")
            pixels = ip_pipe.prepare_ip_adapter_image(Image.open(self.w / "face.png").convert("RGB"))
            return ip_pipe, ip_params, ip_pipe.prepare_inputs(["a fox"]), np_array(pixels)
        return self._once("ip", make)

    def pipe(self, group):
        """(pipeline, params, positional inputs, call arguments) of a group."""
        def make():
            import sdflax
            from sdflax import guiders
            if group == "ip":
                pipe, params, ids, pixels = self.ip()
                return pipe, params, (ids,), {"ip_adapter_image": pixels}
            if group == "ip_no_encoder":
                pipe, params, ids, pixels = self.ip()
                bare, bare_params = self.load_ip("ip-adapter_base.safetensors", image_encoder_folder=None)
                return bare, bare_params, (ids,), {"ip_adapter_image": pixels}
            if group == "t2i":
                module, adapter_params = sdflax.T2IAdapter.from_pretrained(self.w / "t2i")
                pipe, params = sdflax.StableDiffusionAdapter.from_pretrained(self.w / "tiny", adapter=module)
                params["adapter"] = adapter_params
                image = self.np.full((1, 3, 32, 32), 0.5, self.np.float32)
                return pipe, params, (pipe.prepare_inputs(["a fox"]), image), {}
            if group == "controlnet":
                return self.controlnet()
            if group == "sd3":
                pipe, params = sdflax.StableDiffusion3.from_pretrained(self.w / "sd35")
                return pipe, params, (pipe.prepare_inputs(["a photo"]),), {}
            pipe, params = sdflax.StableDiffusion.from_pretrained(self.w / "tiny")
            ids = pipe.prepare_inputs(["a fox"])
            if group == "euler":
                pipe = pipe.replace()
                pipe.scheduler = "euler"
            if group == "guided":
                pipe = pipe.with_guider(guiders.ClassifierFreeGuidance(5.0))
            if group == "fdg":
                pipe = pipe.with_guider(guiders.FrequencyDecoupledGuidance(guidance_scales=(2.0,) * 8))
            if group in ("pag_both", "apg_pag"):
                from sdflax.hooks.pag import perturbed_attention_guidance
                guider = guiders.AdaptiveProjectedGuidance() if group == "apg_pag" else \
                    guiders.PerturbedAttentionGuidance(perturbed_guidance_config=guiders.LayerSkipConfig(
                        [0], fqn="mid_block.attentions.0.transformer_blocks", skip_attention=False,
                        skip_attention_scores=True))
                pipe = pipe.with_guider(guider).with_hooks(perturbed_attention_guidance(3.0))
            return pipe, params, (ids,), {}
        return self._once(f"pipe-{group}", make)

    def controlnet(self):
        import sys as _sys
        _sys.path.insert(0, str(REPO / "tests"))
        import sdflax
        from builders import torch_controlnet
        from diffusers import UNet2DConditionModel
        unet = UNet2DConditionModel.from_pretrained(self.w / "tiny", subfolder="unet")
        torch_controlnet(unet, channels=(8, 16, 32)).save_pretrained(self.w / "scratch-controlnet")  # latents: 1/4
        net, net_params = sdflax.ControlNetModel.from_pretrained(self.w / "scratch-controlnet")
        pipe, params = sdflax.StableDiffusionControlNet.from_pretrained(self.w / "tiny", controlnet=net)
        params["controlnet"] = net_params
        image = self.np.full((1, 3, 32, 32), 0.5, self.np.float32)
        return pipe, params, (pipe.prepare_inputs(["a fox"]), image), {}

    def load_ip(self, weight_name, **kwargs):
        pipe, params, _, _ = self.pipe("sd")
        return pipe.load_ip_adapter(params, self.w / "tiny", subfolder="models", weight_name=weight_name, **kwargs)

    def img2img(self, value, **kwargs):
        import jax
        import sdflax
        pipe, params = self._once("img2img", lambda: sdflax.StableDiffusionImg2Img.from_pretrained(self.w / "tiny"))
        ids, images = pipe.prepare_inputs(["a fox"], self.np.zeros((1, 32, 32, 3), self.np.uint8))
        images = self.np.full(self.np.shape(images), value, self.np.float32)
        return pipe(ids, images, params, jax.random.key(0), kwargs.pop("strength", 0.5), 2, **kwargs).images

    def inpaint(self, mask_value):
        import jax
        import sdflax
        pipe, params = self._once("inpaint", lambda: sdflax.StableDiffusionInpaint.from_pretrained(self.w / "tiny"))
        picture = self.np.zeros((1, 32, 32, 3), self.np.uint8)
        ids, images, masks = pipe.prepare_inputs(["a fox"], picture, self.np.ones((1, 32, 32), self.np.uint8))
        masks = self.np.full(self.np.shape(masks), mask_value, self.np.float32)
        return pipe(ids, images, masks, params, jax.random.key(0), 2).images

    def t2i_call(self, scale=1.0, dtype="float32", image="given"):
        import jax
        pipe, params, (ids, picture), _ = self.pipe("t2i")
        picture = None if image is None else (picture * scale).astype(dtype)
        return pipe(ids, picture, params, jax.random.key(0), 2, 32, 32).images

    def rebuilt(self, name):
        import sdflax
        cls = sdflax.StableDiffusion3 if name == "text_encoder_3" else sdflax.StableDiffusion
        pipe, _, _, _ = self.pipe("sd3" if name == "text_encoder_3" else "sd")
        return cls(**{**pipe.components(), name: "none"})

    def t5_ids_past_vocabulary(self):
        import jax
        pipe, params, (ids,), _ = self.pipe("sd3")
        ids = self.np.array(ids)
        ids[0, -1] = pipe.text_encoder_3.config.vocab_size
        return pipe(ids, params, jax.random.PRNGKey(0), 2, height=32, width=32).images


def np_array(x):
    import numpy as np
    return np.asarray(x)


def verdict_of_result(images, check, ctx):
    """Clean where the images are finite and not constant (a black or NaN picture is a silent wrong result)."""
    import numpy as np
    if images is None or not hasattr(images, "shape") or np.asarray(images).dtype == object:
        return True, "returned", ""
    images = np.asarray(images, np.float32)
    if not np.isfinite(images).all():
        return False, "silent wrong: NaN or inf in the result", ""
    if images.size > 1 and images.std() == 0:
        return False, f"silent wrong: a constant picture ({images.reshape(-1)[0]})", ""
    problem = check(ctx, images) if check else None
    return (False, f"silent wrong: {problem}", "") if problem else (True, "finite result", "")


def run_api_case(case: Api, ctx):
    """(clean, verdict, detail) of one library case, in this process."""
    try:
        result = case.call(ctx)
    except (ValueError, TypeError) as error:
        message = str(error)
        if case.needles is None:
            return False, f"refused a legal input: {type(error).__name__}", message[:300]
        if "\n" in message.strip():
            return False, f"{type(error).__name__} of {message.count(chr(10)) + 1} lines", message[:300]
        missing = [n for n in case.needles if n not in message]
        if missing:
            return False, f"unclear: {type(error).__name__} without {missing}", message[:300]
        return True, f"refused: {type(error).__name__}", message[:300]
    except MemoryError as error:
        return False, "resource: MemoryError", repr(error)[:300]
    except Exception as error:  # noqa: BLE001: every other kind is what the cases look for
        return False, f"traceback: {type(error).__name__}", str(error).splitlines()[0][:300] if str(error) else ""
    if case.needles is not None and case.needles != ():
        clean, verdict, _ = verdict_of_result(result, None, ctx)
        return False, "ran: the setting was not refused" + ("" if clean else f" ({verdict})"), ""
    return verdict_of_result(result, case.check, ctx)


def worker(w: Path, names: list):
    """Runs the named library cases in order, one JSON line each on stdout."""
    import warnings
    warnings.simplefilter("ignore")
    ctx = Context(w)
    by_name = {c.name: c for c in CASES if isinstance(c, Api)}
    for name in names:
        clean, verdict, detail = run_api_case(by_name[name], ctx)
        print(json.dumps({"case": name, "clean": clean, "verdict": verdict, "detail": detail}), flush=True)


# --- running --------------------------------------------------------------------------------------------------------

ENV: dict = {}


def limits(memory_gb):
    def apply():
        os.setsid()
        limit = int(memory_gb * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def run_cli_case(case: Cli, w: Path, scratch: Path, memory_gb):
    out = scratch / f"{CASES.index(case):03d}"
    out.mkdir(parents=True)
    if case.before:
        try:
            case.before(str(w), str(out))
        except Exception as error:  # noqa: BLE001: the case cannot run
            return False, f"setup failed: {type(error).__name__}", str(error)[:300], 0.0
    argv = [a if isinstance(a, bytes) else a.format(w=w, out=out) for a in case.argv]
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "sdflax", *argv], env=ENV, cwd=out, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, preexec_fn=limits(memory_gb))
    try:
        if case.stop_after is not None:
            try:
                process.wait(case.stop_after)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGTERM)
            stdout, stderr = process.communicate(timeout=15)
        else:
            stdout, stderr = process.communicate(timeout=case.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        what = "still running 15 s after SIGTERM" if case.stop_after is not None else f"past {case.timeout:.0f} s"
        return False, f"hang: {what}", "", time.monotonic() - start
    seconds = time.monotonic() - start
    err = stderr.decode(errors="replace").strip()
    lines = [line for line in err.splitlines() if line.strip()]
    problem = case.after(str(w), str(out)) if case.after else None
    if problem:
        return False, f"data loss: {problem}" if "overwritten" in problem or "outside" in problem else \
            f"silent wrong: {problem}", err[-300:], seconds
    if "Traceback" in err:
        return False, "traceback", lines[-1][:300] if lines else "", seconds
    if case.stop_after is not None:
        return True, f"stopped by SIGTERM (exit {process.returncode})", err[-300:], seconds
    if process.returncode < 0:
        return False, f"crash: signal {-process.returncode}", err[-300:], seconds
    if case.needles is None:
        if process.returncode == 0:
            pngs = [p for p in out.rglob("*.png") if not p.is_symlink()]
            return (True, "made a PNG", "", seconds) if pngs else (False, "exit 0 without a PNG", "", seconds)
        if process.returncode == 2 and len(lines) == 1:
            return True, "refused in one line", lines[0][:300], seconds
        return False, f"exit {process.returncode}, {len(lines)} lines", err[-300:], seconds
    if process.returncode != 2:
        return False, f"exit {process.returncode} (expected a refusal)", err[-300:], seconds
    if len(lines) != 1:
        return False, f"exit 2 with {len(lines)} lines", err[-300:], seconds
    missing = [n for n in case.needles if n.lower() not in lines[0].lower()]
    if missing:
        return False, f"unclear: the line lacks {missing}", lines[0][:300], seconds
    return True, "refused in one line", lines[0][:300], seconds


def run_api_group(cases: list, w: Path, memory_gb):
    """{name: (clean, verdict, detail, seconds)} of one group's library cases, in workers (a new one after a case
    that hangs or kills its worker)."""
    results, todo = {}, [c for c in cases]
    while todo:
        process = subprocess.Popen([sys.executable, __file__, "--worker", "--work", str(w), "--cases",
                                    json.dumps([c.name for c in todo])], env=ENV, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, preexec_fn=limits(memory_gb))
        buffer = b""
        while todo:
            case, start = todo[0], time.monotonic()
            line = None
            while line is None:
                left = case.timeout - (time.monotonic() - start)
                if b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    break
                ready = select.select([process.stdout], [], [], max(left, 0))[0]
                if not ready:
                    break
                chunk = os.read(process.stdout.fileno(), 65536)
                if not chunk:
                    break
                buffer += chunk
            seconds = time.monotonic() - start
            if line is None:
                alive = process.poll() is None
                os.killpg(process.pid, signal.SIGKILL)
                stderr = process.communicate()[1].decode(errors="replace").strip().splitlines()
                verdict = f"hang: past {case.timeout:.0f} s" if alive else f"crash: worker exit {process.returncode}"
                results[case.name] = (False, verdict, stderr[-1][:300] if stderr else "", seconds)
                todo.pop(0)
                break
            record = json.loads(line)
            results[record["case"]] = (record["clean"], record["verdict"], record["detail"], seconds)
            todo.pop(0)
        else:
            process.stdout.close()
            process.kill()
            process.wait()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write every case's verdict here")
    parser.add_argument("--cause", help="only these causes, e.g. 6,7 (0: the classes well handled before)")
    parser.add_argument("--work", type=Path, help="the folder of inputs and scratch (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep --work's inputs (they are reused when kept)")
    parser.add_argument("--memory-gb", type=float, default=16, help="ulimit -v of every process (default: 16)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ENV.update({**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    if args.worker:
        return worker(args.work, json.loads(args.cases))
    causes = {int(c) for c in args.cause.split(",")} if args.cause else set(CAUSES)
    w = args.work or Path(tempfile.mkdtemp(prefix="hostile-"))
    w.mkdir(parents=True, exist_ok=True)
    ENV.setdefault("SDFLAX_CACHE_DIR", str(w / "cache"))
    started = time.monotonic()
    if not (w / "inputs.done").exists():
        print(f"building the inputs in {w} ...", flush=True)
        build_inputs(w)
        (w / "inputs.done").write_text("")
    scratch = Path(tempfile.mkdtemp(prefix="cases-", dir=w))
    chosen = [c for c in CASES if c.cause in causes]
    results = {}
    groups: dict = {}
    for case in chosen:
        if isinstance(case, Api):
            groups.setdefault(case.group, []).append(case)
    for case in chosen:
        if isinstance(case, Cli):
            results[case.name] = run_cli_case(case, w, scratch, args.memory_gb)
        elif case.group in groups:
            results.update(run_api_group(groups.pop(case.group), w, args.memory_gb))
        if case.name in results:
            clean, verdict, detail, seconds = results[case.name]
            print(f"{'clean  ' if clean else 'UNCLEAN'} {case.cause:2d} {'cli' if isinstance(case, Cli) else 'api'} "
                  f"{case.name}: {verdict} ({seconds:.1f} s){': ' + detail if detail and not clean else ''}",
                  flush=True)
    summary = {}
    for case in chosen:
        clean = results[case.name][0]
        counts = summary.setdefault(case.cause, [0, 0])
        counts[0 if clean else 1] += 1
    print(f"\n{len(chosen)} cases ({sum(isinstance(c, Cli) for c in chosen)} command line, "
          f"{sum(isinstance(c, Api) for c in chosen)} library) in {time.monotonic() - started:.0f} s: "
          f"{sum(c[0] for c in summary.values())} clean, {sum(c[1] for c in summary.values())} unclean")
    for cause in sorted(summary):
        print(f"  cause {cause:2d} {CAUSES[cause]:28s} {summary[cause][0]:3d} clean {summary[cause][1]:3d} unclean")
    if args.json:
        args.json.write_text(json.dumps([{"cause": c.cause, "case": c.name, "kind": "cli" if isinstance(c, Cli) else
                                          "api", "clean": results[c.name][0], "verdict": results[c.name][1],
                                          "detail": results[c.name][2], "seconds": round(results[c.name][3], 1)}
                                         for c in chosen], indent=1))
    if not args.keep and not args.work:
        shutil.rmtree(w, ignore_errors=True)
    return 0 if all(r[0] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
