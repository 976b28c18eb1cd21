"""Local mode: the whole loop on one machine."""
