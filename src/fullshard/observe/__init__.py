"""Observability (layer 10): communication and memory accounting, timelines, planning."""
