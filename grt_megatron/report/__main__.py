"""`python -m grt_megatron.report` = `grt-report`."""

from grt_megatron.report import main

main()
