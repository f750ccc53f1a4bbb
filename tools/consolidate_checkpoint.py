"""Merge a sharded checkpoint (any TP/PP/DP layout) into one fp32 safetensors state dict.

    python tools/consolidate_checkpoint.py runs/x/checkpoints/step_00001000 --output model.safetensors [--optimizer]

The same as `grt-ckpt consolidate`.
"""

import sys

from grt_megatron.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main(["consolidate", *sys.argv[1:]]))
