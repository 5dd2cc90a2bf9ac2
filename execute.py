#!/usr/bin/env python3
"""Strata's executor: run, bench, serve (the same as `strata <command>`)."""

import sys

from strata.entry import run

if __name__ == "__main__":
    sys.exit(run("execute_main"))
