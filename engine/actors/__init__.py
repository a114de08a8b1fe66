"""Actors: a mailbox, a compute thread and a step loop each; prefill, decode and colocated."""
