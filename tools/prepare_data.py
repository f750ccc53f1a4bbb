"""Thin script for `grt-prepare-data` (same flags): python tools/prepare_data.py --help"""

from grt_megatron.data.prepare import main

if __name__ == "__main__":
    main()
