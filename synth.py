#!/usr/bin/env python3
"""Write a synthetic GGUF of a real model's shape (the same as `strata synth`)."""

import sys

from strata.entry import run

if __name__ == "__main__":
    sys.exit(run("synth_main"))
