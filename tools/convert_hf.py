"""Thin script for `grt-convert-hf` (same flags): python tools/convert_hf.py --help"""

import sys

from grt_megatron.hf.convert import main

if __name__ == "__main__":
    sys.exit(main())
