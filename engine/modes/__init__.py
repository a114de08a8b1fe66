"""One object per serving mode: colocated, disaggregated, adaptive."""
