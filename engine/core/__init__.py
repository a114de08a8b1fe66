"""Plain-Python engine state: requests and messages, sequences, batches, block manager, schedulers."""
