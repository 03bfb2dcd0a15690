"""Capacity planning: a discrete-event simulator of the rollout pipeline (001 §13.2-13.3, §13.7)
and the episode-duration model it and the engine emulator share."""
