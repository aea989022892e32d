"""Command-line tools built on the exporter and the runtime."""
