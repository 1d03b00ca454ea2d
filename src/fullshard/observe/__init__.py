"""Observability (layer 10): runtime instruments of a sharded step: the timeline of every gather,
compute, free and reduce-scatter, and the memory tracker. (The planner is ``fullshard.plan``.)"""
