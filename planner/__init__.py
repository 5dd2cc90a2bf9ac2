"""Strata's planner: model descriptions, hardware profiles, the placement ILP, plans."""

__version__ = "0.1.0"
