"""Llama-family model, its layers and rotary tables, checkpoint loading, demo checkpoints."""
