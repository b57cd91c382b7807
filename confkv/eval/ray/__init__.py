"""Ray: a grid's units on Ray actors (grid), and its speed against the in-process loop (speedup)."""
