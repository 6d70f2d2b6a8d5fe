"""StarPO: advantages, losses, rollout filtering and the update."""
