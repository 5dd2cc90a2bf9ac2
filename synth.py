#!/usr/bin/env python3
"""Write a synthetic GGUF of a real model's shape (the same as `strata synth`)."""

import sys

from strata.cli import synth_main

if __name__ == "__main__":
    sys.exit(synth_main())
