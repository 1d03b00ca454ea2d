"""Sharding arithmetic (layer 3): pure tensor math, no collectives."""
