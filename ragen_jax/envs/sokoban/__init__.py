"""Sokoban: the env (``env``), its level generator (``generator``), the state and cell codes
they share (``types``) and an optimal BFS solver (``solver``)."""
