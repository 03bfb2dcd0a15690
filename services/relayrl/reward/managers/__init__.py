"""Reward managers: the contract (`base`), the closed table of built-in types (`table`) and
one module per type family."""
