"""Converts a Hugging Face / PyTorch checkpoint into an mbd-jax model directory.

    python tools/convert_weights.py --src HF_DIR --dst OUT_DIR [--family auto|llada2_moe|sdar|sdar_moe]
        [--dtype bfloat16|float32] [--mask-token-id N] [--block-size 32]

Same as `mbd-jax convert`. See docs/conversion.md.
"""

import sys

from mbd_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
