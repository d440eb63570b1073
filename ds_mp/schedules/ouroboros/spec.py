"""Ouroboros' :class:`~ds_mp.config.registry.ScheduleSpec`: K modules on K − 1 ring ranks
(``timetable``: the ring layout and per-rank steps), its runtime (``ds_mp.engine.ouroboros``) and
one optimizer group per module (``ds_mp.engine.ouroboros_modules``).  Light on purpose: config
validation imports it."""
from __future__ import annotations

from ds_mp.config.registry import ALL_FAMILIES, ScheduleSpec
from ds_mp.config.schema import ConfigError, DsMpConfig, InlineModel


class OuroborosSpec(ScheduleSpec):
    """The ring places its modules itself (``ouroboros.modules``/``split``), recomputes every delayed
    module's forward, and sets every module's gradients by hand after its delayed backward."""

    def check_layout(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        """K = ``ouroboros.modules`` modules on ``pipeline.stages`` = K − 1 ranks, split and replay options."""
        pp, oc = cfg.pipeline, cfg.ouroboros
        k = oc.modules or pp.stages + 1
        if k < 2:
            raise ConfigError(f"ds_mp.ouroboros.modules: K={k} < 2; Ouroboros needs at least 2 modules")
        if k != pp.stages + 1:
            raise ConfigError(f"ds_mp.ouroboros.modules: K={k} modules run on K-1 ranks, but "
                              f"pipeline.stages={pp.stages}; set pipeline.stages to {k - 1}")
        if k > shape.n_layer:
            raise ConfigError(f"ds_mp.ouroboros.modules: K={k} exceeds n_layer={shape.n_layer}; "
                              f"use at most {shape.n_layer} modules")
        self._check_split(oc.split, k, shape.n_layer)
        if oc.recompute not in ("current", "stashed", "none"):
            raise ConfigError(f"ds_mp.ouroboros.recompute: {oc.recompute!r} is not 'current' "
                              "(features replay with the current weights), 'stashed' (the forward's weights) or "
                              "'none' (keep the forward's activations: 'stashed' without the replay)")
        if oc.recompute == "none" and not oc.repeat_dropout:
            raise ConfigError("ds_mp.ouroboros.repeat_dropout: false draws fresh masks in a replay, but recompute "
                              "'none' keeps the forward's graph and replays nothing; use recompute 'stashed'")
        if pp.activation_checkpoint_interval:
            raise ConfigError("ds_mp.pipeline.activation_checkpoint_interval: ouroboros already recomputes every "
                              "delayed module's forward (features replay); set it to 0")
        if pp.partition == "cost":
            raise ConfigError("ds_mp.pipeline.partition: 'cost' balances pipeline stages, but the ouroboros schedule "
                              "places its modules by ouroboros.split; remove pipeline.partition")

    @staticmethod
    def _check_split(osplit: object, k: int, n_layer: int) -> None:
        """``ouroboros.split``: 'balanced', 'equal' or K block counts (a middle module never empty)."""
        if isinstance(osplit, list):
            if (len(osplit) != k or sum(osplit) != n_layer
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in osplit)
                    or any(n < 1 for n in osplit[1:-1])):
                raise ConfigError(f"ds_mp.ouroboros.split: {osplit} must be {k} block counts summing to "
                                  f"n_layer={n_layer}, at least 1 for every middle module")
        elif osplit not in ("balanced", "equal"):
            raise ConfigError(f"ds_mp.ouroboros.split: {osplit!r} is not 'balanced', 'equal' or a list of "
                              f"{k} block counts")

    def check_deepspeed(self, raw: dict, cfg: DsMpConfig) -> None:
        """Its module gradients are set on ``.grad`` by hand: fp32/bf16 at ZeRO 0, no immediate update."""
        if (raw.get("fp16") or {}).get("enabled"):
            raise ConfigError("fp16.enabled: the ouroboros schedule trains in fp32 or bf16 (fp16's loss scaling "
                              "would have to scale every delayed module's replay); use the bf16 block instead")
        if (raw.get("bf16") or {}).get("immediate_grad_update"):
            raise ConfigError("bf16.immediate_grad_update: the ouroboros schedule sets every module's gradients "
                              "after its delayed backward, which DeepSpeed's immediate update (hooks during backward) "
                              "never sees; set it to false")
        if (raw.get("zero_optimization") or {}).get("stage", 0):
            raise ConfigError("zero_optimization.stage: the ouroboros schedule supports ZeRO stage 0 (its "
                              "gradients are assembled by hand, outside ZeRO's reduction hooks); set it to 0")


OUROBOROS = OuroborosSpec(
    timetable="ds_mp.schedules.ouroboros.timetable:OuroborosSchedule", runtime="ds_mp.engine.ouroboros:attach",
    families=ALL_FAMILIES, noise_scale=False, delayed_gradients=True,
    param_groups="ds_mp.engine.ouroboros_modules:param_group_keys",
    batch_ramp=("ds_mp.batch_ramp: not supported with the ouroboros schedule: its updates apply gradients computed "
                "up to K-2 steps earlier, so a batch (and LR) change would mix batch sizes inside one update; use a "
                "fixed batch or another schedule"),
    lora=("ds_mp.lora: not supported with the ouroboros schedule (it assembles every module's gradients by hand); "
          "use 1f1b, gpipe or terapipe"),
    context_parallel=("ds_mp.context_parallel: not supported with the ouroboros schedule (its own module runner "
                      "feeds and replays whole sequences, not CP shards); use 1f1b, gpipe, zb-h1, zb-v or "
                      "interleaved"),
    carry=("output_router_logits: the ouroboros schedule's delayed modules do not pass a MoE's router statistics "
           "along its ring; use another pipeline.schedule or set output_router_logits to false"))
