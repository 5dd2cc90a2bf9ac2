#!/usr/bin/env python3
"""Strata's planner: describe, profile, plan, diff, explain (the same as `strata <command>`)."""

import sys

from strata.cli import plan_main

if __name__ == "__main__":
    sys.exit(plan_main())
