"""`sdflax train`'s options: the training core's `TrainConfig` arguments with dashes, the run's own (data, sizes,
checkpoints, validation), read from the command line and from `--config FILE.toml` (the command line wins), and
written beside the results as `settings.toml`, which a rerun on the same --out is checked against. No JAX here."""

from __future__ import annotations

import argparse
import difflib
import json
import os

from .parse import finite, positive_int, prompt_text, seed
from .request import DEFAULT_MODEL, UserError

METHODS = ("lora", "full", "dreambooth", "textual-inversion")
# TrainConfig's choices, written out so that --help starts without JAX (the tests check they agree)
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
PREDICTION_TYPES = ("epsilon", "v_prediction")
LORA_INITS = ("default", "gaussian")
NONE = "none"  # a number option's "no value" (no clipping, no weighting), as TOML has no null
MAX_CONFIG_BYTES = 2**20
SETTINGS = "settings.toml"  # a run's, in --out
LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' name, which load_lora_weights(folder) finds
EMBEDDING_FILE = "learned_embeds.safetensors"  # diffusers' textual_inversion.py's
MODEL_FOLDER = "model"
CORE_METHOD = {"lora": "lora", "dreambooth": "lora", "full": "full", "textual-inversion": "textual_inversion"}
# Settings that change no weight: a rerun may give others
NOT_COMPARED = ("out", "progress", "cache_dir", "devices", "latent_cache", "report_to")  # "out": a moved run continues


def whole(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def number(low=None, high=None, low_open=False, high_open=False, none=False):
    """A finite number in the bounds; `none`: or "none"."""
    def parse(text):
        if none and str(text).lower() == NONE:
            return None
        value = finite(text)
        if (low is not None and (value <= low if low_open else value < low)) or \
                (high is not None and (value >= high if high_open else value > high)):
            bounds = (f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}"
                      f"{')' if high_open else ']'}")
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {value}")
        return value
    return parse


def choice(values, none=False):
    def parse(text):
        if none and text.lower() == NONE:
            return None
        if text not in values:
            raise argparse.ArgumentTypeError(f"choose one of {', '.join(values)}, got {text!r}")
        return text
    return parse


def names(text):
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("give module names separated by commas, e.g. to_q,to_k,to_v,to_out.0")
    return values


def text_or_none(text):
    return None if text.lower() == NONE else prompt_text(text)


# name -> (type, default, kind, metavar, help). kind: "value", "flag" (on/off) or "list" (repeatable). The defaults
# of the core's arguments are TrainConfig's (diffusers' scripts').
CORE = {
    "learning_rate": (number(0, low_open=True), 1e-4, "value", "LR", "AdamW's learning rate"),
    "adam_beta1": (number(0, 1, high_open=True), 0.9, "value", "B", "AdamW's beta1"),
    "adam_beta2": (number(0, 1, high_open=True), 0.999, "value", "B", "AdamW's beta2"),
    "adam_weight_decay": (number(0), 1e-2, "value", "W", "AdamW's weight decay"),
    "adam_epsilon": (number(0, low_open=True), 1e-8, "value", "EPS", "AdamW's epsilon"),
    "max_grad_norm": (number(0, low_open=True, none=True), 1.0, "value", "NORM",
                      "clip the gradients' L2 norm to NORM (none: no clipping)"),
    "lr_scheduler": (choice(LR_SCHEDULERS), "constant", "value", "NAME", ", ".join(LR_SCHEDULERS)),
    "lr_warmup_steps": (whole(0), 500, "value", "N", "warmup updates of constant_with_warmup, linear, cosine"),
    "gradient_accumulation_steps": (whole(1), 1, "value", "K", "micro-batches of --train-batch-size rows per "
                                    "update"),
    "snr_gamma": (number(0, low_open=True, none=True), None, "value", "GAMMA", "min-SNR weighting (5.0 is the "
                  "paper's; default: none)"),
    "noise_offset": (number(0), 0.0, "value", "X", "per-channel offset noise"),
    "prediction_type": (choice(PREDICTION_TYPES, none=True), None, "value", "TYPE",
                        "epsilon or v_prediction (default: the scheduler's)"),
    "mixed_precision": (choice(MIXED_PRECISIONS), "no", "value", "P", "bf16 / fp16: the models compute in half "
                        "precision, the trained weights stay float32"),
    "gradient_checkpointing": (None, False, "flag", None, "recompute the UNet's activations in the backward pass"),
    "use_ema": (None, False, "flag", None, "keep an exponential moving average of the trained weights (the result)"),
    "ema_decay": (number(0), 0.9999, "value", "D", "the EMA's decay"),
    "train_text_encoder": (None, False, "flag", None, "train the text encoder(s) too (LoRA or full)"),
    "prior_loss_weight": (number(0), 1.0, "value", "W", "DreamBooth: the class rows' weight"),
    "rank": (whole(1), 4, "value", "R", "LoRA rank"),
    "lora_alpha": (number(0, low_open=True, none=True), None, "value", "A", "LoRA alpha (default: the rank)"),
    "lora_targets": (names, ["to_q", "to_k", "to_v", "to_out.0"], "value", "M,M", "the UNet modules a LoRA adapts"),
    "text_encoder_lora_targets": (names, ["q_proj", "k_proj", "v_proj", "out_proj"], "value", "M,M",
                                  "the text encoder modules, with --train-text-encoder"),
    "init_lora_weights": (choice(LORA_INITS), "default", "value", "INIT", "PEFT's: default or gaussian"),
    "placeholder_token": (text_or_none, None, "value", "TOKEN", "textual inversion: the new token, e.g. <cat-toy>"),
    "initializer_token": (text_or_none, None, "value", "WORD", "textual inversion: the word it starts from"),
    "num_vectors": (whole(1), 1, "value", "N", "textual inversion: vectors of the new token"),
}
RUN = {
    "model": (str, DEFAULT_MODEL, "value", "ID_OR_DIR", "hub id or diffusers folder of SD 1.x, 2.x or SDXL"),
    "revision": (text_or_none, None, "value", "REV", "hub branch, tag or commit"),
    "max_train_steps": (whole(1), 1000, "value", "N", "optimizer updates"),
    "train_batch_size": (whole(1), 1, "value", "B", "rows of a micro-batch, split over the devices"),
    "resolution": (positive_int, None, "value", "PX", "the side of the square the pictures are trained at (with "
                   "--buckets: its area) (default: the model's)"),
    "seed": (seed, None, "value", "S", "the data order, the LoRA's start and every draw (default: random, saved)"),
    "checkpointing_steps": (whole(1), 500, "value", "N", "a checkpoint every N updates (and at the end or "
                            "a SIGINT)"),
    "checkpoints_total_limit": (whole(1), None, "value", "N", "keep the last N checkpoints (default: all)"),
    "validation_prompt": (prompt_text, [], "list", "TEXT", "draw it at every validation (repeat for several)"),
    "validation_steps": (whole(1), 100, "value", "N", "validate every N updates (and before the first, and at "
                         "the end)"),
    "num_validation_images": (whole(1), 1, "value", "N", "images per validation prompt (seeds S, S+1, ...)"),
    "validation_inference_steps": (whole(1), 25, "value", "N", "denoising steps of a validation image"),
    "caption_dropout": (number(0, 1), 0.0, "value", "P", "train on the empty caption with probability P"),
    "random_flip": (None, False, "flag", None, "flip a row left-right with probability 1/2"),
    "center_crop": (None, False, "flag", None, "crop at the centre (default: at a random place)"),
    "buckets": (None, False, "flag", None, "aspect-ratio buckets: each picture at the nearest of sizes of "
                "resolution's area, each update from one bucket"),
    "cache_latents": (None, False, "flag", None, "encode each picture once, on disk in OUT/cache (keyed by the "
                      "file and the settings)"),
    "cache_text_encoder_outputs": (None, False, "flag", None, "encode each caption once, on disk beside the "
                                   "latents (keyed by the caption, its token ids and the encoders' weights): for "
                                   "frozen text encoders"),
    "latent_cache": (str, None, "value", "DIR", "the caches' folder, which runs may share (default: OUT/cache)"),
    "caption_column": (prompt_text, "text", "value", "NAME", "metadata.jsonl / .csv: the caption's column"),
    "instance_prompt": (text_or_none, None, "value", "TEXT", "the caption of every picture without one "
                        "(DreamBooth: of every picture)"),
    "class_prompt": (text_or_none, None, "value", "TEXT", "DreamBooth's class prompt: prior preservation"),
    "class_data_dir": (text_or_none, None, "value", "DIR", "DreamBooth's class pictures (made there when fewer "
                       "than --num-class-images)"),
    "num_class_images": (whole(1), 100, "value", "N", "DreamBooth: class pictures to train with"),
    "output_format": (choice(("diffusers", "kohya")), "diffusers", "value", "FORMAT", "diffusers "
                      "(pytorch_lora_weights.safetensors, learned_embeds.safetensors) or kohya (A1111, ComfyUI: "
                      "OUT-NAME.safetensors)"),
    "devices": (positive_int, None, "value", "N", "local devices the batch is split over (default: all)"),
    "fsdp": (None, False, "flag", None, "shard the weights and Adam's moments over the devices too"),
    "progress": (None, True, "flag", None, "a progress bar (--no-progress: results only)"),
    "report_to": (choice(("none", "tensorboard")), "none", "value", "TOOL", "tensorboard: the scalars of log.jsonl "
                  "and the validation images as TensorBoard events in OUT/logs (needs tensorboardX)"),
    "cache_dir": (str, None, "value", "DIR", "compiled programs, reused by later runs"),
}
OPTIONS = {**CORE, **RUN}


def add_command(commands):
    t = commands.add_parser("train", help="a folder of pictures -> a LoRA, a model, an embedding; resumable",
                            description="Train on --data (pictures with captions beside them: a.png + a.txt, or a "
                            "metadata.jsonl) and write the result, checkpoints/, samples/, progress.png, log.jsonl "
                            "and loss.png in --out. Run the same command again to continue from the last checkpoint; "
                            "Ctrl-C saves one and stops.")
    t.add_argument("method", choices=METHODS, help="what to train")
    t.add_argument("--data", metavar="DIR", help="the pictures and their captions")
    t.add_argument("--out", metavar="DIR", help="where the results go (a new folder, or a run's to continue it)")
    t.add_argument("--config", metavar="FILE.toml", help="settings (the options' names, with _ or -), under the "
                   "command line's; a run's are saved as OUT/settings.toml")
    for name, (kind_type, default, kind, metavar, text) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        shown = f" (default: {show(default)})" if default not in (None, [], False, True) else ""
        if kind == "flag":
            t.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif kind == "list":
            t.add_argument(flag, type=kind_type, action="append", default=None, metavar=metavar, help=text)
        else:
            t.add_argument(flag, type=kind_type, default=None, metavar=metavar, help=text + shown)
    from .batch import add_process_flags

    add_process_flags(t)  # not settings: the same run may continue on another number of hosts


def show(value):
    return ",".join(value) if isinstance(value, list) else value


def settings_of(args) -> dict:
    """The run's settings: the command line's, then --config's, then the defaults (method, data and out too)."""
    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    from_file = read_config(args.config) if args.config else {}
    settings = {name: spec[1] for name, spec in OPTIONS.items()}
    settings.update({name: value for name, value in from_file.items() if name != "method"})
    settings.update(given)
    settings["method"] = args.method
    for name in ("data", "out"):
        value = getattr(args, name) or from_file.get(name)
        if value is None:
            raise UserError(f"give --{name} DIR (or {name} = \"DIR\" in --config)")
        settings[name] = value
    return settings


def read_config(path) -> dict:
    """A TOML file of options -> {name: value}, each checked as its flag is; a mistake is one line naming it."""
    import tomllib

    where = f"--config {path}"
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UserError(f"{where} is over 1 MiB: a settings file is a few lines")
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{where}: not TOML ({e}): write one option a line, e.g. learning_rate = 1e-4") from None
    values, known = {}, [*OPTIONS, "data", "out", "method"]
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in known:
            near = difflib.get_close_matches(name, known, 1)
            raise UserError(f"{where}: unknown option {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                            + ": the options are sdflax train's flags, e.g. learning_rate = 1e-4")
        if name == "method":
            if value not in METHODS:
                raise UserError(f"{where}: method: choose one of {', '.join(METHODS)}, got {json.dumps(value)}")
            values[name] = value  # a saved settings.toml's; the command line's METHOD decides
            continue
        values[name] = config_value(where, name, value)
    return values


def config_value(where, name, value):
    if name in ("data", "out"):
        kind_type, kind = str, "value"
    else:
        kind_type, default, kind, _, _ = OPTIONS[name]
        if default is None and isinstance(value, str) and value.lower() == NONE:
            return None
    try:
        if kind == "flag":
            if not isinstance(value, bool):
                raise argparse.ArgumentTypeError(f"expected true or false, got {json.dumps(value)}")
            return value
        if kind == "list" or name.endswith("lora_targets"):
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(item, str) for item in items):
                raise argparse.ArgumentTypeError("expected a list of strings")
            return [kind_type(item) for item in items] if kind == "list" else names(",".join(items))
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise argparse.ArgumentTypeError(f"expected a number or string, got {json.dumps(value, default=str)}")
        return kind_type(repr(value) if isinstance(value, float) else str(value))
    except argparse.ArgumentTypeError as e:
        raise UserError(f"{where}: {name}: {e}") from None


def toml_text(settings) -> str:
    """The settings as a flat TOML file (None as "none"), one option a line, read back by `read_config`."""
    lines = ["# sdflax train: the settings of this run (sdflax train METHOD --config settings.toml repeats it)"]
    for name, value in settings.items():
        lines.append(f"{name} = {toml_value(NONE if value is None else value)}")
    return "\n".join(lines) + "\n"


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def first_difference(saved, settings) -> str | None:
    """The first setting (but NOT_COMPARED) a rerun gives otherwise than the run on --out, or None."""
    for name in settings:
        if name in NOT_COMPARED:
            continue
        if saved.get(name, OPTIONS.get(name, (None, None))[1]) != settings[name]:
            return name
    return None


def result_path(settings) -> str:
    out, method = settings["out"], settings["method"]
    if method == "full":
        return os.path.join(out, MODEL_FOLDER)
    if settings["output_format"] == "kohya":  # A1111 names a LoRA, and an embedding's token, after its file
        from .output import slug

        return os.path.join(out, slug(os.path.basename(os.path.abspath(out)) or "lora") + ".safetensors")
    return os.path.join(out, EMBEDDING_FILE if method == "textual-inversion" else LORA_FILE)
