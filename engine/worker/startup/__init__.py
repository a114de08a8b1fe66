"""Start-up: devices and dtype from the machine, CPU kernel choice, pool sizing and warm-up."""
