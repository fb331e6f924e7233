"""A model id or a local folder -> a folder on disk, through huggingface_hub and its cache.

Hub ids are downloaded with `snapshot_download` into the usual Hugging Face cache (`HF_HUB_CACHE`, by default
`~/.cache/huggingface/hub`), honouring `HF_HUB_OFFLINE`, `HF_TOKEN` / `hf auth login` and revisions. Every
failure a user can fix raises `ModelNotFoundError` with a one-line message saying what to change.
"""

from __future__ import annotations

import os
import re


class ModelNotFoundError(FileNotFoundError):
    """The path or hub id does not lead to a checkpoint; the message says what to change."""


_COMMIT = re.compile(r"[0-9a-f]{40}")


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name  # hub ids: "name", "org/name"


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _no_folder_either(name: str) -> str:
    # "weights/tiny-sdx" reads as a hub id; a typo in a local path should not look like a hub problem only.
    return f" (and there is no local folder {name!r})" if "/" in name else ""


def resolve_folder(path_or_repo_id, revision: str | None = None, allow_patterns=None) -> str:
    """A local folder as it is, or a hub repo downloaded (or found in the HF cache) as a snapshot folder."""
    name = str(path_or_repo_id)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        raise ModelNotFoundError(f"{name} is a file: sdflax reads diffusers-layout folders (model_index.json, unet/, "
                                 "vae/, ...), not single-file checkpoints")
    if _looks_like_path(name):
        raise ModelNotFoundError(f"{name}: no such folder (give a diffusers checkpoint folder or a hub id org/name)")
    return download(name, revision, allow_patterns)


def download(repo_id, revision=None, allow_patterns=None, local_dir=None) -> str:
    """`snapshot_download` into the HF cache (or `local_dir`), its errors turned into one-line ModelNotFoundErrors."""
    name = str(repo_id)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        # Offline, look in the cache only: asking for a commit hash would otherwise still try to list the repo.
        return snapshot_download(name, revision=revision, allow_patterns=allow_patterns, local_dir=local_dir,
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except HFValidationError as e:
        raise ModelNotFoundError(f"{name!r} is neither a folder nor a hub id (org/name)") from e
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"{name} is gated: accept its licence on huggingface.co/{name} and log in (`hf auth login` or HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"{name} has no revision {revision!r} on the hub (a branch, tag or commit)") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"{name}: no such model on the hub{_no_folder_either(name)}; if it is private, "
                                 "log in (`hf auth login` or HF_TOKEN)") from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        what = f"{name}" + (f" at revision {revision!r}" if revision else "")
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{what} is not in the Hugging Face cache ({_hub_cache()}) and HF_HUB_OFFLINE=1 forbids downloading"
                f"{_no_folder_either(name)}: run once without HF_HUB_OFFLINE to download it, or give a local folder"
            ) from e
        raise ModelNotFoundError(
            f"{what} is not in the Hugging Face cache ({_hub_cache()}) and the hub cannot be reached"
            f"{_no_folder_either(name)}: check the connection, or give a local folder"
        ) from e
    except HfHubHTTPError as e:  # 401 and other answers from the hub
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"{name}: the hub refused the download ({first_line})") from e


def snapshot_commit(folder) -> str | None:
    """The commit hash of a folder in the HF cache (`.../snapshots/<commit>`), None for other folders."""
    parent, commit = os.path.split(os.path.normpath(folder))
    return commit if os.path.basename(parent) == "snapshots" and _COMMIT.fullmatch(commit) else None
