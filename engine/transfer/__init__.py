"""KV block transfer between two pools: torch copies and CuPy peer-to-peer."""
