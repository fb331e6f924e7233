"""A model id or a local folder -> a folder on disk, through huggingface_hub and its cache."""

from __future__ import annotations

import os


class ModelNotFoundError(FileNotFoundError):
    """The path or hub id does not lead to a checkpoint; the message says what to change."""


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1  # hub ids are "name" or "org/name"


def resolve_folder(path_or_repo_id, revision: str | None = None, allow_patterns=None) -> str:
    """A local folder as it is, or a hub repo downloaded (or found in the HF cache) as a snapshot folder."""
    path = os.path.expanduser(str(path_or_repo_id))
    if os.path.isdir(path):
        return path
    if _looks_like_path(str(path_or_repo_id)) or os.path.exists(path):
        raise ModelNotFoundError(f"{path_or_repo_id}: no such folder (give a diffusers checkpoint folder or a hub id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(str(path_or_repo_id), revision=revision, allow_patterns=allow_patterns)
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"{path_or_repo_id} is gated: accept its licence on the hub and log in (`hf auth login` or HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"{path_or_repo_id} has no revision {revision!r}") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"{path_or_repo_id}: no such model on the hub (or it is private: log in)") from e
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{path_or_repo_id} is not in the Hugging Face cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1): download it once while online, or give a local folder"
        ) from e
