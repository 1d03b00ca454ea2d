"""The training job on one rank (layer 11): the trainer's loop and its ways to take a step,
the train state and its checkpoints, and live recovery's trainer."""
