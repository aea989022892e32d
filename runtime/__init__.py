"""The ParaDecode runtime (issue 3)."""
