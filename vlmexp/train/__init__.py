"""Training stages: one readable entry point per stage (sft.py, grpo.py) over TRL's trainers."""
