"""Adapters for the frameworks users already train with: Lightning, the Transformers Trainer
and Accelerate (each an optional extra; importing one imports its library)."""
