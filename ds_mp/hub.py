"""Hugging Face Hub model ids wherever ds_mp names a model.

:func:`resolve_model` is the one place a model name becomes a local directory: an existing
path is returned unchanged; anything else that reads as a Hub id (``gpt2``,
``openai-community/gpt2-medium``, ``org/name@revision``) is resolved through
``huggingface_hub.snapshot_download`` with only the files ds_mp reads
(:data:`HUB_PATTERNS`: ``config.json``, ``*.safetensors`` + index, tokenizer files), in
huggingface_hub's own cache (``HF_HUB_CACHE`` / ``HF_HOME``, read when called) and obeying
``HF_HUB_OFFLINE``.  A name that resolves nowhere raises :class:`HubError` with one line
saying what to do.  Called from the ``ds_mp.model`` check (``ds_mp.config.checks``), ``initialize``,
the training loop (``training.init_from``), ``ds-mp convert`` and ``ds-mp eval/generate``.

This module imports nothing from ds_mp (floor 0) and huggingface_hub only when a Hub id is
actually resolved, so ``import ds_mp.config`` stays light.
"""
from __future__ import annotations

import os
import re

__all__ = ["HubError", "HUB_PATTERNS", "resolve_model", "parse_model_id", "hub_cache_dir"]

# Files a GPT-2 repository needs for ds_mp: config, safetensors weights (+ sharded index),
# generation defaults and the tokenizer.  Nothing else (no .bin / .h5 / .msgpack / onnx) is downloaded.
HUB_PATTERNS: list[str] = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                           "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                           "special_tokens_map.json", "added_tokens.json"]

# A repo id: "name" or "org/name" (letters, digits, -, _, .), optionally "@revision".
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class HubError(ValueError):
    """A model name that is neither a local path nor a resolvable Hub id; one line, with the fix."""


def parse_model_id(name: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` for a Hub id ``repo[@revision]``, None when ``name`` reads as a path
    (starts with ``.``, ``/``, ``~``, has more than one ``/``, or a backslash)."""
    repo, _, rev = name.partition("@")
    if not _REPO.match(repo) or repo.endswith((".json", ".safetensors")) or (name.count("@") and not rev):
        return None
    return repo, rev or None


def _offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> str:
    """huggingface_hub's cache directory from the environment as it is *now* (huggingface_hub reads
    it once at import): ``HF_HUB_CACHE`` > ``HUGGINGFACE_HUB_CACHE`` > ``$HF_HOME/hub`` >
    ``$XDG_CACHE_HOME/huggingface/hub`` > ``~/.cache/huggingface/hub``."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return os.path.expanduser(os.environ[key])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model(name: str, key: str = "model") -> str:
    """A local directory for the model ``name``.

    * an existing path -> ``name`` unchanged (HF dirs, ds_mp checkpoints, files);
    * a Hub id ``repo[@revision]`` -> its snapshot directory in the Hugging Face cache, fetching
      only :data:`HUB_PATTERNS` when online (``HF_HUB_OFFLINE`` unset) and nothing otherwise;
    * anything else -> ``name`` unchanged (the caller reports the missing path).

    Raises :class:`HubError` (message ``<key>: ...; <what to do>``) when the id is not cached and
    cannot be downloaded, does not exist, or its snapshot holds no ``*.safetensors`` weights.
    """
    if os.path.exists(name):
        return name
    parsed = parse_model_id(name)
    if parsed is None:
        return name
    repo, rev = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline, cache = _offline(), hub_cache_dir()
    fetch = (f"run `hf download {repo}{' --revision ' + rev if rev else ''} --include "
             + " ".join(f"'{p}'" for p in HUB_PATTERNS[:3]) + " 'tokenizer*' 'vocab.json' 'merges.txt'` "
             "where the Hub is reachable and point HF_HOME at that cache, or give a local HF directory")
    try:
        path = snapshot_download(repo, revision=rev, cache_dir=cache, allow_patterns=HUB_PATTERNS,
                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub is unreachable"
        raise HubError(f"{key}: {name!r} is not a local path and not in the Hugging Face cache {cache} "
                       f"({why}); {fetch}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{key}: {name!r} is not a local path and no Hub repository {repo!r} exists (or it is "
                       "private: `hf auth login`); check the name") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{key}: cannot fetch {name!r} from the Hugging Face Hub "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {fetch}") from None
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise HubError(f"{key}: Hub model {name!r} has no *.safetensors weights in {path}; ds_mp reads safetensors "
                       "only: convert it (`save_pretrained(..., safe_serialization=True)`) and pass the directory")
    return path
