"""What config validation asks a model family: it reads its own HF ``config.json`` (the shape's
keys, dropouts, a multimodal checkpoint's nested text config, an inline shape's keys) and answers
the checks it needs, each a one-line :class:`~ds_mp.config.ConfigError`, so ``ds_mp/config/``
names no family's keys (``config/resolve.py`` and ``config/checks.py`` reach the family through
``ds_mp.config.families.family_for``).  :class:`~ds_mp.models.family.Family` inherits it."""
from __future__ import annotations

from typing import Any

from ds_mp.config.schema import ConfigError, InlineModel

#: config.json keys of (n_layer, n_embd, n_head, vocab_size, n_positions) in HF's modern configs
HF_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")


class FamilyConfig:
    """A family's reading of its ``config.json`` and its config checks (defaults: HF's modern key names)."""

    #: config.json keys of the shape's n_layer, n_embd, n_head, vocab_size, n_positions (in the text config)
    shape_keys: tuple[str, ...] = HF_SHAPE_KEYS

    def text_config(self, raw: dict) -> dict:
        """The config.json dict of the decoder ds_mp trains (a multimodal checkpoint: its text model's)."""
        return raw

    def shape(self, raw: dict, where: str) -> InlineModel:
        """The model shape of a config.json dict (or a model object's ``config.to_dict()``); ``where``
        names it in the one-line :class:`ConfigError` for a key it lacks."""
        hf = self.text_config(raw)
        missing = [k for k in self.shape_keys if k not in hf]
        if missing:
            raise ConfigError(f"ds_mp.model: {where} lacks {', '.join(missing)}; it is not a {raw['model_type']} "
                              "config.json (give a directory written by save_pretrained)")
        return InlineModel(*(hf[k] for k in self.shape_keys), dropout=self.shape_dropout(hf),
                           model_type=raw["model_type"])

    def shape_dropout(self, hf: dict) -> float:
        """The dropout an inline shape of this config would carry (``InlineModel.dropout``)."""
        return float(hf.get("attention_dropout") or 0.0)

    def inline_hf(self, shape: InlineModel) -> dict:
        """The config.json dict of an inline shape (what the family checks read; {}: none, GPT-2)."""
        return {}

    def check_inline(self, shape: InlineModel) -> None:
        """Refuse (:class:`ConfigError`, naming ``ds_mp.model.<key>``) an inline shape's fields the family lacks."""

    def check_shape(self, shape: InlineModel, hf: dict) -> None:
        """The shape's head split: ``n_embd`` a multiple of ``n_head`` unless ``config.json`` names a ``head_dim``."""
        if not hf.get("head_dim") and shape.n_embd % shape.n_head:
            raise ConfigError(f"ds_mp.model.n_embd: {shape.n_embd} is not divisible by "
                              f"n_head={shape.n_head}; pick n_embd a multiple of n_head")

    def check_run(self, cfg: Any) -> None:
        """The family's checks of a validated run (``cfg``: a ``DsMpConfig`` with ``hf_config`` read):
        :meth:`check` of its HF config (options the layers do not build), each a one-line
        :class:`ConfigError`."""
        if cfg.hf_config:
            try:
                self.check(self.config_from_dict(self.text_config(cfg.hf_config)))
            except ConfigError:
                raise
            except ValueError as e:
                raise ConfigError(f"ds_mp.model: {e}") from None

    def cost_shape(self, cfg: Any) -> dict:
        """What one layer's cost depends on in ``cfg`` (the ``"partition": "cost"`` cache key's shape):
        by default every config entry but the ones naming where it came from."""
        skip = ("_name_or_path", "transformers_version", "architectures", "num_hidden_layers")
        return {k: v for k, v in cfg.to_dict().items() if k not in skip}

    def config_from_dict(self, raw: dict) -> Any:
        from transformers import AutoConfig

        raw = dict(raw)
        return AutoConfig.for_model(raw.pop("model_type"), **raw)

    def check(self, cfg: Any) -> None:
        """Raise ``ValueError`` (one line naming the option) for an HF config ds_mp would train wrongly."""


__all__ = ["FamilyConfig", "HF_SHAPE_KEYS"]
