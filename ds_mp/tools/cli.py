"""``ds-mp``: the command-line tools around training.

    ds-mp prepare-data INPUTS... --out DIR      text/jsonl -> BPE tokenizer + token file
    ds-mp show-rows --data DIR [--row N]        a packed SFT training row decoded, its targets marked
    ds-mp convert hf-to-ds IN OUT --tp N --pp M / ds-to-hf IN OUT
    ds-mp plan --config X.json [--profile]      TeraPipe slicing plan and predicted speedup
    ds-mp eval --model DIR --data FILE          sliding-window perplexity, cloze accuracy
    ds-mp generate --model DIR --prompt TEXT    text from an HF or ds_mp checkpoint
    ds-mp lr-find --config X.json               LR range test (CSV + PNG)
    ds-mp timeline TRACE.json --out PNG         Gantt chart of a recorded pipeline trace
    ds-mp plot RUN_DIR                          loss / val loss / tokens/s / LR curves

Training itself runs under the DeepSpeed launcher: ``deepspeed --num_gpus N
launch/train.py --deepspeed_config X.json``.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "prepare-data": ("ds_mp.data", "prepare_data_cli", "tokenize text/jsonl files into a token file"),
    "show-rows": ("ds_mp.data.inspect_rows", "show_rows_cli", "print a packed SFT row: documents and targets"),
    "convert": ("ds_mp.checkpoint", "convert_cli", "convert checkpoints between HF and ds_mp layouts"),
    "plan": ("ds_mp.tools.plan", "plan_cli", "TeraPipe slicing plan for a config"),
    "eval": ("ds_mp.tools.evaluate", "eval_cli", "perplexity and cloze accuracy of a checkpoint"),
    "generate": ("ds_mp.tools.generate", "generate_cli", "generate text from a checkpoint"),
    "lr-find": ("ds_mp.tools.lr_find", "lr_find_cli", "learning-rate range test"),
    "timeline": ("ds_mp.tools.viz", "timeline_cli", "render a pipeline trace as a Gantt chart PNG"),
    "plot": ("ds_mp.tools.viz", "plot_cli", "plot loss, validation loss, tokens/s and LR of a run"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "usage: ds-mp COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"ds-mp: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
