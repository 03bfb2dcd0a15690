"""Capacity planning: a discrete-event simulator of the rollout pipeline (docs/simulation.md)
and the episode-duration model it and the engine emulator share."""
