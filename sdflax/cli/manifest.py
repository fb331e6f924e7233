"""`sdflax batch`'s files: the manifests (one JSON record per image written, appended and fsynced), PNGs written
whole and linked into place, and what a run finds done: records and orphan PNGs checked to be this command's,
agreed on by every process."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import time
import zlib

from .request import UserError

# What a PNG's text and a manifest record hold that does not make the pixels; every other setting (the guider and
# its arguments, the adapters, ... whatever `image_settings` records) must be the same for an image to be this
# command's. "sampler" (the scheduler as it ran) is compared, "scheduler" (the name the command gave it) is not;
# "commit" is the hub snapshot the compared "revision" resolved to; "parameters" is A1111's line of the others.
NOT_PIXELS = ("scheduler", "software", "commit", "parameters")
MANIFEST = re.compile(r"manifest(\.\d+)?\.jsonl")
# Files sdflax writes in --out are opened without following a symbolic link, which could point out of it
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def refuse_link(path):
    if os.path.islink(path):
        raise UserError(f"{path} is a symbolic link: sdflax never writes through one (it may point out of --out); "
                        "remove it, or choose another --out")


def open_for_writing(path, flags) -> int:
    """os.open of a file sdflax writes in --out, never through a symbolic link (refused in one line)."""
    refuse_link(path)
    try:
        return os.open(path, flags | NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a link since the check
            refuse_link(path)
        raise


def read_manifests(folder) -> list[dict]:
    """The records of every process's manifest; a last line cut short by a kill is not a record."""
    records = []
    for name in sorted(os.listdir(folder)):
        if not MANIFEST.fullmatch(name):
            continue
        path = os.path.join(folder, name)
        refuse_link(path)  # a run would append to what it points to
        not_ours = f"{path} is not a manifest of sdflax batch"
        advice = "sdflax never overwrites a file; move it, or choose another --out"
        if not os.path.isfile(path):
            raise UserError(f"{not_ours} (not a file): {advice}")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts = f.read().split("\n")
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror or e}): {advice}") from e
        for i, text in enumerate(texts):
            try:
                record = json.loads(text) if text.strip() else None
            except json.JSONDecodeError:
                if i == len(texts) - 1 and (text.startswith(RECORD_START) or RECORD_START.startswith(text)):
                    continue  # a record of ours cut short by a kill (Manifest drops it); anything else is not ours
                record = "not JSON"
            except (ValueError, RecursionError):  # a number of thousands of digits, nesting thousands deep
                record = "not JSON"
            if record is not None and not is_record(record):
                raise UserError(f"{not_ours} (line {i + 1}): {advice}")
            if record is not None:
                records.append(record)
    return records


def is_record(value) -> bool:
    """A record as `record` writes it, as far as a rerun reads it: the fields and their types."""
    whole = lambda x: type(x) is int  # noqa: E731 (not bool)
    return (isinstance(value, dict) and whole(value.get("line")) and isinstance(value.get("file"), str)
            and whole(value.get("seed")) and isinstance(value.get("settings"), dict)
            and whole(value.get("batch_seed", 0)))


# How every record's line begins (`record`'s first key, as json.dumps writes it): what a cut-off record looks like.
RECORD_START = '{"line": '


def record(line, base, settings, process, made) -> dict:
    """`batch_seed`: the command's S, so that a run without --seed goes on with the seed the first one drew."""
    return {"line": line.number, "file": line.name, "seed": int(settings["seed"]), "settings": settings,
            "process": process, "batch_seed": base, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(made))}


class Manifest:
    """This process's manifest: one JSON line per image, appended in one write and fsynced."""

    def __init__(self, path):
        try:
            self.fd = open_for_writing(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        except OSError as e:  # another user's, or a read-only folder
            raise UserError(f"{path}: cannot write to it ({e.strerror or e}): choose another --out") from e
        size = os.fstat(self.fd).st_size
        if size and os.pread(self.fd, 1, size - 1) != b"\n":  # a line cut short by a kill: not a record
            os.ftruncate(self.fd, os.pread(self.fd, size, 0).rfind(b"\n") + 1)

    def append(self, record):
        os.write(self.fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())
        os.fsync(self.fd)


@contextlib.contextmanager
def folder_lock(folder, out, process, command="batch"):
    """This process's lock on the folder while the run lasts (the kernel lets go when the process ends, however it
    ends): two runs on one --out would make the same images and race for their names. The lock file says who
    holds it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): unlocked
        yield
        return
    path = os.path.join(folder, f".sdflax-{command}.{process}.lock")
    try:
        fd = open_for_writing(path, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write in it ({e.strerror or e}): choose another --out") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UserError(f"--out {out} is in use by another sdflax {command} ({holder}): wait for it to finish, or "
                        "choose another --out") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # lets go


def temporary(folder, name, process):
    return os.path.join(folder, f".{name}.{process}.tmp")


def remove_own_temporaries(folder, process):
    """A kill leaves at most one half-written temporary file of this process's: not an image, removed."""
    pattern = re.compile(rf"\.\d{{6,}}-.*\.png\.{process}\.tmp")
    for name in os.listdir(folder):
        if pattern.fullmatch(name):
            os.unlink(os.path.join(folder, name))


def link_png(folder, name, image, info, process):
    """Write the PNG whole under a temporary name, then link it into place: the name never holds a partial
    image, and a file that took the name meanwhile is never replaced."""
    scratch, path = temporary(folder, name, process), os.path.join(folder, name)
    if os.path.lexists(scratch):  # a killed run's (the name is this process's), or a link planted there
        os.unlink(scratch)
    try:
        with os.fdopen(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644), "wb") as f:
            image.save(f, format="PNG", pnginfo=info)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(scratch, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links
            if os.path.lexists(path):
                raise FileExistsError(path) from None
            os.rename(scratch, path)
    finally:
        if os.path.lexists(scratch):
            os.unlink(scratch)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the name, before the manifest lists it
    finally:
        os.close(directory)


def image_key(settings) -> dict:
    """The settings that identify a line's image (all but NOT_PIXELS), as the PNG's text chunks hold them
    (`png_info`)."""
    return {name: as_text(value) for name, value in settings.items() if name not in NOT_PIXELS}


def first_difference(made: dict, wanted: dict) -> str:
    return next(name for name in (*wanted, *made) if made.get(name) != wanted.get(name))


def quoted(text):
    """A `parameters` value as A1111 writes one (its infotext `quote`): in JSON quotes where a ',', ':' or newline
    would end it early."""
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def as_text(value):
    return None if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def check_records(records, lines, keys, out, folder) -> set:
    """The lines the manifests list whose PNG is still in `folder` (one moved away is made again); a record of
    another line or other settings is another command's: refused."""
    numbers = {line.number for line in lines}
    done = set()
    for r in records:
        number = r.get("line")
        if number not in numbers:
            raise UserError(f"--out {out} holds {r.get('file')}, made for line {number}, which PROMPTS does not "
                            "have: use another --out for other prompts")
        made = image_key(r["settings"])
        if made != keys[number]:
            name = first_difference(made, keys[number])
            raise UserError(f"--out {out} holds {r['file']} of line {number} made with {name} "
                            f"{made.get(name) or 'none'}, not {keys[number].get(name) or 'none'}: use another --out "
                            "for other settings")
        if os.path.lexists(os.path.join(folder, os.path.basename(r["file"]))):
            done.add(number)
    return done


def is_orphan(folder, line, keys, out) -> bool:
    """Whether the line's file exists though no manifest lists it: an image of this command written just before
    a kill (adopted), or someone else's file, which sdflax never overwrites (refused)."""
    path = os.path.join(folder, line.name)
    if not os.path.lexists(path):
        return False
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            made = {name: value for name, value in image.text.items() if name not in NOT_PIXELS}
    except Exception:  # noqa: BLE001 (any unreadable file is not ours)
        made = None
    if made != keys[line.number]:
        raise UserError(f"--out {out}: {line.name} exists and is not this command's image of line {line.number}: "
                        "sdflax never overwrites a file; move it, or choose another --out")
    return True


def agree(lines, done, orphans, prompts, process, processes):
    """(the lines done, the orphans this process adopts): every process must plan the same batches, whether the
    processes share one folder or each has its own disk, so what each one found is gathered."""
    if processes == 1:
        return done | set(orphans), orphans
    import numpy as np
    from jax.experimental import multihost_utils

    with open(os.path.expanduser(prompts), "rb") as f:
        crc = zlib.crc32(f.read())
    numbers = [line.number for line in lines]
    mine = np.array([crc & 0x7FFFFFFF] + [2 * (n in done) + (n in orphans) for n in numbers], np.int32)
    seen = np.asarray(multihost_utils.process_allgather(mine))  # (processes, 1 + lines)
    if (seen[:, 0] != seen[0, 0]).any():
        raise UserError(f"PROMPTS {prompts} differs between the processes: give every process the same file")
    listed = (seen[:, 1:] >= 2).any(0)
    found = (seen[:, 1:] % 2).astype(bool)
    first_finder = np.where(found.any(0), found.argmax(0), -1)
    adopt = [n for n, lst, f in zip(numbers, listed, first_finder) if not lst and f == process]
    all_done = {n for n, lst, f in zip(numbers, listed, first_finder) if lst or f >= 0}
    return all_done, adopt
