#!/usr/bin/env python3
"""Strata's executor: run, bench, serve (the same as `strata <command>`)."""

import sys

from strata.cli import execute_main

if __name__ == "__main__":
    sys.exit(execute_main())
