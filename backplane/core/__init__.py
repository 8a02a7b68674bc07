"""The executor's core: hook specs, registry, contracts, scheduling, memory and execution."""
