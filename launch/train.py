"""Train GPT-2 with ds_mp under the DeepSpeed launcher.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/quickstart.json
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/quickstart.json --resume

On CPU-only machines ``--num_gpus N`` starts N CPU ranks (gloo).  All options live in the
JSON's "ds_mp" block; see README "Config reference".
"""
import sys

from ds_mp.engine.initialize import shutdown_distributed
from ds_mp.training.loop import main

if __name__ == "__main__":
    code = main()
    shutdown_distributed(clean=code == 0)
    sys.exit(code)
