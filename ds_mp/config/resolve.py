"""The one step of loading a config that reads outside the JSON: where the model comes from.

``ds_mp.model`` may name an HF directory or a Hub id; :func:`resolve_model_source` turns a Hub id
into its cached snapshot directory (:func:`ds_mp.hub.resolve_model`: network or cache), reads the
directory's ``config.json`` and returns a copy of the config with the local directory and that
HF config — or, for a model object given to ``ds_mp.initialize``, its ``config.to_dict()``.  An
inline shape needs nothing.  :func:`ds_mp.config.validate` after it reads no file, no
environment and no network: it checks a resolved config against a world size it is given.
"""
from __future__ import annotations

import dataclasses
import json
import os

from ds_mp.config.families import FAMILIES, TRAINED, family_for
from ds_mp.config.schema import ConfigError, DsMpConfig, InlineModel

__all__ = ["resolve_model_source", "shape_of", "OBJECT"]

OBJECT = "the model object"  # where an HF config came from when initialize was given a model object


def resolve_model_source(cfg: DsMpConfig, hf_config: dict | None = None) -> DsMpConfig:
    """``cfg`` with ``model`` a local directory, ``hf_config`` its ``config.json`` (checked to be a
    family ds_mp trains, with the keys of its shape) and ``model_source`` that file's path;
    ``hf_config``: the config dict of a model object instead (``model_source`` :data:`OBJECT`).  An inline shape is returned as it is.  Raises :class:`ConfigError` naming
    ``ds_mp.model`` (an unknown Hub id, no ``config.json``, an unreadable or foreign one)."""
    if hf_config is not None:
        shape_of(hf_config, OBJECT)
        return dataclasses.replace(cfg, hf_config=dict(hf_config), model_source=OBJECT)
    if isinstance(cfg.model, InlineModel):
        return cfg
    from ds_mp.hub import HubError, resolve_model

    try:
        model = resolve_model(cfg.model, "ds_mp.model")  # a Hub id becomes its cached snapshot dir
    except HubError as e:
        raise ConfigError(str(e)) from None
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"ds_mp.model: {model!r} has no config.json; give an HF GPT-2 "
                          "directory (save_pretrained) or an inline {n_layer, n_embd, ...} object")
    try:
        with open(path) as f:
            hf = {"model_type": "gpt2", **json.load(f)}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"ds_mp.model: cannot read {path}: {e}") from None
    shape_of(hf, path)
    return dataclasses.replace(cfg, model=model, hf_config=hf, model_source=path)


def shape_of(hf: dict, where: str) -> InlineModel:
    """The model shape of an HF config dict (``config.json``, or a model object's
    ``config.to_dict()``), as its family reads it (``Family.shape``); ``where`` names it in the errors."""
    if hf.get("model_type") not in FAMILIES:
        raise ConfigError(f"ds_mp.model: {where} is a {hf.get('model_type')!r} model; ds_mp trains {TRAINED} "
                          f"(model_type {', '.join(FAMILIES)})")
    return family_for(hf["model_type"]).shape(hf, where)
