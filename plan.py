#!/usr/bin/env python3
"""Strata's planner: describe, profile, plan, diff, explain (the same as `strata <command>`)."""

import sys

from strata.entry import run

if __name__ == "__main__":
    sys.exit(run("plan_main"))
