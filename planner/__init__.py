"""Pure planning: model descriptions from architecture files, the cost model, the placement ILP,
explain and diff. Imports only ``strata.common``."""
