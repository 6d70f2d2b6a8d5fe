"""Pure-JAX text environments."""
